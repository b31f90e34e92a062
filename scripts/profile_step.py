#!/usr/bin/env python3
"""Where a decode step's time goes: wall time of each engine step hook (graph build, the
stager's swap and its launch-and-stage pass, the sample's wait, end of step), per step.

    python scripts/profile_step.py --model STORE [--prerouter HEADS | --executor exact|staged] \
        [--expert-cache 408MB] [--tokens 17]

Timings are in-process and include whatever else the machine runs; compare runs made back to
back. The benchmark suite (`edge0 bench`) is the reference for speed.
"""

from __future__ import annotations

import argparse
import collections
import time

import edge0
from edge0.backend import forward as bfw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="edge0 store")
    p.add_argument("--prerouter", help="heads file: staged decode with the pre-router")
    p.add_argument(
        "--executor", choices=["exact", "staged"], default="staged", help="decode executor without --prerouter"
    )
    p.add_argument("--expert-cache", default=None, help="expert cache size (e.g. 408MB)")
    p.add_argument("--tokens", type=int, default=17, help="decode steps timed (after a 4-token warm-up)")
    args = p.parse_args()
    if args.prerouter:
        e = edge0.load(args.model, prerouter=args.prerouter, lora=False, expert_cache=args.expert_cache)
    elif args.executor == "exact":
        e = edge0.load(args.model, prerouter=False, lora=False, prefill_executor="exact", decode_executor="exact")
    else:
        e = edge0.load(args.model, prerouter=False, lora=False, expert_cache=args.expert_cache)
    print(e.describe())
    spent = collections.defaultdict(float)

    def timed(obj, name, label):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0

        setattr(obj, name, wrapper)

    if e.prerouting is not None:
        timed(e.hooks, "before_step", "swap (stager.before_step)")
        timed(e.hooks, "after_forward", "launch + stage (stager.after_forward)")
    timed(bfw, "forward", "graph build (forward)")
    timed(bfw, "sample", "sample (waits for the step)")
    timed(e.streaming, "end_step", "end of step (dropped counters)")
    ids = e.encode("The history of the river begins in the mountains where " * 3)[:40]
    e.generate(ids, max_tokens=4, ignore_eos=True)
    spent.clear()
    res = e.generate(ids, max_tokens=args.tokens, ignore_eos=True)
    steps = args.tokens  # the first step is the prompt's last token; its prefill is not in the hooks
    print(f"decode {res.stats['decode_tps']:.2f} tok/s")
    for label, s in spent.items():
        print(f"{label:40s} {1000 * s / steps:8.1f} ms/step")
    print(f"{'sum':40s} {1000 * sum(spent.values()) / steps:8.1f} ms/step")


if __name__ == "__main__":
    main()
