"""Experts a token's decode call computes before its route reaches the host: the best-scored of
the layer before's prediction (streaming/lookahead.py) that are in its slots already. The device
computes them while the host waits for the route's sync and plans the call, so the compute no
longer idles there; the route's pairs to them take their outputs, and the other experts compute
after the sync as before. Tokens never change: the route is still the layer's own gate's. Pure
functions of host ids: the staged executor (streaming/staged.py) acts on them."""

from __future__ import annotations

# A prediction's top 4 of 8 were routed 99-100% of the time on the full bench model, its 6th to
# 8th 89%, 82% and 62% (docs/benchmarks.md): an expert computed for nothing costs as much compute
# as the wait it hides, so only the best-scored are computed early.
EARLY_EXPERTS = 4
EARLY_RECALL = 0.8  # ... and only while the layer's predictions agree (streaming/lookahead.recall_after)


def early_experts(predicted, cached, recall: float, n_slots: int, k: int, n: int = EARLY_EXPERTS) -> list[int]:
    """The experts to compute before the route: of the `n` (at most `k`) best-scored `predicted`
    (one token's host ids, best first; None: no such prediction), those `cached` (in the slots),
    while `recall` is at least EARLY_RECALL; none if the slots cannot keep them besides a route of
    `k` (their slots are not rewritten by the call)."""
    if not n or predicted is None or recall < EARLY_RECALL or n_slots < 2 * k:
        return []
    return [e for e in predicted[: min(n, k)].tolist() if e in cached]


def after_route(order: list[int], early: list[int], cached) -> tuple[list[int], list[int], list[int], list[int]]:
    """A token's route `order` (its K expert ids) against the experts computed `early`: (the pairs
    they serve, the row of `early` serving each, the other pairs whose expert is `cached`, the
    distinct experts not cached: the misses, sorted)."""
    at = {e: i for i, e in enumerate(early)}
    served = [i for i, e in enumerate(order) if e in at]
    hits = [i for i, e in enumerate(order) if e not in at and e in cached]
    return served, [at[order[i]] for i in served], hits, sorted(set(order) - cached.keys())
