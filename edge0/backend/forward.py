"""The forward calls the engine makes: a step's log-probs, a prefill into a KV cache, sampling,
and full-sequence logits (ours, or a resident mlx-lm model's for a reference run)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_sampler

__all__ = [
    "forward",
    "forward_rows",
    "forward_rows_all",
    "forward_all",
    "prefill",
    "sample",
    "make_sampler",
    "full_logits",
    "resident_logits_fn",
]


def forward(model, tokens: list[int], cache) -> mx.array:
    """Run tokens through the model (updating `cache`); returns last-position log-probs [V]."""
    logits = model(mx.array(tokens)[None], cache=cache)[:, -1, :]
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def forward_rows(model, tokens: list[int], cache) -> mx.array:
    """One token of each sequence of a batch through the model (updating the merged `cache`);
    returns each row's log-probs [B, V]."""
    logits = model(mx.array(tokens)[:, None], cache=cache)[:, -1, :]
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def forward_rows_all(model, rows: list[list[int]], cache) -> mx.array:
    """T tokens of each sequence of a batch (rows of equal length) through the model (updating the
    merged `cache`); returns every position's log-probs [B, T, V] (a batched verify)."""
    logits = model(mx.array(rows), cache=cache)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def forward_all(model, tokens: list[int], cache) -> mx.array:
    """Run tokens through the model (updating `cache`); returns every position's log-probs [T, V]
    (a multi-token decode step: the speculative verify)."""
    logits = model(mx.array(tokens)[None], cache=cache)[0]
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def prefill(model, tokens: list[int], cache, step: int = 2048) -> None:
    """Fill `cache` with `tokens` in chunks, as mlx-lm does before the first decode step."""
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i : i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def full_logits(model, tokens: list[int]):
    """Logits of every position for one prompt, without a cache (float32 numpy [T, V])."""
    out = model(mx.array(tokens)[None])[0].astype(mx.float32)
    return np.array(out)


def sample(sampler, logprobs) -> int:
    return sampler(logprobs[None]).item()


def resident_logits_fn(path: Path):
    """Logits of an mlx-lm / Hugging Face model loaded entirely in memory (a reference run)."""
    from mlx_lm.utils import load as mlx_lm_load

    model, _ = mlx_lm_load(str(path))

    def logits(tokens):
        return np.array(model(mx.array(tokens)[None])[0].astype(mx.float32))

    return logits
