"""OpenAI Chat Completions and Completions: response bodies and server-sent events."""

from __future__ import annotations

import time
import uuid

from edge0.server.errors import APIError, openai_error
from edge0.server.generation import Finish, Usage
from edge0.server.pipeline import sse
from edge0.server.tools import Segment


def openai_usage(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class _OpenAIStream:
    """What both formats share: usage in a last chunk when asked, `data: [DONE]`, errors as
    `data: {"error": ...}` (the openai client raises on it)."""

    object_name = ""

    def __init__(self, model: str, prefix: str, include_usage: bool):
        self.id, self.created, self.model = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model
        self.include_usage = include_usage

    def _object(self, **fields) -> dict:
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model, **fields}

    def stream_end(self, finish: Finish):
        yield sse(self._last_chunk(finish))
        if self.include_usage:
            yield sse(self._object(choices=[], usage=openai_usage(finish.usage)))
        yield sse("[DONE]")

    def stream_error(self, error: APIError) -> str:
        return sse(openai_error(error))


class ChatFormat(_OpenAIStream):
    """chat.completion and chat.completion.chunk objects for one response."""

    object_name = "chat.completion.chunk"

    def __init__(self, model: str, include_usage: bool = False):
        super().__init__(model, "chatcmpl", include_usage)
        self._tool_index = 0

    def _chunk(self, delta: dict, finish: str | None = None) -> dict:
        return self._object(choices=[{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}])

    def stream_start(self, prompt_tokens: int):
        yield sse(self._chunk({"role": "assistant", "content": ""}))

    def stream_delta(self, segment: Segment):
        if isinstance(segment, str):
            yield sse(self._chunk({"content": segment}))
        else:
            self._tool_index += 1
            yield sse(self._chunk({"tool_calls": [{"index": self._tool_index - 1, **segment}]}))

    def _last_chunk(self, finish: Finish) -> dict:
        return self._chunk({}, finish.reason)

    def body(self, segments: list[Segment], finish: Finish) -> dict:
        text = "".join(s for s in segments if isinstance(s, str))
        calls = [s for s in segments if isinstance(s, dict)]
        message = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return {
            **self._object(
                choices=[{"index": 0, "message": message, "finish_reason": finish.reason, "logprobs": None}],
                usage=openai_usage(finish.usage),
            ),
            "object": "chat.completion",
        }


class CompletionFormat(_OpenAIStream):
    """text_completion objects (streamed chunks have the same object type)."""

    object_name = "text_completion"

    def __init__(self, model: str, include_usage: bool = False):
        super().__init__(model, "cmpl", include_usage)

    def _chunk(self, text: str, finish: str | None = None) -> dict:
        return self._object(choices=[{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}])

    def stream_start(self, prompt_tokens: int):
        return ()

    def stream_delta(self, segment: Segment):
        yield sse(self._chunk(segment))

    def _last_chunk(self, finish: Finish) -> dict:
        return self._chunk("", finish.reason)

    def body(self, segments: list[Segment], finish: Finish) -> dict:
        return {**self._chunk("".join(segments), finish.reason), "usage": openai_usage(finish.usage)}
