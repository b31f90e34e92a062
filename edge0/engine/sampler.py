"""The sampler of one generation: the request's logits processors, then mlx-lm's sampler
(temperature, top_p, top_k), and the log-probs each Step reports when asked.

A logits processor is a callable `(generated, logprobs) -> logprobs`: `generated` holds the token
ids sampled so far in this generation, `logprobs` is the step's row [1, V] (a backend array), and
it returns the row to sample from (a grammar's mask, a logit bias). Reported log-probs are the
model's own, before any processor, temperature or truncation.
"""

from __future__ import annotations

from collections import deque
from contextlib import closing

from edge0.backend import logits as blog
from edge0.errors import Edge0Error
from edge0.sampling import effective_temperature


class RequestSampler:
    """Called by the engine as any sampler: logprobs [1, V] -> the token [1]. Without processors
    and log-probs it is mlx-lm's sampler, lazily evaluated as before."""

    def __init__(
        self,
        temperature: float,
        top_p: float,
        top_k: int = 0,
        processors=None,
        logprobs: int | None = None,
        seed: int | None = None,
    ):
        """`seed`: draw from this sampler's own random stream (a batch row's samples then do not
        depend on the other rows); None: from the global one. A temperature below
        edge0.sampling.GREEDY_BELOW is greedy."""
        self.temperature, self.top_p, self.top_k = effective_temperature(temperature), top_p, top_k
        self._keys = blog.Keys(seed) if seed is not None and self.temperature > 0 else None
        self.processors = list(processors or [])
        self.n_top = logprobs
        self.generated: list[int] = []
        self._records: deque = deque()  # (logprob, top) per sampled token, until its Step is out
        self._sample = None

    @property
    def plain(self) -> bool:
        """Temperature and top-p only: what a speculative verify can sample exactly."""
        return not self.processors and self.n_top is None and not self.top_k

    def key(self):
        """A fresh key of this sampler's own stream for a draw a speculative step makes for it (a
        sampled draft, the verify rule), taken in the same order in a batch's row as alone, so a
        seeded request's tokens do not depend on what else draws; None without a seed (the global
        stream) or when greedy (nothing is drawn)."""
        return self._keys.next() if self._keys is not None else None

    def __call__(self, logprobs):
        if self._sample is None:  # the vocabulary is known once a row arrives
            self._sample = blog.sampler(self.temperature, self.top_p, self.top_k, logprobs.shape[-1], self._keys)
        if not self.processors and self.n_top is None:
            return self._sample(blog.sampling_dtype(logprobs))
        row = logprobs
        for process in self.processors:
            row = process(self.generated, row)
        if self.processors:
            row = blog.normalize(row)
        row = blog.sampling_dtype(row)
        token = self._sample(row)
        if self.processors and not blog.allowed(row, token):
            # only a row with no finite log-prob left draws a masked token: the model's output is
            # NaN, or the processors banned every token; this sequence ends, no other
            raise Edge0Error("no token is allowed at this step: the model's log-probs are not finite here")
        if self.n_top is not None:
            self._records.append(blog.token_logprobs(logprobs, token, self.n_top))
        self.generated.append(int(token.item()))
        return token

    def annotate_step(self, step) -> None:
        """Give `step` (this sampler's next) its token's log-prob and the top ones, when asked."""
        if self.n_top is not None:
            step.logprob, step.top_logprobs = self._records.popleft()

    def annotate(self, steps):
        """Pass `steps` through, each with the log-prob of its token (and the top ones) when asked."""
        if self.n_top is None:
            yield from steps
            return
        with closing(steps):
            for step in steps:
                step.logprob, step.top_logprobs = self._records.popleft()
                yield step
