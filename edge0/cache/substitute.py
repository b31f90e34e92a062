"""SMoE substitution (lossy, off by default): swap a weakly routed expert that is not cached for
a cached expert the router scored almost as high. It saves reads and CHANGES THE MODEL'S OUTPUT.

With S = S_{k+1}, the best score among experts not selected (the (k+1)-th highest score when the
selection is the top-k): a selected, uncached expert with score in [S, (1+alpha)*S] may be
replaced by a cached, unselected expert with score in [(1-alpha)*S, S]. The weakest routed
experts are replaced first, by the strongest substitutes; each substitute is used once.
"""

from __future__ import annotations

import numpy as np


def substitute(scores, selected, cached, alpha: float):
    """Return (indices, n): `selected` with substitutions applied (same shape, a new array) and
    the number of substitutions. `scores` [E] or [T, E] router scores over all experts,
    `selected` [K] or [T, K] expert ids, `cached` the set of cached expert ids. alpha=0 (the
    default everywhere) returns `selected` unchanged."""
    if alpha < 0:
        raise ValueError(f"substitution alpha must be >= 0 (got {alpha})")
    scores, out = np.asarray(scores), np.array(selected, copy=True)
    if alpha == 0 or out.size == 0:
        return out, 0
    cached = set(int(e) for e in cached)
    rows_s, rows_i = scores.reshape(-1, scores.shape[-1]), out.reshape(-1, out.shape[-1])
    n = 0
    for s, idx in zip(rows_s, rows_i):
        n += _substitute_row(s, idx, cached, alpha)
    return out, n


def _substitute_row(s: np.ndarray, idx: np.ndarray, cached: set[int], alpha: float) -> int:
    """Apply substitutions to one token's `idx` in place; returns how many."""
    chosen = set(int(e) for e in idx)
    rest = np.ones(s.shape[0], dtype=bool)
    rest[idx] = False
    if not rest.any():
        return 0
    bound = float(s[rest].max())
    hi, lo = (1 + alpha) * bound, (1 - alpha) * bound
    weak = sorted(
        (p for p, e in enumerate(idx) if int(e) not in cached and bound <= s[e] <= hi), key=lambda p: s[idx[p]]
    )
    subs = sorted(
        (e for e in cached if e not in chosen and 0 <= e < s.shape[0] and lo <= s[e] <= bound), key=lambda e: -s[e]
    )
    for p, e in zip(weak, subs):
        idx[p] = e
    return min(len(weak), len(subs))
