"""One generation's tokens turned into the Steps a caller sees: the text through the streaming
detokenizer (chat-format control tokens generated but never shown), stop strings cut off, and
the finish on an end-of-sequence token, a stop string or the token limit. A single generation
(engine.py) and each sequence of a batch (batch.py) run their tokens through one of these."""

from __future__ import annotations

from dataclasses import dataclass

from edge0.textstream import StopMatcher


@dataclass
class Step:
    token: int
    text: str
    finish_reason: str | None = None
    stats: dict | None = None
    stop: str | None = None  # the stop string that ended the generation (finish_reason "stop", not an EOS token)
    logprob: float | None = None  # the model's log-prob of `token` (with stream_generate(logprobs=...))
    top_logprobs: list[tuple[int, float]] | None = None  # the most likely (token, log-prob), highest first


class Reply:
    """The Steps of one generation, a token at a time (`add`)."""

    def __init__(self, tokenizer, control_ids: set[int], eos: set[int], stop, max_tokens: int):
        self.detok = tokenizer.detokenizer  # a fresh copy
        self.detok.reset()
        self.control_ids, self.eos, self.max_tokens = control_ids, eos, max_tokens
        self.stopper = StopMatcher(stop or [])
        self.tokens: list[int] = []

    def add(self, y: int) -> Step:
        """The Step of the next generated token `y`; its finish_reason is set when it is the last."""
        detok, stopper = self.detok, self.stopper
        self.tokens.append(y)
        finish = None
        if y in self.eos:
            finish = "stop"
            detok.finalize()
            text = stopper.flush(detok.last_segment)
        else:
            if y not in self.control_ids:
                detok.add_token(y)
            text, hit = stopper.feed(detok.last_segment)
            if hit:
                finish = "stop"
            elif len(self.tokens) >= self.max_tokens:
                finish = "length"
                detok.finalize()
                text += stopper.flush(detok.last_segment)
        return Step(y, text, finish, stop=stopper.matched if finish else None)
