"""Anthropic's Messages API, `POST /v1/messages`, on the shared pipeline.

Content blocks become chat-template messages: text joins into the message content, `tool_use`
blocks become the assistant's tool calls and `tool_result` blocks tool messages; the model's
tool calls come back as `tool_use` blocks. Errors have Anthropic's shape (errors.py).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import Field

from edge0.server.errors import APIError, anthropic_error
from edge0.server.generation import Finish, Usage
from edge0.server.pipeline import Prompt, check_model, chosen_tools, respond, sampling_params, sse
from edge0.server.schemas import Stops, Strict, TopP, join_text, temperature_field
from edge0.server.tools import Segment

router = APIRouter()
AnthropicTemperature = temperature_field(1)  # Anthropic's range is 0 to 1


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock]] = ""
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else join_text(self.content)
        # Chat templates have no error flag for a tool result, so it is said in the text.
        return f"Error: {text}" if self.is_error else text


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class InputMessage(Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class ToolDef(Strict):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict[str, Any]


class ToolChoiceParam(Strict):
    type: Literal["auto", "any", "tool", "none"]


class MessagesRequest(Strict):
    model: str
    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API; --max-tokens caps it
    messages: list[InputMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: Optional[Stops] = None
    temperature: AnthropicTemperature = None
    top_p: TopP = None
    top_k: Optional[int] = Field(None, ge=1)
    stream: bool = False
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[ToolChoiceParam] = None

    def template_messages(self) -> list[dict]:
        """The conversation as chat-template messages (OpenAI's shape, which templates take)."""
        out = []
        if self.system:
            out.append(
                {"role": "system", "content": self.system if isinstance(self.system, str) else join_text(self.system)}
            )
        for i, m in enumerate(self.messages):
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            texts = [b for b in blocks if b.type == "text"]
            uses = [b for b in blocks if b.type == "tool_use"]
            results = [b for b in blocks if b.type == "tool_result"]
            if (uses and m.role == "user") or (results and m.role == "assistant"):
                raise APIError(
                    400,
                    f"messages.{i}: tool_use blocks belong in assistant messages and "
                    "tool_result blocks in user messages",
                    f"messages.{i}.content",
                    "invalid_value",
                )
            if m.role == "user":
                out += [{"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text()} for r in results]
                if texts or not results:
                    out.append({"role": "user", "content": join_text(texts)})
            else:
                message = {"role": "assistant", "content": join_text(texts)}
                if uses:
                    message["tool_calls"] = [
                        {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": u.input}}
                        for u in uses
                    ]
                out.append(message)
        if self.messages[-1].role == "assistant":
            raise APIError(
                400,
                "The last message must be a user message: continuing a partial assistant reply "
                "(prefill) is not supported",
                "messages",
                "unsupported_value",
            )
        return out

    def tool_dicts(self) -> list[dict] | None:
        """Anthropic tools as the chat template takes them (OpenAI function tools)."""
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
            }
            for t in self.tools or []
        ] or None

    def tool_mode(self):
        kind = self.tool_choice.type if self.tool_choice else "auto"
        return kind if kind in ("auto", "none") else "forced"


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request):
    """Anthropic Messages: chat with the tokenizer's template; SSE when `stream` is true."""
    check_model(request, body.model)
    if body.top_k is not None:
        raise APIError(
            400,
            "top_k is not supported: the engine samples with temperature and top_p; omit top_k",
            "top_k",
            "unsupported_value",
        )
    params = sampling_params(
        request, body.max_tokens, "max_tokens", body.temperature, body.top_p, stop=body.stop_sequences
    )
    prompt = Prompt(
        "messages", body.template_messages(), chosen_tools(body.tool_dicts(), body.tool_mode(), "tool_choice")
    )
    return await respond(request, MessageFormat(request.app.state.engine.model_id), prompt, params, body.stream)


def _usage(usage: Usage) -> dict:
    # Anthropic counts cache reads apart: input_tokens are the prompt tokens that were prefilled.
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _stop_reason(finish: Finish) -> str:
    if finish.reason == "tool_calls":
        return "tool_use"
    if finish.reason == "length":
        return "max_tokens"
    return "stop_sequence" if finish.stop_sequence else "end_turn"


def _event(kind: str, **fields) -> str:
    return sse({"type": kind, **fields}, kind)


class MessageFormat:
    """A `message` object, or its stream of events. The blocks are built as segments arrive, so
    a whole answer is the stream's blocks."""

    def __init__(self, model: str):
        self.id, self.model = f"msg_{uuid.uuid4().hex}", model
        self.content: list[dict] = []
        self._text_open = False

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
        # The cache hit is known only once generation starts: message_delta's usage is final.
        yield _event("message_start", message=self._message(None, {"input_tokens": prompt_tokens, "output_tokens": 0}))

    def stream_delta(self, segment: Segment):
        if isinstance(segment, str):
            if not self._text_open:
                self._text_open = True
                self.content.append({"type": "text", "text": ""})
                yield _event(
                    "content_block_start", index=len(self.content) - 1, content_block={"type": "text", "text": ""}
                )
            self.content[-1]["text"] += segment
            yield _event(
                "content_block_delta", index=len(self.content) - 1, delta={"type": "text_delta", "text": segment}
            )
            return
        yield from self._close_text()
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

    def _close_text(self):
        if self._text_open:
            self._text_open = False
            yield _event("content_block_stop", index=len(self.content) - 1)

    def stream_end(self, finish: Finish):
        yield from self._close_text()
        yield _event(
            "message_delta",
            delta={"stop_reason": _stop_reason(finish), "stop_sequence": finish.stop_sequence},
            usage=_usage(finish.usage),
        )
        yield _event("message_stop")

    def stream_error(self, error: APIError) -> str:
        return sse(anthropic_error(error), "error")

    def body(self, segments: list[Segment], finish: Finish) -> dict:
        for segment in segments:
            for _ in self.stream_delta(segment):
                pass
        return self._message(finish, _usage(finish.usage))
