"""Experts read per token, one after another against a batch, under synthetic qwen3-like routes:
a simulation of the staged executor's slots (no model, no timing; seconds).

Per MoE layer, a step needs the union U of its tokens' routes; it reads U minus the slots S it
starts with, then a rule picks the next slots from U | S. Two rules:
- `lru`: what the staged executor does: the union in admission order (cached first, then the
  experts the most rows route, latest first), the first n_slots of it marked most recent in an
  LRU of n_slots (one token alone: its route, LRU);
- `decayed-frequency D`: the n_slots experts of U | S with the highest use count, decayed by D
  a step; a rarely routed expert of this step's route is read for the step only and not kept
  (admission control, which the live cache policies do not have).

One after another: texts 0..B-1 decode in turn through one slot set; batched: the B texts decode
together, a token each per step. Routes as the concurrency bench's (`edge0 bench --routing
qwen3-like`: model seed 0, text r = text seed r). The defaults are the quick bench model's shape
and its 20% expert cache (16 slots of 64 experts, top-8, 8 MoE layers).

    python scripts/sim_batch_reads.py [--batch 4] [--tokens 64] [--slots 16] [--experts 64]
        [--top-k 8] [--layers 8] [--decay 0.9]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge0.cache.synthetic import RouteSource  # noqa: E402


def admission_order(rows: np.ndarray) -> list[int]:
    """The staged executor's order (edge0/streaming/staged.py): most rows first, latest first."""
    counts = Counter(rows.reshape(-1).tolist())
    latest_first = dict.fromkeys(rows[::-1].reshape(-1).tolist())
    return sorted(latest_first, key=lambda e: -counts[e])


class LRUSlots:
    def __init__(self, n: int):
        self.n, self.order = n, []  # least recent first

    def next_slots(self, rows: np.ndarray, slots: set) -> set:
        order = admission_order(rows)
        chosen = ([e for e in order if e in slots] + [e for e in order if e not in slots])[: self.n]
        for e in reversed(chosen):  # the first of the order ends most recent
            if e in self.order:
                self.order.remove(e)
            self.order.append(e)
        del self.order[: max(0, len(self.order) - self.n)]
        return set(self.order)


class DecayedFrequencySlots:
    def __init__(self, n: int, experts: int, decay: float):
        self.n, self.decay, self.count = n, decay, np.zeros(experts)

    def next_slots(self, rows: np.ndarray, slots: set) -> set:
        self.count *= self.decay
        for r in rows:
            self.count[r] += 1
        candidates = sorted(set(rows.reshape(-1).tolist()) | slots)
        return set(sorted(candidates, key=lambda e: -self.count[e])[: self.n])


def routes(args, text: int) -> np.ndarray:
    """Text `text`'s routes [tokens, layers, K]."""
    src = RouteSource(args.experts, args.top_k, args.layers, 0, text_seed=text or None)
    return np.stack([src.next() for _ in range(args.tokens)])


def reads_per_token(args, make_rule, batched: bool) -> float:
    texts = [routes(args, r) for r in range(args.batch)]
    read = 0
    for layer in range(args.layers):
        rule, slots = make_rule(), set()
        if batched:
            steps = [np.stack([t[i, layer] for t in texts]) for i in range(args.tokens)]
        else:
            steps = [t[i, layer][None] for t in texts for i in range(args.tokens)]
        for rows in steps:
            read += len(set(rows.reshape(-1).tolist()) - slots)
            slots = rule.next_slots(rows, slots)
    return read / (args.layers * args.tokens * args.batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--decay", type=float, default=0.9)
    args = p.parse_args()
    rules = {
        "lru (the staged executor)": lambda: LRUSlots(args.slots),
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
