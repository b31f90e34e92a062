"""OpenAI Responses: the `response` object and its stream of events (output items: reasoning,
messages with `output_text`, function calls)."""

from __future__ import annotations

import time
import uuid

from edge0.formats import Reasoning
from edge0.server.chat_format import chat_logprob
from edge0.server.errors import APIError
from edge0.server.generation import Finish, Logprobs, Segment, TokenLogprob, Usage
from edge0.server.pipeline import sse


def _usage(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": usage.cache_write_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _delta(entries: list[dict]) -> list[dict]:
    """Log-probs as the stream's text events carry them: without the bytes an output_text part has."""
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]],
        }
        for e in entries
    ]


class ResponseFormat:
    """A `response` object, or its stream of events (numbered from 0). Output items are built as
    segments arrive, so a whole answer is the stream's items."""

    def __init__(self, model: str, echo: dict, split=lambda name: (None, name)):
        self.id, self.created, self.model = f"resp_{uuid.uuid4().hex}", int(time.time()), model
        self.echo = echo  # request fields the response object repeats
        self.split = split  # a called tool's name as the model saw it -> (namespace, name)
        self.output: list[dict] = []
        self._message: dict | None = None  # the message item receiving text, while open
        self._message_index = 0
        self._reasoning: dict | None = None  # the reasoning item receiving text, while open
        self._sequence = 0
        self._logprobs: list[TokenLogprob] = []  # of the tokens whose text comes next

    def _response(self, finish: Finish | None = None) -> dict:
        """The response object: in progress without `finish`; else completed, or incomplete when
        max_output_tokens cut it."""
        status = "in_progress" if finish is None else "incomplete" if finish.reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": self.output if finish else [],
            "error": None,
            "incomplete_details": incomplete,
            "parallel_tool_calls": True,
            "metadata": {},
            "truncation": "disabled",
            "usage": _usage(finish.usage) if finish else None,
            **self.echo,
        }

    def _event(self, kind: str, **fields) -> str:
        # Serialized now, so the items mutated later (text appended, status) show as they are now.
        self._sequence += 1
        return sse({"type": kind, "sequence_number": self._sequence - 1, **fields}, kind)

    def stream_start(self, prompt_tokens: int):
        yield self._event("response.created", response=self._response())
        yield self._event("response.in_progress", response=self._response())

    def stream_keepalive(self):
        # Codex's idle timeout counts SSE events (not comments): the in-progress event again.
        yield self._event("response.in_progress", response=self._response())

    def stream_delta(self, segment: Segment):
        if isinstance(segment, Logprobs):  # asked for (include message.output_text.logprobs)
            self._logprobs += segment.tokens
            return
        taken, self._logprobs = self._logprobs, []  # only output text carries log-probs
        if isinstance(segment, Reasoning):
            yield from self._reason(segment.text)
            return
        yield from self._close_reasoning()
        if isinstance(segment, str):
            if self._message is None:
                self._message = {
                    "id": f"msg_{uuid.uuid4().hex}",
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                self.output.append(self._message)
                self._message_index = len(self.output) - 1
                yield self._event("response.output_item.added", output_index=self._message_index, item=self._message)
                self._message["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                yield self._event("response.content_part.added", **self._where(), part=self._message["content"][0])
            part = self._message["content"][0]
            part["text"] += segment
            entries = [chat_logprob(t) for t in taken]
            part["logprobs"] += entries
            yield self._event("response.output_text.delta", **self._where(), delta=segment, logprobs=_delta(entries))
            return
        yield from self._close_message()
        fn = segment["function"]
        namespace, name = self.split(fn["name"])
        item = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "status": "in_progress",
            "call_id": segment["id"],
            "name": name,
            **({"namespace": namespace} if namespace else {}),
            "arguments": "",
        }
        self.output.append(item)
        index = len(self.output) - 1
        yield self._event("response.output_item.added", output_index=index, item=item)
        item.update(arguments=fn["arguments"], status="completed")
        yield self._event(
            "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=fn["arguments"]
        )
        yield self._event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=fn["arguments"],
        )
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _reason(self, text: str):
        """Reasoning text goes to an open reasoning item (`content`: one `reasoning_text` part)."""
        if self._reasoning is None:
            yield from self._close_message()
            self._reasoning = {
                "id": f"rs_{uuid.uuid4().hex}",
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
            }
            self.output.append(self._reasoning)
            yield self._event("response.output_item.added", output_index=len(self.output) - 1, item=self._reasoning)
        self._reasoning["content"][0]["text"] += text
        yield self._event(
            "response.reasoning_text.delta",
            item_id=self._reasoning["id"],
            output_index=self._reasoning_index(),
            content_index=0,
            delta=text,
        )

    def _reasoning_index(self) -> int:
        return next(i for i, item in enumerate(self.output) if item is self._reasoning)

    def _close_reasoning(self):
        if self._reasoning is None:
            return
        index, item = self._reasoning_index(), self._reasoning
        yield self._event(
            "response.reasoning_text.done",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            text=item["content"][0]["text"],
        )
        item["status"] = "completed"
        self._reasoning = None
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _where(self) -> dict:
        return {"item_id": self._message["id"], "output_index": self._message_index, "content_index": 0}

    def _close_message(self):
        if self._message is None:
            return
        part = self._message["content"][0]
        logprobs = _delta(part["logprobs"])
        yield self._event("response.output_text.done", **self._where(), text=part["text"], logprobs=logprobs)
        yield self._event("response.content_part.done", **self._where(), part=part)
        self._message["status"] = "completed"
        yield self._event("response.output_item.done", output_index=self._message_index, item=self._message)
        self._message = None

    def stream_end(self, finish: Finish):
        yield from self._close_reasoning()
        yield from self._close_message()
        response = self._response(finish)
        yield self._event(f"response.{response['status']}", response=response)

    def stream_error(self, error: APIError) -> str:
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def body(self, segments: list[Segment], finish: Finish) -> dict:
        for segment in segments:
            for _ in self.stream_delta(segment):
                pass
        for _ in [*self._close_reasoning(), *self._close_message()]:
            pass
        return self._response(finish)
