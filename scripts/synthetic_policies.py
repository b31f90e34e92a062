"""Cache policies on synthetic qwen3-like routes (docs/cache-policies.md): the learned FlashMoE
policy trained on one text through a synthetic model and evaluated on another text through the
same model, next to LRU, LFU, ARC, SMoE and Belady; and, as a caveat, evaluated on another model.

    python scripts/synthetic_policies.py [--out docs/benchmarks/synthetic-policies.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from edge0.cache import tracefile
from edge0.cache.synthetic import synthetic_trace
from edge0.cli.simulate import QWEN3_30B_EXPERT_BYTES

E, K, LAYERS, STEPS = 128, 8, 8, 2000


def simulate(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "edge0", "simulate", "--json", *args], capture_output=True, text=True, check=True
    )
    return {f"{r['policy']}@{r['budget']}": round(100 * r["hit_rate"], 1) for r in json.loads(out.stdout)["results"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        train = Path(d) / "train.npz"
        weights = Path(d) / "flashmoe.safetensors"
        tracefile.write(
            train,
            synthetic_trace(
                E,
                K,
                list(range(LAYERS)),
                [QWEN3_30B_EXPERT_BYTES] * LAYERS,
                STEPS,
                seed=0,
                meta={"model": "synthetic qwen3-like"},
                text_seed=1,
            ),
        )
        subprocess.run(
            [sys.executable, "-m", "edge0", "train-cache-policy", "--trace", str(train), "--out", str(weights)],
            check=True,
            capture_output=True,
        )
        common = [
            "--routing",
            "qwen3-like",
            "--experts",
            str(E),
            "--top-k",
            str(K),
            "--layers",
            str(LAYERS),
            "--steps",
            str(STEPS),
            "--cache-weights",
            str(weights),
        ]
        result = {
            "same_model_other_text": simulate([*common, "--seed", "0", "--text-seed", "2"]),
            "other_model": simulate([*common, "--seed", "7", "--text-seed", "2"]),
            "setup": {
                "experts": E,
                "top_k": K,
                "layers": LAYERS,
                "steps": STEPS,
                "train": "model seed 0, text seed 1",
                "same_model_other_text": "model seed 0, text seed 2",
                "other_model": "model seed 7, text seed 2",
            },
        }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
