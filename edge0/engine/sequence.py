"""One sequence of the engine's batch (batch.py): its request, sampler and reply, where its prefill
is, and its cache while it is not a row of the batch's."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from edge0.engine.reply import Reply
from edge0.engine.request import Request
from edge0.engine.sampler import RequestSampler


@dataclass
class Sequence:
    """One sequence of a batch: its request, sampler and reply, and where its prefill is."""

    request: Request
    sampler: RequestSampler
    reply: Reply
    cache: list | None = None  # its own cache while it waits (prefills); then it is a row of the batch's
    fed: int = 0  # prompt tokens its own cache holds (reused or prefilled)
    held: int = 0  # of those, the ones a cached prefix held when it joined
    receipt: object = None  # the disk file its cache was restored from, until its prefill succeeds
    drafter: object | None = None  # its own drafter (a plain request while the engine speculates)
    lone: bool = False  # alone in the batch (solo.py), until a second sequence joins
    prepared: bool = False  # a lone sequence: its cache holds its cached prefix
    lane: object = None  # a lone row's steps (Solo.steps)
    made: list[int] = field(default_factory=list)  # the tokens a lone row's steps made (Solo.fed)
    # a lone sequence whose prompt's last token was fed in its prefill span: the log-probs after
    # it, which its first step samples from (Solo.prefill)
    first: object = None
    before: tuple = ()  # executor totals, store reads and speculation counts when it joined
    prefilled: dict | None = None  # executor totals once its prompt but the last token was in
    joined: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None  # from joining to its first token
    finish: str | None = None

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt

    @property
    def reuse(self) -> bool:
        return self.request.reuse

    @property
    def namespace(self) -> str:
        return self.request.namespace

    @property
    def tokens(self) -> list[int]:
        return self.reply.tokens

    def key(self, tokens: list[int]) -> list[int]:
        """The prompt caches' key of `tokens` (this sequence's prompt, then what it made): each image's
        tokens stand for that image's content, since they have the same ids whatever the picture."""
        v = self.request.vision
        return tokens if v is None else v.key(tokens)
