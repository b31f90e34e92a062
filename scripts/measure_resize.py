"""Measure what shrinking the expert cache gives back (docs/server.md, "Memory pressure").

Usage: PYTHONPATH=$PWD python scripts/measure_resize.py

On the memory fixture (128 experts x 2 MoE layers, 108 MiB of int4 experts, the store of
tests/test_memory.py), in a process of its own (so the conversion's memory does not blur RSS):
load with every expert cached, decode 48 tokens, shrink to the floor (top-k slots per layer) and
grow back, timing each resize and reading the process RSS (VmRSS) and MLX's active memory; the
greedy tokens must not change.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure(store: str) -> dict:
    import edge0
    from edge0.backend import core as B

    def row(state, **kw):
        return {
            "state": state,
            "slots": engine.expert_cache()["slots_per_layer"],
            **kw,
            "rss_mib": round(rss_mib(), 1),
            "mlx_active_mib": round(B.active_memory() / 2**20, 1),
        }

    engine = edge0.load(store, expert_cache="1GB", prefill_executor="exact")
    prompt = list(range(10, 400, 3))
    want = engine.generate(prompt, max_tokens=48, ignore_eos=True).tokens
    rows = [row("loaded, after a 48-token decode")]
    for n, state in (
        (engine.expert_cache()["min_slots"], "shrunk to the floor"),
        (engine.expert_cache()["configured_slots"], "grown back"),
    ):
        t0 = time.perf_counter()
        engine.resize_expert_cache(n)
        rows.append(row(state, resize_s=round(time.perf_counter() - t0, 4)))
        assert engine.generate(prompt, max_tokens=48, ignore_eos=True).tokens == want
    return {"slot_bytes": engine.expert_cache()["slot_bytes"], "rows": rows}


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--store":
        print(json.dumps(measure(sys.argv[2])))
        return
    from edge0.store.convert import convert
    from tests.conftest import BIG
    from tests.fixtures.make import make_memory_fixture

    with tempfile.TemporaryDirectory() as tmp:
        hf, _ = make_memory_fixture(Path(tmp) / "hf", **BIG)
        with contextlib.redirect_stderr(io.StringIO()):
            store = convert(str(hf), Path(tmp) / "store", quiet=True)
        out = subprocess.run(
            [sys.executable, __file__, "--store", str(store)], capture_output=True, text=True, check=True
        ).stdout
    print(json.dumps(json.loads(out), indent=1))


if __name__ == "__main__":
    main()
