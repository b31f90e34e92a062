"""The math of speculative decoding's verify step: greedy tokens of every position, the
distribution a sampler draws from, and the standard accept/reject rule (Leviathan et al. 2023,
Chen et al. 2023) that keeps the target model's output distribution whatever the drafter proposes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

__all__ = ["greedy_tokens", "sampling_probs", "accept_reject"]


def greedy_tokens(logprobs) -> list[int]:
    """The argmax of every row of `logprobs` [T, V] (what the greedy sampler picks), on the host."""
    return mx.argmax(logprobs, axis=-1).tolist()


def sampling_probs(logprobs, temp: float, top_p: float):
    """The distribution mlx-lm's sampler (temperature `temp` > 0, nucleus `top_p`) draws from, per
    row of `logprobs` [T, V]: float32 probabilities [T, V]."""
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    return mx.softmax(logprobs.astype(mx.float32) * (1 / temp), axis=-1)


def accept_reject(p, draft: list[int], q=None, key=None) -> tuple[int, int]:
    """Verify `draft` (k tokens) against the target distributions `p` [k + 1, V]: draft token i is
    accepted with probability min(1, p_i(d) / q_i(d)); at the first rejection the next token is
    drawn from max(p_i - q_i, 0), renormalised; if all are accepted, from p_k. `q` [k, V] is the
    drafter's distribution (None: a deterministic drafter, q_i one-hot at d_i). `key`: the random
    key the rule draws from (a seeded request's own stream); None: the global generator.
    Returns (accepted draft tokens n, the next token)."""
    k = len(draft)
    if q is not None and q.shape[-1] != p.shape[-1]:
        # the draft model's output width can differ from the target's (a padded vocabulary, e.g.
        # Qwen3's 151,936 rows against a tokenizer of 151,669): q is 0 where the drafter has no row
        w = p.shape[-1]
        q = q[:, :w] if q.shape[-1] > w else mx.pad(q, [(0, 0), (0, w - q.shape[-1])])
    rows, d = mx.arange(k), mx.array(draft)
    pd = p[rows, d]
    qd = q[rows, d] if q is not None else mx.ones_like(pd)
    k_uniform, k_token = mx.random.split(key) if key is not None else (None, None)
    u = mx.random.uniform(shape=(k,), key=k_uniform)
    accepted = np.array(u * qd < pd)  # u < p/q without dividing by a zero q
    n = int(np.argmin(accepted)) if not accepted.all() else k
    if n == k:
        dist = p[k]
    else:
        resid = mx.maximum(p[n] - q[n], 0) if q is not None else p[n] * (mx.arange(p.shape[-1]) != draft[n])
        total = resid.sum()
        dist = mx.where(total > 0, resid / mx.maximum(total, 1e-30), p[n])
    token = mx.random.categorical(mx.log(dist), key=k_token).item()
    return n, int(token)
