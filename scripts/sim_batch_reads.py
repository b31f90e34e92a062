"""Experts read per token, one after another against a batch, under synthetic qwen3-like routes:
a simulation of the staged executor's slots (no model, no timing; seconds).

Per MoE layer, a step needs the union U of its tokens' routes and reads the part of U not in
its slots. Three slot rules:
- `recent use` (the staged executor, edge0/streaming/staged.py): an LRU `ExpertCache` of n_slots
  takes U; a U wider than the slots goes through `overflow_split` (its misses take a slot only
  from a cached expert routed less lately; the others are read for the step only);
- `admission order` (the staged executor before): a U wider than the slots fills every free
  slot with its misses, most rows first, latest first;
- `decayed frequency D, admission control` (a lead, not built): the n_slots experts of U | slots
  with the highest use count, decayed by D a step; a rarely routed expert is read for its step
  only, also for one token alone (the live cache admits every routed expert of a one-token step).

One after another: texts 0..B-1 decode in turn through one slot set; batched: the B texts decode
together, a token each per step. Routes as the concurrency bench's (`edge0 bench --routing
qwen3-like`: model seed 0, text r = text seed r). The defaults are the quick bench model's shape
and its 20% expert cache (16 slots of 64 experts, top-8, 8 MoE layers) and the bench's 16 tokens.

    python scripts/sim_batch_reads.py [--batch 4] [--tokens 16] [--slots 16] [--experts 64]
        [--top-k 8] [--layers 8] [--decay 0.9]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge0.cache import ExpertCache, make_policy  # noqa: E402
from edge0.cache.synthetic import RouteSource  # noqa: E402
from edge0.streaming.staged import admission_order, decayed_use, overflow_split, split_cached  # noqa: E402


class StagedSlots:
    """The staged executor's host-routed step on one layer's slots (its bookkeeping, no tensors)."""

    def __init__(self, n: int, experts: int, by_use: bool = True):
        self.n, self.by_use = n, by_use
        self.cache = ExpertCache(make_policy("lru", n, experts))
        self.use = np.zeros(experts)
        self.step = 0

    def reads(self, rows: np.ndarray) -> int:
        self.step += 1
        self.use = decayed_use(self.use, rows)
        order = admission_order(rows)
        if len(order) <= self.n:
            return len(self.cache.access(self.step, sorted(order))[1])
        cached = dict.fromkeys(self.cache.cached)
        if self.by_use:
            hits, admit, rest = overflow_split(order, cached, self.use, self.n)
        else:
            hits, misses = split_cached(order, cached)
            admit, rest = misses[: self.n - len(hits)], misses[self.n - len(hits) :]
        self.cache.access(self.step, hits + admit)
        return len(admit) + len(rest)


class DecayedFrequencySlots:
    def __init__(self, n: int, experts: int, decay: float):
        self.n, self.decay, self.count, self.slots = n, decay, np.zeros(experts), set()

    def reads(self, rows: np.ndarray) -> int:
        self.count *= self.decay
        np.add.at(self.count, rows.reshape(-1), 1)
        routed = set(rows.reshape(-1).tolist())
        read = len(routed - self.slots)
        self.slots = set(sorted(routed | self.slots, key=lambda e: -self.count[e])[: self.n])
        return read


def routes(args, text: int) -> np.ndarray:
    """Text `text`'s routes [tokens, layers, K]."""
    src = RouteSource(args.experts, args.top_k, args.layers, 0, text_seed=text or None)
    return np.stack([src.next() for _ in range(args.tokens)])


def reads_per_token(args, make_rule, batched: bool) -> float:
    texts = [routes(args, r) for r in range(args.batch)]
    read = 0
    for layer in range(args.layers):
        rule = make_rule()
        if batched:
            steps = [np.stack([t[i, layer] for t in texts]) for i in range(args.tokens)]
        else:
            steps = [t[i, layer][None] for t in texts for i in range(args.tokens)]
        read += sum(rule.reads(rows) for rows in steps)
    return read / (args.layers * args.tokens * args.batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--decay", type=float, default=0.9)
    args = p.parse_args()
    rules = {
        "recent use (the staged executor)": lambda: StagedSlots(args.slots, args.experts),
        "admission order (before)": lambda: StagedSlots(args.slots, args.experts, by_use=False),
        f"decayed frequency {args.decay}, admission control": lambda: DecayedFrequencySlots(
            args.slots, args.experts, args.decay
        ),
    }
    print(f"experts read per layer and token: B = {args.batch}, {args.tokens} tokens, {args.slots} slots")
    print("| slot rule | one after another | batched | batched / one after another |")
    print("|---|---|---|---|")
    for name, make in rules.items():
        alone, together = reads_per_token(args, make, False), reads_per_token(args, make, True)
        print(f"| {name} | {alone:.3f} | {together:.3f} | {together / alone:.2f} |")


if __name__ == "__main__":
    main()
