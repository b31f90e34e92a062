"""Which experts keep a staged layer's slots when a multi-token call (a verify, a batch's step)
routes more distinct experts than it has slots, and what a batch's stage puts in them. Pure
functions of host ids and use counts: the staged executor (streaming/staged.py) acts on them."""

from __future__ import annotations

from collections import Counter

import numpy as np

# a call's weight in `use` halves in about 7 calls: a batch's experts of the last few steps
# (0.8-0.95 read within 2% of each other in the slot simulation, docs/benchmarks.md "Several sequences at once";
# this call's counts alone 12% more)
USE_DECAY = 0.9


def admission_order(ids: np.ndarray) -> list[int]:
    """The distinct experts of a multi-token call's routes (ids [..., T, K]): those routed by the
    most of its tokens first, then the later tokens' first. Both are the likeliest to be routed
    again by the next step; against earliest-token first this read 2-5% fewer bytes per token in
    verifies (docs/speculative.md)."""
    rows = ids.reshape(-1, ids.shape[-1])  # T tokens, K routed each
    counts = Counter(rows.reshape(-1).tolist())
    latest_first = dict.fromkeys(rows[::-1].reshape(-1).tolist())
    return sorted(latest_first, key=lambda e: -counts[e])  # stable: latest first among equal counts


def seed_order(routes: np.ndarray, n_slots: int, num_experts: int, cached) -> list[int]:
    """The experts a prefill's whole-layer read leaves in a layer's `n_slots` decode slots, given
    the route of its last call (host ids [.., K]): those that call routed most, then latest
    (`admission_order`), as many as the slots hold, best last (the most recent to the cache
    policy); every expert when the slots hold them all. The next token routed 77% of them where
    only the last token's experts held 30% (synthetic qwen3-like routes, 25 of 128 slots,
    docs/benchmarks.md). Those `cached` already are left out."""
    want = range(num_experts) if n_slots >= num_experts else admission_order(routes)[:n_slots][::-1]
    return [e for e in want if e not in cached]


def decayed_use(use: np.ndarray, ids) -> np.ndarray:
    """Use counts [E] after a call routing `ids` (any shape): decayed once, +1 per (token, k)."""
    use = use * USE_DECAY
    np.add.at(use, np.reshape(ids, -1), 1)
    return use


def split_cached(order: list[int], cached) -> tuple[list[int], list[int]]:
    """Experts `order` -> (those in `cached`, the others), each in their order."""
    return [e for e in order if e in cached], [e for e in order if e not in cached]


def overflow_split(order: list[int], cached, use: np.ndarray, n_slots: int) -> tuple[list, list, list]:
    """A union wider than the slots (`order`: its experts in `admission_order`) -> (the cached
    ones, the misses that take a slot, the misses read for this call only). The misses compete
    for the slots with the cached experts this call does not route, by recent use: a miss is
    admitted only if it was routed more lately than a cached expert it would displace (ties keep
    the cached one; misses of equal use go in admission order). Against admitting misses into
    every free slot, a batch of 4 reads 11% fewer experts a token (the slot simulation in docs/benchmarks.md)."""
    hits, misses = split_cached(order, cached)
    routed = set(order)
    others = [e for e in cached if e not in routed]
    free = n_slots - len(hits)  # the others, and any empty slots
    # stable sort: cached first, then misses in admission order, among equal use
    ranked = sorted([(e, True) for e in others] + [(e, False) for e in misses], key=lambda p: -use[p[0]])
    won = {e for e, was_cached in ranked[:free] if not was_cached}
    return hits, [e for e in misses if e in won], [e for e in misses if e not in won]


def call_split(ids: np.ndarray, cached, use: np.ndarray, n_slots: int) -> tuple[list, list, list] | None:
    """A host-routed call's routes (ids [..., T, K]; `use` already counting them) -> None when
    their union fits the slots, else their `overflow_split` in `admission_order`."""
    if len(np.unique(ids)) <= n_slots:
        return None
    return overflow_split(admission_order(ids), cached, use, n_slots)


def stage_split(rows: np.ndarray, cached, use: np.ndarray, n_slots: int) -> tuple[list[int], list[int]]:
    """A batch's next routes (host ids [B, K]) -> (the experts to stage into the slots, those read
    ahead for the step only), each sorted. A union beyond the slots splits as the step's own
    overflow will, ranked by the use that step counts with its route: staging other misses would
    evict experts the step then reads again."""
    order = admission_order(rows)
    if len(order) <= n_slots:
        return sorted(order), []
    kept, admit, rest = overflow_split(order, cached, decayed_use(use, rows), n_slots)
    return sorted(kept + admit), sorted(rest)
