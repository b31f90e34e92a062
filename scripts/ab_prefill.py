"""mlx-lm's prefill against Edge0's layer-major prefill in one process, alternated (docs/long-prompts.md).

Both load the same bench model (mlx/ for mlx-lm, store/ for Edge0) and generate one token after
the bench's prompt of N tokens; each line gives both times and their ratio.

    PYTHONPATH=$PWD python scripts/ab_prefill.py /work/bench-quick 1024 --repeats 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import edge0
from edge0.backend import resident
from edge0.bench.child import prompt_ids


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="bench-model directory (mlx/ + store/)")
    ap.add_argument("tokens", type=int)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    engine = edge0.load(args.model / "store")
    model, _, _, _ = resident.load(args.model / "mlx", None)
    ids = prompt_ids(engine.tokenizer, args.tokens)
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in resident.generate_tokens(model, ids, 1):
            pass
        ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.generate(ids, max_tokens=1, ignore_eos=True)
        ours = time.perf_counter() - t0
        print(
            f"{args.tokens} tokens: mlx-lm {ref:.1f} s, edge0 {ours:.1f} s (edge0 / mlx-lm {ours / ref:.2f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
