"""The engine side of a request: run one generation and turn its steps into response events.

Runs on the engine thread (see scheduler.py). Stop strings are passed to the engine, which cuts
the text before them and holds back possible stop-string prefixes (edge0.textstream), so the
deltas seen here are final. Tool-call markup is split out here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Generator, Union

from edge0.server.tools import Segment, ToolCallSplitter


@dataclass(frozen=True)
class Params:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused, not prefilled


@dataclass(frozen=True)
class Finish:
    """The last event of a generation."""

    reason: str  # "stop" | "length" | "tool_calls"
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended it (reason "stop", not an EOS token)


def generation_events(
    engine, prompt: list[int], params: Params, tools: list[dict] | None, cancelled: threading.Event
) -> Generator[Union[Segment, Finish], None, None]:
    """Yield content strings and tool calls as they are decided, then one Finish.

    Returns without a Finish once `cancelled` is set; the engine checks it between prefill
    chunks, and closing this generator closes the engine's, so the engine stops at once.
    """
    splitter = ToolCallSplitter(engine.tokenizer, tools) if tools else None
    # reuse_cache: the engine keeps the KV of the longest prefix shared with the previous request.
    steps = engine.stream_generate(
        prompt,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        stop=params.stop or None,
        reuse_cache=True,
        should_stop=cancelled.is_set,
    )
    n_tokens, step = 0, None
    try:
        for step in steps:
            n_tokens += 1
            if step.text:
                yield from splitter.feed(step.text) if splitter else (step.text,)
            if step.finish_reason or cancelled.is_set():
                break
    finally:
        steps.close()
    if cancelled.is_set():
        return
    if splitter:
        yield from splitter.finish()
    reason = step.finish_reason
    if reason == "stop" and splitter and splitter.calls:
        reason = "tool_calls"
    stats = step.stats or {}
    cached = len(prompt) - stats.get("prefill_tokens", len(prompt))
    yield Finish(reason, Usage(len(prompt), n_tokens, max(cached, 0)), step.stop)
