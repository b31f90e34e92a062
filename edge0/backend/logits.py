"""Per-request work on one step's log-probs row before sampling: a token mask (structured
outputs), a logit bias, and the log-probs a response reports. Rows are [1, V] (what samplers take)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from edge0.backend.forward import make_sampler

__all__ = [
    "sampler",
    "Keys",
    "apply_token_mask",
    "LogitBias",
    "token_logprobs",
    "only_token",
    "normalize",
    "allowed",
    "sampling_dtype",
]


def sampler(temperature: float, top_p: float, top_k: int, vocab: int, keys: Keys | None = None):
    """mlx-lm's sampler; a `top_k` of 0 or at least the vocabulary keeps every token. With `keys`
    (a request's own random stream), a sampler drawing from them (KeyedSampler), so what else
    draws random numbers (other rows of a batch) does not change its samples."""
    top_k = top_k if 0 < top_k < vocab else 0
    if keys is not None and temperature > 0:
        return KeyedSampler(temperature, top_p, top_k, keys)
    return make_sampler(temp=temperature, top_p=top_p, top_k=top_k)


class Keys:
    """A seeded random stream of its own: each `next()` a fresh key, split off as the global
    generator splits its key. One request's sampler and its speculative draws (a sampled draft,
    the verify rule) share it, so a seeded request's draws do not depend on what else draws."""

    def __init__(self, seed: int):
        self.key = mx.random.key(seed)

    def next(self) -> mx.array:
        self.key, draw = mx.random.split(self.key)
        return draw


class KeyedSampler:
    """mlx-lm's sampling chain (top-p, then top-k, then a categorical draw at the temperature) on
    its own keys: the draws are those of mlx-lm's sampler after `mx.random.seed(seed)` with nothing
    else drawing (the global generator splits its key the same way), tested against it."""

    def __init__(self, temperature: float, top_p: float, top_k: int, keys: Keys):
        self.temperature, self.top_p, self.top_k, self.keys = temperature, top_p, top_k, keys

    def __call__(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=self.keys.next())


def apply_token_mask(logprobs: mx.array, bitmask: np.ndarray) -> mx.array:
    """`logprobs` [1, V] with -inf where `bitmask` (int32 words, bit i of word w = token 32w+i,
    llguidance's layout) has a 0; tokens past the mask's bits are masked too."""
    vocab = logprobs.shape[-1]
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), bitorder="little")[:vocab]
    if len(bits) < vocab:
        bits = np.pad(bits, (0, vocab - len(bits)))
    return mx.where(mx.array(bits.view(np.bool_)), logprobs, mx.array(-np.inf, logprobs.dtype))


class LogitBias:
    """A logits processor adding `bias[token]` to those tokens' log-probs (OpenAI's logit_bias:
    -100 bans a token, +100 all but forces it); the same for logits, up to normalization."""

    def __init__(self, bias: dict[int, float]):
        self.bias = bias
        self._row: mx.array | None = None

    def __call__(self, generated: list[int], logprobs: mx.array) -> mx.array:
        if self._row is None:  # built once the row's width (the model's vocabulary) is known
            row = np.zeros(logprobs.shape[-1], np.float32)
            ids = [t for t in self.bias if t < len(row)]
            row[ids] = [self.bias[t] for t in ids]
            self._row = mx.array(row).astype(logprobs.dtype)
        return logprobs + self._row


def token_logprobs(logprobs: mx.array, token: mx.array, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-prob of `token` in `logprobs` [1, V] and the `n_top` most likely tokens with
    theirs, highest first (float32; evaluates)."""
    row = logprobs.reshape(-1).astype(mx.float32)
    chosen = row[token.reshape(-1)[0]]
    n_top = min(n_top, row.shape[0])
    if n_top <= 0:
        return chosen.item(), []
    top = mx.argpartition(-row, kth=n_top - 1)[:n_top]
    values = row[top]
    mx.eval(chosen, top, values)
    pairs = sorted(zip(top.tolist(), values.tolist()), key=lambda p: (-p[1], p[0]))
    return chosen.item(), pairs


def only_token(logprobs: mx.array, token: int) -> mx.array:
    """`logprobs` [1, V] with every token but `token` at -inf (the sampler must take it)."""
    keep = mx.arange(logprobs.shape[-1]) == token
    return mx.where(keep, logprobs, mx.array(-np.inf, logprobs.dtype))


def sampling_dtype(logprobs: mx.array) -> mx.array:
    """`logprobs` in a dtype the sampler can scale by 1/temperature: float16 overflows to -inf for
    every token once |logprob| / temperature passes 65504 (a temperature of 2e-5 drew tokens of
    probability 1e-6); bfloat16 has float32's range."""
    return logprobs.astype(mx.float32) if logprobs.dtype == mx.float16 else logprobs


def normalize(logprobs: mx.array) -> mx.array:
    """`logprobs` [1, V] renormalized after a processor (a mask, a bias), as mlx-lm normalizes
    processed logits: top-p then cuts the distribution the sampler draws from."""
    return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)


def allowed(logprobs: mx.array, token: mx.array) -> bool:
    """Whether `token` has a finite log-prob in `logprobs` [1, V] (not masked, not NaN); evaluates."""
    value = logprobs.reshape(-1)[token.reshape(-1)[0]]
    return bool(mx.isfinite(value).item())
