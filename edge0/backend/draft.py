"""A draft model for speculative decoding: any mlx-lm model loaded resident (as mlx-lm's own
speculative generation does), with its own KV cache kept in step with the sequence it drafts for."""

from __future__ import annotations

import mlx.core as mx

from edge0.backend import resident
from edge0.backend.forward import prefill
from edge0.backend.kvcache import can_trim_prompt_cache, common_prefix_len, make_prompt_cache, trim_prompt_cache
from edge0.backend.speculative import sampling_probs

__all__ = ["DraftModel"]


class DraftModel:
    """`path`: an mlx-lm model directory. `draft(context, k)` proposes the next k tokens of
    `context`; its cache holds the longest prefix it shares with the previous call's context."""

    def __init__(self, path, dtype: str | None = None):
        self.model, self.tokenizer, self.dtype, self.nbytes = resident.load(path, dtype)
        self.cache = make_prompt_cache(self.model)
        self.trimmable = can_trim_prompt_cache(self.cache)
        self.tokens: list[int] = []  # what the cache holds

    def fork(self) -> DraftModel:
        """The same model (weights shared) with its own cache, for another sequence."""
        twin = object.__new__(DraftModel)
        twin.model, twin.tokenizer, twin.dtype, twin.nbytes = self.model, self.tokenizer, self.dtype, self.nbytes
        twin.cache, twin.trimmable, twin.tokens = make_prompt_cache(self.model), self.trimmable, []
        return twin

    def vocab(self) -> dict:
        """The tokenizer's token -> id map."""
        return self.tokenizer.get_vocab()

    def _sync(self, context: list[int]) -> list[int]:
        """Make the cache hold a prefix of `context[:-1]`; returns the tokens still to feed."""
        held = common_prefix_len(self.tokens, context[:-1])
        if held < len(self.tokens):
            if self.trimmable:
                trim_prompt_cache(self.cache, len(self.tokens) - held)
            else:  # a recurrent draft model starts over
                self.cache, held = make_prompt_cache(self.model), 0
            self.tokens = self.tokens[:held]
        return context[held:]

    def draft(self, context: list[int], k: int, temp: float = 0.0, top_p: float = 1.0, vocab_size: int = 0, key=None):
        """(k token ids, their distributions [k, vocab_size] or None when greedy). Sampled drafts
        come from the same temperature and nucleus as the target's sampler, drawn from `key` (a
        seeded request's own stream; None: the global generator)."""
        feed = self._sync(context)
        keys = mx.random.split(key, k) if key is not None and temp != 0 else [None] * k
        if len(feed) > 1:
            prefill(self.model, feed[:-1], self.cache)
        y = mx.array(feed[-1:])
        tokens, probs = [], []
        for i in range(k):
            logits = self.model(y[None], cache=self.cache)[0, -1:]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if temp == 0:
                y = mx.argmax(logprobs, axis=-1)
            else:
                q = sampling_probs(logprobs, temp, top_p)
                y = mx.random.categorical(mx.log(q), key=keys[i])
                probs.append(q)
            mx.async_eval(y)
            tokens.append(y)
        out = mx.concatenate(tokens).tolist()
        # the cache now holds context + out[:-1] (the last draft token was never fed)
        self.tokens = list(context) + out[:-1]
        if temp == 0:
            return out, None
        q = mx.concatenate(probs, axis=0)
        v = q.shape[-1]
        if v > vocab_size:  # a draft model padded past the target's vocabulary
            q = q[:, :vocab_size]
        elif v < vocab_size:
            q = mx.concatenate([q, mx.zeros((k, vocab_size - v), q.dtype)], axis=-1)
        return out, q
