"""Measure the converter's peak memory as the model grows (more layers, same layer shape).

Usage: python scripts/measure_convert_memory.py [--layers 2 4 8] [--out docs/benchmarks/convert-memory.json]

Each conversion runs in its own process; peak RSS is VmHWM and the MLX peak is the allocator's.
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

from tests.fixtures.make import make_hf_fixture, routed_expert_bytes  # noqa: E402

SHAPE = {
    "hidden_size": 512,
    "moe_intermediate_size": 512,
    "num_experts": 64,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}

PROBE = r"""
import json, sys
from edge0.backend import core as B
import edge0.store.convert, mlx_lm, transformers
before = B.peak_rss()
edge0.store.convert.convert(sys.argv[1], sys.argv[2], quiet=True)
print(json.dumps({"rss_before": before, "rss_peak": B.peak_rss(), "mlx_peak": B.peak_memory()}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--out", default="docs/benchmarks/convert-memory.json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.layers:
            hf = make_hf_fixture("qwen3_moe", Path(tmp) / f"hf{n}", dtype="bfloat16", num_hidden_layers=n, **SHAPE)
            routed, other = routed_expert_bytes(hf)
            out = subprocess.run(
                [sys.executable, "-c", PROBE, str(hf), str(Path(tmp) / f"st{n}")],
                capture_output=True,
                text=True,
                check=True,
            )
            m = json.loads(out.stdout.strip().splitlines()[-1])
            # The largest tensor the converter materialises at once: one projection of one layer,
            # all experts stacked, in the source dtype.
            largest = SHAPE["num_experts"] * SHAPE["moe_intermediate_size"] * SHAPE["hidden_size"] * 2
            row = {
                "layers": n,
                "source_bytes": routed + other,
                "largest_stacked_source_tensor": largest,
                **m,
                "rss_growth": m["rss_peak"] - m["rss_before"],
            }
            rows.append(row)
            print(
                f"layers {n}: source {row['source_bytes'] / 2**20:.0f} MiB, RSS growth "
                f"{row['rss_growth'] / 2**20:.0f} MiB, "
                f"MLX peak {m['mlx_peak'] / 2**20:.0f} MiB, largest stacked tensor {largest / 2**20:.0f} MiB",
                flush=True,
            )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.node()}",
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "shape": SHAPE,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
