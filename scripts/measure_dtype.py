"""Measure the compute dtype choice on this machine: decode tok/s of one store at each dtype,
side by side in one run (each dtype in its own process).

Usage: python scripts/measure_dtype.py [--tokens 32] [--out docs/benchmarks/dtype.json]
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
    "moe_intermediate_size": 512,
    "num_experts": 32,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
}

PROBE = r"""
import json, sys
import edge0
e = edge0.load(sys.argv[1], dtype=sys.argv[2])
e.generate("warm up", max_tokens=4, ignore_eos=True)
r = e.generate("hello world once upon a time", max_tokens=int(sys.argv[3]), ignore_eos=True)
print(json.dumps({"decode_tps": r.stats["decode_tps"], "prefill_tps": r.stats["prefill_tps"]}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default="docs/benchmarks/dtype.json")
    args = p.parse_args()
    from edge0.store.convert import convert

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_hf_fixture("qwen3_moe", Path(tmp) / "hf", dtype="bfloat16", **SHAPE)
        store = convert(str(hf), Path(tmp) / "store", quiet=True)
        for dt in ("float32", "bfloat16", "float16"):
            out = subprocess.run(
                [sys.executable, "-c", PROBE, str(store), dt, str(args.tokens)],
                capture_output=True,
                text=True,
                check=True,
            )
            rows[dt] = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{dt:9s} decode {rows[dt]['decode_tps']:7.1f} tok/s  prefill {rows[dt]['prefill_tps']:7.1f} tok/s",
                flush=True,
            )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.node()}",
        "command": " ".join(sys.argv),
        "shape": SHAPE,
        "checkpoint_dtype": "bfloat16",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
