"""OpenAI Chat Completions and Completions: response bodies and server-sent events."""

from __future__ import annotations

import copy
import time
import uuid

from edge0.formats import Reasoning
from edge0.server.errors import APIError, openai_error
from edge0.server.generation import Finish, Logprobs, Segment, TokenLogprob, Usage
from edge0.server.pipeline import sse

LOGPROB_FLOOR = -9999.0  # OpenAI's value for a negligible probability (JSON has no -Infinity)


def openai_usage(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def _text(token: bytes) -> str:
    return token.decode("utf-8", errors="replace")


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def chat_logprob(entry: TokenLogprob) -> dict:
    """One token in Chat Completions' `logprobs.content`."""
    return {
        "token": _text(entry.token),
        "logprob": _value(entry.logprob),
        "bytes": list(entry.token),
        "top_logprobs": [{"token": _text(t), "logprob": _value(v), "bytes": list(t)} for t, v in entry.top],
    }


class _OpenAIStream:
    """What both formats share: usage in a last chunk when asked, `data: [DONE]`, errors as
    `data: {"error": ...}` (the openai client raises on it), and log-probs held until the text
    of their tokens goes out."""

    object_name = ""
    empty_choice: dict = {}  # a choice that adds nothing (the keep-alive's)

    def __init__(self, model: str, prefix: str, include_usage: bool):
        self.id, self.created, self.model = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model
        self.include_usage = include_usage
        self._pending: list[TokenLogprob] = []
        self._all: list[TokenLogprob] = []
        self.logprobs = False  # the request asked for them (one arrived)
        self.index = 0  # the choice this instance writes (n > 1: choices.py)

    def choice(self, index: int):
        """A fresh instance for choice `index` of the same response (its id, created, options)."""
        other = copy.copy(self)
        other._pending, other._all, other.index = [], [], index
        return other

    def _hold(self, segment: Logprobs) -> None:
        self.logprobs = True
        self._pending += segment.tokens
        self._all += segment.tokens

    def _take(self) -> list[TokenLogprob]:
        out, self._pending = self._pending, []
        return out

    def _object(self, **fields) -> dict:
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model, **fields}

    def stream_end(self, finish: Finish):
        yield from self.stream_finish(finish)
        yield from self.stream_close(finish.usage)

    def stream_finish(self, finish: Finish):
        """This choice's last chunk (its finish reason)."""
        yield sse(self._last_chunk(finish))

    def stream_close(self, usage: Usage):
        """The end of the whole stream: the usage chunk when asked, then [DONE]."""
        if self.include_usage:
            yield sse(self._object(choices=[], usage=openai_usage(usage)))
        yield sse("[DONE]")

    def stream_keepalive(self):
        # A chunk whose one choice adds no text: SDKs' stream iterators deliver it (agent CLIs'
        # idle guards count parsed chunks; SSE comments are dropped before them), and code that
        # reads `choices[0]` of every chunk still finds one. Held log-probs wait for their text.
        yield sse(self._object(choices=[{**self.empty_choice, "index": self.index}]))

    def stream_error(self, error: APIError) -> str:
        return sse(openai_error(error))


class ChatFormat(_OpenAIStream):
    """chat.completion and chat.completion.chunk objects for one response."""

    object_name = "chat.completion.chunk"
    empty_choice = {"index": 0, "delta": {"content": ""}, "finish_reason": None, "logprobs": None}

    def __init__(self, model: str, include_usage: bool = False):
        super().__init__(model, "chatcmpl", include_usage)
        self._tool_index = 0

    def _chunk(self, delta: dict, finish: str | None = None) -> dict:
        tokens = self._take()
        logprobs = {"content": [chat_logprob(t) for t in tokens]} if tokens else None
        return self._object(
            choices=[{"index": self.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
        )

    def stream_start(self, prompt_tokens: int):
        yield sse(self._chunk({"role": "assistant", "content": ""}))

    def stream_delta(self, segment: Segment):
        if isinstance(segment, Logprobs):
            self._hold(segment)
        elif isinstance(segment, Reasoning):
            yield sse(self._chunk({"reasoning_content": segment.text}))
        elif isinstance(segment, str):
            yield sse(self._chunk({"content": segment}))
        else:
            self._tool_index += 1
            yield sse(self._chunk({"tool_calls": [{"index": self._tool_index - 1, **segment}]}))

    def _last_chunk(self, finish: Finish) -> dict:
        return self._chunk({}, finish.reason)

    def body(self, segments: list[Segment], finish: Finish) -> dict:
        for segment in segments:
            if isinstance(segment, Logprobs):
                self._hold(segment)
        text = "".join(s for s in segments if isinstance(s, str))
        calls = [s for s in segments if isinstance(s, dict)]
        thought = "".join(s.text for s in segments if isinstance(s, Reasoning))
        message = {"role": "assistant", "content": text or (None if calls else "")}
        if thought:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = calls
        logprobs = {"content": [chat_logprob(t) for t in self._all]} if self.logprobs else None
        return {
            **self._object(
                choices=[
                    {"index": self.index, "message": message, "finish_reason": finish.reason, "logprobs": logprobs}
                ],
                usage=openai_usage(finish.usage),
            ),
            "object": "chat.completion",
        }


class CompletionFormat(_OpenAIStream):
    """text_completion objects (streamed chunks have the same object type)."""

    object_name = "text_completion"
    empty_choice = {"index": 0, "text": "", "finish_reason": None, "logprobs": None}

    def __init__(self, model: str, include_usage: bool = False):
        super().__init__(model, "cmpl", include_usage)
        self._offset = 0  # characters of text before the next token, for text_offset

    def _logprobs(self, tokens: list[TokenLogprob]) -> dict:
        """The legacy shape: parallel lists of tokens, their log-probs, top ones and offsets."""
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(_text(t.token))
        return {
            "tokens": [_text(t.token) for t in tokens],
            "token_logprobs": [_value(t.logprob) for t in tokens],
            "top_logprobs": [{_text(b): _value(v) for b, v in t.top} for t in tokens],
            "text_offset": offsets,
        }

    def _chunk(self, text: str, finish: str | None = None) -> dict:
        tokens = self._take()
        logprobs = self._logprobs(tokens) if tokens or (finish and self.logprobs) else None
        return self._object(
            choices=[{"index": self.index, "text": text, "finish_reason": finish, "logprobs": logprobs}]
        )

    def stream_start(self, prompt_tokens: int):
        return ()

    def stream_delta(self, segment: Segment):
        if isinstance(segment, Logprobs):
            self._hold(segment)
            return
        yield sse(self._chunk(segment))

    def _last_chunk(self, finish: Finish) -> dict:
        return self._chunk("", finish.reason)

    def body(self, segments: list[Segment], finish: Finish) -> dict:
        for segment in segments:
            if isinstance(segment, Logprobs):
                self._hold(segment)
        self._pending = list(self._all)
        text = "".join(s for s in segments if isinstance(s, str))
        return {**self._chunk(text, finish.reason), "usage": openai_usage(finish.usage)}
