"""OpenAI response bodies and SSE chunks for chat completions and text completions."""

from __future__ import annotations

import json
import time
import uuid

from edge0.server.generation import Finish
from edge0.server.tools import Segment


def sse(data: dict | str) -> str:
    """One server-sent event carrying `data` (a dict is sent as JSON)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class ChatFormat:
    """Shapes chat.completion and chat.completion.chunk objects for one response."""

    def __init__(self, model: str):
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model
        self._tool_index = 0

    def _chunk(self, delta: dict, finish: str | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    def start(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, segment: Segment) -> dict:
        if isinstance(segment, str):
            return self._chunk({"content": segment})
        self._tool_index += 1
        return self._chunk({"tool_calls": [{"index": self._tool_index - 1, **segment}]})

    def end(self, finish: Finish) -> dict:
        return self._chunk({}, finish.reason)

    def usage_chunk(self, finish: Finish) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": finish.usage}

    def body(self, segments: list[Segment], finish: Finish) -> dict:
        text = "".join(s for s in segments if isinstance(s, str))
        calls = [s for s in segments if isinstance(s, dict)]
        message = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish.reason, "logprobs": None}],
                "usage": finish.usage}


class CompletionFormat:
    """Shapes text_completion objects (streamed chunks have the same object type)."""

    def __init__(self, model: str):
        self.id, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model

    def _chunk(self, text: str, finish: str | None = None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

    def start(self) -> None:
        return None

    def delta(self, segment: Segment) -> dict:
        return self._chunk(segment)

    def end(self, finish: Finish) -> dict:
        return self._chunk("", finish.reason)

    def usage_chunk(self, finish: Finish) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": finish.usage}

    def body(self, segments: list[Segment], finish: Finish) -> dict:
        return {**self._chunk("".join(segments), finish.reason), "usage": finish.usage}
