"""The engine side of a request: run one generation and turn its steps into response events.

Runs on the engine thread (see scheduler.py). Stop strings are passed to the engine, which cuts
the text before them and holds back possible stop-string prefixes (edge0.textstream), so the
deltas seen here are final. The chat format's splitter (edge0/formats) splits reasoning and tool
calls out of a chat reply here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Union

from edge0.engine.api import EngineAPI
from edge0.formats import Reasoning


@dataclass(frozen=True)
class Params:
    max_tokens: int | None  # None: as many as the server allows (pipeline.respond decides)
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    top_k: int = 0
    logprobs: int | None = None  # report each token's log-prob and this many top ones; None: none
    logit_bias: dict[int, float] | None = None

    def with_max_tokens(self, n: int) -> Params:
        return replace(self, max_tokens=n)


@dataclass(frozen=True)
class TokenLogprob:
    token: bytes
    logprob: float
    top: list[tuple[bytes, float]]  # most likely first


@dataclass(frozen=True)
class Logprobs:
    """The log-probs of the tokens whose text follows (an event before that text)."""

    tokens: list[TokenLogprob]


Segment = Union[str, dict, Reasoning, Logprobs]  # answer text, a tool call (OpenAI's shape), reasoning, log-probs


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused, not prefilled
    reasoning_tokens: int = 0  # completion tokens spent in a reasoning block

    @property
    def cache_write_tokens(self) -> int:
        """Prompt tokens this request wrote to the prompt cache: every prefilled one (the server
        always keeps a prompt's KV for the next request, engine/kv.py; later ones may evict it)."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class Finish:
    """The last event of a generation."""

    reason: str  # "stop" | "length" | "tool_calls"
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended it (reason "stop", not an EOS token)


@dataclass
class Run:
    """Everything the engine thread needs for one request."""

    prompt: list[int]
    params: Params  # max_tokens decided
    tools: list[dict] | None = None
    processors: list = field(default_factory=list)  # logits processors (grammar, logit bias)
    chat: bool = False  # a chat prompt: the reply goes through the chat format's splitter
    opened: bool = False  # the prompt opened a reasoning block
    token_bytes: Callable[[int], bytes] | None = None  # for log-probs
    namespace: str = ""  # the prompt caches it may reuse (pipeline.cache_namespace)
    vision: object = None  # a prompt with images (Engine.image_prompt): `prompt` is its tokens


class Events:
    """One generation's Steps turned into response events: log-probs, reasoning, content strings
    and tool calls as they are decided, then one Finish (scheduler.py)."""

    def __init__(self, engine: EngineAPI, run: Run):
        self.run = run
        self.splitter = engine.chat_format.splitter(run.tools, run.opened) if run.chat else None
        self.eos = set(engine.tokenizer.eos_token_ids)
        self.n_tokens = self.n_reasoning = 0

    def step(self, step) -> list[Union[Segment, Finish]]:
        """The events of one Step; its last (a finish_reason) ends with the Finish."""
        run, splitter = self.run, self.splitter
        out: list = []
        self.n_tokens += 1
        self.n_reasoning += bool(splitter and splitter.inside)
        # The end-of-sequence token is not part of the answer, nor of its log-probs.
        if run.params.logprobs is not None and not (
            step.finish_reason == "stop" and step.stop is None and step.token in self.eos
        ):
            out.append(Logprobs([_entry(step, run.token_bytes)]))
        if step.text:
            out += splitter.feed(step.text) if splitter else [step.text]
        if step.finish_reason:
            out += self._finish(step)
        return out

    def _finish(self, step) -> list:
        out = self.splitter.finish() if self.splitter else []
        reason = step.finish_reason
        if reason == "stop" and self.splitter and self.splitter.calls:
            reason = "tool_calls"
        prompt = self.run.prompt
        stats = step.stats or {}
        cached = len(prompt) - stats.get("prefill_tokens", len(prompt))
        usage = Usage(len(prompt), self.n_tokens, max(cached, 0), self.n_reasoning)
        return out + [Finish(reason, usage, step.stop)]


def _entry(step, token_bytes: Callable[[int], bytes]) -> TokenLogprob:
    return TokenLogprob(token_bytes(step.token), step.logprob, [(token_bytes(t), v) for t, v in step.top_logprobs])
