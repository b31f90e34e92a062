"""The reusable KV cache: keep the longest common token prefix with the previous call and prefill
only the rest (mlx-lm's prompt-cache helpers do the trimming)."""

from __future__ import annotations

from edge0.backend import nn as bnn


class PromptCache:
    """The model's KV cache and the tokens it holds."""

    def __init__(self, model):
        self.model = model
        self.cache = None
        self.tokens: list[int] = []
        self.dirty = False  # set while the KV cache may be ahead of `tokens` (a step in flight)

    def reset(self) -> None:
        self.cache, self.tokens, self.dirty = None, [], False

    def prepare(self, tokens: list[int], reuse: bool) -> int:
        """Make the cache hold a prefix of `tokens` (all but the last token at most, which must be
        fed to get logits); returns that prefix's length."""
        if reuse and self.cache is not None and not self.dirty:
            common = bnn.common_prefix_len(self.tokens, tokens[:-1])
            drop = len(self.tokens) - common
            if drop == 0:
                return common
            if common > 0 and bnn.can_trim_prompt_cache(self.cache):
                bnn.trim_prompt_cache(self.cache, drop)
                self.tokens = self.tokens[:common]
                return common
        self.cache = bnn.make_prompt_cache(self.model)
        self.tokens = []
        return 0
