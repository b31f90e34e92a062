"""Where a layer-major prefill's time goes: the attention pass, the MoE pass and the last layer's
cache, summed over the layers (docs/benchmarks.md "Long prompts against mlx-lm").

    PYTHONPATH=$PWD python scripts/time_prefill_passes.py DIR/store 16384
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import edge0
from edge0.backend import layerwise
from edge0.bench.child import prompt_ids


def timed(fn, key, spent):
    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            spent[key(self)] += time.perf_counter() - t0

    return wrapper


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("tokens", type=int)
    args = ap.parse_args(argv)
    engine = edge0.load(args.store)
    ids = prompt_ids(engine.tokenizer, args.tokens)
    spent = collections.defaultdict(float)
    span = layerwise.SpanLayer
    span._attention = timed(span._attention, lambda s: "last layer's cache" if s.last else "attention", spent)
    span._moe = timed(span._moe, lambda s: "MoE", spent)
    t0 = time.perf_counter()
    engine.generate(ids, max_tokens=1, ignore_eos=True)
    total = time.perf_counter() - t0
    print(f"{args.tokens} tokens: {total:.2f} s; " + ", ".join(f"{k} {v:.2f} s" for k, v in spent.items()))


if __name__ == "__main__":
    main()
