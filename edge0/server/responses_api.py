"""OpenAI's Responses API, `POST /v1/responses`, on the shared pipeline.

`input` (a string, or message / function_call / function_call_output items) and `instructions`
become chat-template messages; the answer is a list of output items: assistant messages with
`output_text` parts and `function_call` items. Responses are not stored: there is no
`previous_response_id`; a client sends the whole conversation each turn.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import Discriminator, Field, Tag

from edge0.server.errors import APIError
from edge0.server.generation import Finish, Usage
from edge0.server.pipeline import Prompt, check_model, chosen_tools, respond, sampling_params, sse
from edge0.server.schemas import OpenAITemperature, Strict, TokenCount, TopP, join_text
from edge0.server.tools import Segment

router = APIRouter()


class ContentPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[ContentPart]]


def _item_type(item) -> str:
    # A message item may leave out its type, as OpenAI's API allows.
    return item.get("type", "message") if isinstance(item, dict) else item.type


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    ],
    Discriminator(_item_type),
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(Strict):
    model: Optional[str] = None
    input: Union[Annotated[str, Field(min_length=1)], Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    max_output_tokens: TokenCount = None
    temperature: OpenAITemperature = None
    top_p: TopP = None
    stream: bool = False
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedFunction, None] = None
    previous_response_id: Optional[str] = None

    def template_messages(self) -> list[dict]:
        """`instructions` and `input` as chat-template messages; consecutive function calls join
        the assistant message before them."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            if item.type == "message":
                content = item.content if isinstance(item.content, str) else join_text(item.content)
                out.append({"role": "system" if item.role == "developer" else item.role, "content": content})
            elif item.type == "function_call":
                try:
                    args = json.loads(item.arguments) if item.arguments.strip() else {}
                except json.JSONDecodeError as e:
                    raise APIError(
                        400, f"function_call arguments are not valid JSON: {e}", f"input.{i}.arguments", "invalid_value"
                    ) from None
                if not (out and out[-1]["role"] == "assistant"):
                    out.append({"role": "assistant", "content": ""})
                out[-1].setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": args}}
                )
            else:
                output = item.output if isinstance(item.output, str) else join_text(item.output)
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        return out

    def tool_dicts(self) -> list[dict] | None:
        """Function tools as the chat template takes them (Chat Completions' shape)."""
        return [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
            for t in self.tools or []
        ] or None

    def tool_mode(self):
        return "auto" if self.tool_choice in (None, "auto") else "none" if self.tool_choice == "none" else "forced"


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    """OpenAI Responses: chat with the tokenizer's template; SSE when `stream` is true."""
    check_model(request, body.model)
    if body.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this server stores no responses; send the "
            "whole conversation in 'input'",
            "previous_response_id",
            "unsupported_value",
        )
    params = sampling_params(request, body.max_output_tokens, "max_output_tokens", body.temperature, body.top_p)
    prompt = Prompt("input", body.template_messages(), chosen_tools(body.tool_dicts(), body.tool_mode(), "tool_choice"))
    return await respond(request, ResponseFormat(request.app.state.engine.model_id, body), prompt, params, body.stream)


def _usage(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseFormat:
    """A `response` object, or its stream of events (numbered from 0). Output items are built as
    segments arrive, so a whole answer is the stream's items."""

    def __init__(self, model: str, request: ResponsesRequest):
        self.id, self.created, self.model = f"resp_{uuid.uuid4().hex}", int(time.time()), model
        self.echo = {
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
            "tool_choice": request.tool_choice.model_dump()
            if isinstance(request.tool_choice, NamedFunction)
            else request.tool_choice or "auto",
        }
        self.output: list[dict] = []
        self._message: dict | None = None  # the message item receiving text, while open
        self._message_index = 0
        self._sequence = 0

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
            "store": False,
            "text": {"format": {"type": "text"}},
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

    def stream_delta(self, segment: Segment):
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
            self._message["content"][0]["text"] += segment
            yield self._event("response.output_text.delta", **self._where(), delta=segment, logprobs=[])
            return
        yield from self._close_message()
        fn = segment["function"]
        item = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "status": "in_progress",
            "call_id": segment["id"],
            "name": fn["name"],
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
            name=fn["name"],
            arguments=fn["arguments"],
        )
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _where(self) -> dict:
        return {"item_id": self._message["id"], "output_index": self._message_index, "content_index": 0}

    def _close_message(self):
        if self._message is None:
            return
        part = self._message["content"][0]
        yield self._event("response.output_text.done", **self._where(), text=part["text"], logprobs=[])
        yield self._event("response.content_part.done", **self._where(), part=part)
        self._message["status"] = "completed"
        yield self._event("response.output_item.done", output_index=self._message_index, item=self._message)
        self._message = None

    def stream_end(self, finish: Finish):
        yield from self._close_message()
        response = self._response(finish)
        yield self._event(f"response.{response['status']}", response=response)

    def stream_error(self, error: APIError) -> str:
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def body(self, segments: list[Segment], finish: Finish) -> dict:
        for segment in segments:
            for _ in self.stream_delta(segment):
                pass
        for _ in self._close_message():
            pass
        return self._response(finish)
