"""Executor benchmark: whole-layer vs exact prefill of a long prompt, staged vs hot vs exact
decode; each arm in its own process, all arms in one run; "cold" arms first evict the store's
files from the page cache (posix_fadvise DONTNEED).

Usage: python scripts/bench_executors.py [--prompt-tokens 256] [--decode-tokens 48]
       [--out docs/benchmarks/executors.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.make import make_hf_fixture  # noqa: E402

SHAPE = {
    "hidden_size": 512,
    "moe_intermediate_size": 256,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 8,
}

PROBE = r"""
import json, sys, time
import edge0
from edge0.backend import core as B
from edge0.backend import forward as bfw
from edge0.backend import kvcache as bkv
import os
from pathlib import Path
store, arm, n_prompt, n_decode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kind, executor, temp = arm.split(":")
if temp == "cold":  # evict the store's files from the page cache
    for f in Path(store).rglob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
if kind == "prefill":
    # one token at a time: every forward has T=1, so the exact executor serves decode too
    if executor == "exact-per-token":
        opts = {"prefill_executor": "exact", "decode_executor": "exact"}
    else:
        opts = {"prefill_executor": executor}
else:
    opts = {"decode_executor": executor, "prefill_executor": "exact"}
e = edge0.load(store, **opts)
prompt = [(7 * i) % 250 + 3 for i in range(n_prompt)]
if kind == "prefill":
    cache = bkv.make_prompt_cache(e.model)
    t0 = time.perf_counter()
    bfw.prefill(e.model, prompt, cache, step=1 if executor == "exact-per-token" else 2048)
    dt = time.perf_counter() - t0
    out = {"prefill_tps": n_prompt / dt, "seconds": dt}
else:
    e.generate(prompt[:16], max_tokens=8, ignore_eos=True)  # warm up: fill the cache
    r = e.generate(prompt[:16], max_tokens=n_decode, ignore_eos=True)
    out = {"decode_tps": r.stats["decode_tps"], "stall_ms_per_step": r.stats["stall_ms_per_step"],
           "hit_rate": r.stats["expert_hit_rate"], "host_syncs": r.stats["host_syncs"]}
t = e.stats()["totals"]
out.update({"bytes_read": t["bytes_read"], "loads": t["loads"], "mlx_peak": B.peak_memory(), "rss_peak": B.peak_rss()})
print(json.dumps(out))
"""

ARMS = [
    "prefill:whole:warm",
    "prefill:exact:warm",
    "prefill:exact-per-token:warm",
    "prefill:whole:cold",
    "prefill:exact:cold",
    "prefill:exact-per-token:cold",
    "decode:staged:warm",
    "decode:hot:warm",
    "decode:exact:warm",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--out", default="docs/benchmarks/executors.json")
    args = p.parse_args()
    from edge0.store.convert import convert

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_hf_fixture("qwen3_moe", Path(tmp) / "hf", dtype="bfloat16", **SHAPE)
        store = convert(str(hf), Path(tmp) / "store", quiet=True)
        for arm in ARMS:
            out = subprocess.run(
                [sys.executable, "-c", PROBE, str(store), arm, str(args.prompt_tokens), str(args.decode_tokens)],
                capture_output=True,
                text=True,
                check=True,
            )
            rows[arm] = json.loads(out.stdout.strip().splitlines()[-1])
            print(arm, json.dumps(rows[arm]), flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.node()}, 2 cores",
        "command": " ".join(sys.argv),
        "shape": SHAPE,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
