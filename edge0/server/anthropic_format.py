"""Anthropic's `message` object and its stream of events (content blocks: thinking, text, tool_use)."""

from __future__ import annotations

import hashlib
import json
import uuid

from edge0.formats import Reasoning
from edge0.server.errors import APIError, anthropic_error
from edge0.server.generation import Finish, Logprobs, Segment, Usage
from edge0.server.pipeline import sse


def anthropic_usage(usage: Usage) -> dict:
    # Anthropic splits the prompt three ways: read from the cache, written to it, and neither
    # (input_tokens). The server caches every prefilled token, as a breakpoint at the prompt's end would.
    written = usage.cache_write_tokens
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens - written,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": written,
    }


_ZERO_USAGE = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}


def _stop_reason(finish: Finish) -> str:
    if finish.reason == "tool_calls":
        return "tool_use"
    if finish.reason == "length":
        return "max_tokens"
    return "stop_sequence" if finish.stop_sequence else "end_turn"


def _event(kind: str, **fields) -> str:
    return sse({"type": kind, **fields}, kind)


def signature(thinking: str) -> str:
    """A thinking block's `signature`: the sha256 of its text (this server checks none)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


class MessageFormat:
    """A `message` object, or its stream of events. The blocks are built as segments arrive, so
    a whole answer is the stream's blocks."""

    def __init__(self, model: str):
        self.id, self.model = f"msg_{uuid.uuid4().hex}", model
        self.content: list[dict] = []
        self._open: str | None = None  # the type of the block receiving text ("text", "thinking")

    def _message(self, finish: Finish | None, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content if finish else [],
            "stop_reason": finish and _stop_reason(finish),
            "stop_sequence": finish and finish.stop_sequence,
            "usage": usage,
        }

    def stream_start(self, prompt_tokens: int):
        # The request is only queued: how much of the prompt the KV cache holds is known once
        # generation starts, so the token counts are all in message_delta (zero here). It also
        # keeps keep-alive deltas free: Claude Code adds each message_delta's usage to its costs.
        yield _event("message_start", message=self._message(None, _ZERO_USAGE))

    def stream_keepalive(self):
        # Claude Code's idle watchdog ignores `ping` (its SDK drops pings), so the keep-alive is an
        # empty message_delta: no stop reason yet, zero tokens; the final message_delta overrides it.
        yield _event("message_delta", delta={"stop_reason": None, "stop_sequence": None}, usage={"output_tokens": 0})

    def stream_delta(self, segment: Segment):
        if isinstance(segment, Logprobs):
            return
        if isinstance(segment, (str, Reasoning)):
            kind, text = ("text", segment) if isinstance(segment, str) else ("thinking", segment.text)
            if self._open != kind:
                yield from self._close()
                self._open = kind
                block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": ""}
                self.content.append(block)
                start = block if kind == "text" else {**block, "signature": ""}
                yield _event("content_block_start", index=len(self.content) - 1, content_block=start)
            self.content[-1][kind] += text
            delta = (
                {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
            )
            yield _event("content_block_delta", index=len(self.content) - 1, delta=delta)
            return
        yield from self._close()
        fn = segment["function"]
        block = {
            "type": "tool_use",
            "id": "toolu_" + segment["id"].removeprefix("call_"),
            "name": fn["name"],
            "input": json.loads(fn["arguments"]),
        }
        self.content.append(block)
        index = len(self.content) - 1
        yield _event("content_block_start", index=index, content_block={**block, "input": {}})
        yield _event(
            "content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": fn["arguments"]}
        )
        yield _event("content_block_stop", index=index)

    def _close(self):
        """End the open text or thinking block (a thinking block gets its signature first)."""
        if self._open is None:
            return
        index, block = len(self.content) - 1, self.content[-1]
        if self._open == "thinking":
            block["signature"] = signature(block["thinking"])
            yield _event(
                "content_block_delta", index=index, delta={"type": "signature_delta", "signature": block["signature"]}
            )
        self._open = None
        yield _event("content_block_stop", index=index)

    def stream_end(self, finish: Finish):
        yield from self._close()
        yield _event(
            "message_delta",
            delta={"stop_reason": _stop_reason(finish), "stop_sequence": finish.stop_sequence},
            usage=anthropic_usage(finish.usage),
        )
        yield _event("message_stop")

    def stream_error(self, error: APIError) -> str:
        return sse(anthropic_error(error), "error")

    def body(self, segments: list[Segment], finish: Finish) -> dict:
        for segment in segments:
            for _ in self.stream_delta(segment):
                pass
        for _ in self._close():
            pass
        return self._message(finish, anthropic_usage(finish.usage))
