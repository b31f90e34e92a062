"""OpenAI's Responses API, `POST /v1/responses` (and `/responses`), on the shared pipeline.

`input` (a string, or message / function_call / function_call_output / reasoning items) and
`instructions` become chat-template messages; the answer is a list of output items: reasoning
items, assistant messages with `output_text` parts and `function_call` items
(responses_format.py). Responses are not stored: there is no `previous_response_id`; a client
sends the whole conversation each turn.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from edge0.server import images
from edge0.server.errors import APIError
from edge0.server.pipeline import Prompt, check_model, chosen_tools, respond, sampling_params
from edge0.server.responses_format import ResponseFormat
from edge0.server.responses_tools import NamedFunction, ResponsesTools, Tool, ToolChoice, flat_name
from edge0.server.schemas import (
    CacheSalt,
    OpenAITemperature,
    ReasoningEffort,
    ResponsesTextFormat,
    Strict,
    TokenCount,
    TopP,
    join_text,
    tagged_union,
)
from edge0.server.structured import format_constraint, thinking_switch, tool_constraint

LOGPROBS = "message.output_text.logprobs"  # the `include` value asking for output text's log-probs

router = APIRouter()


class TextContent(Strict):
    type: Literal["input_text", "output_text"]
    text: str


class ImageContent(Strict):
    """An image (Codex sends a pasted screenshot so): a data URL or a link, or an uploaded file."""

    type: Literal["input_image"]
    image_url: Optional[str] = None
    file_id: Optional[str] = None
    detail: Optional[str] = None


ContentPart = Annotated[Union[TextContent, ImageContent], Field(discriminator="type")]


def _content(parts: list, param: str) -> str | list[dict]:
    """Text and input_image parts (data URLs) as a template message's content (server/images.py)."""
    out = []
    for j, p in enumerate(parts):
        if p.type != "input_image":
            out.append({"type": "text", "text": p.text})
        elif p.image_url is None:
            out.append(images.url_refused(f"{param}.{j}", "a file id"))
        else:
            out.append(images.data_url_part(p.image_url, f"{param}.{j}.image_url"))
    return images.content(out)


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: Optional[str] = None  # a call of a tool in a namespace group (responses_tools.py)


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[ContentPart]]


class ReasoningPart(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    """An earlier reply's reasoning, sent back; its text goes to the next assistant message."""

    type: Literal["reasoning"]
    summary: list[ReasoningPart] = []
    content: Optional[list[ReasoningPart]] = None
    encrypted_content: Optional[str] = None

    def text(self) -> str:
        return join_text(self.content) if self.content else join_text(self.summary)


def _item_kind(item) -> str | None:
    # A message item may leave out its type, as OpenAI's API allows; None (not an object) is a 400.
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None) if isinstance(item, BaseModel) else None


InputItem = tagged_union(
    _item_kind,
    {
        "message": MessageItem,
        "function_call": FunctionCallItem,
        "function_call_output": FunctionCallOutputItem,
        "reasoning": ReasoningItem,
    },
    "invalid_input_item",
    "an input item must be an object whose type is message (the default), function_call, function_call_output "
    "or reasoning",
)


class TextOptions(Strict):
    format: Optional[ResponsesTextFormat] = None


class ReasoningOptions(Strict):
    effort: Optional[ReasoningEffort] = None


class ResponsesRequest(Strict):
    model: Optional[str] = None
    input: Union[Annotated[str, Field(min_length=1)], Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    max_output_tokens: TokenCount = None
    temperature: OpenAITemperature = None
    top_p: TopP = None
    stream: bool = False
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    previous_response_id: Optional[str] = None
    text: Optional[TextOptions] = None
    reasoning: Optional[ReasoningOptions] = None
    cache_salt: CacheSalt = None
    include: Optional[list[str]] = None  # "message.output_text.logprobs" is the one this server fills
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    def logprobs_count(self) -> int | None:
        """Top log-probs per output token when asked for (None: no log-probs)."""
        if LOGPROBS in (self.include or ()) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None

    def image_param(self) -> str | None:
        """Where the first image part is, in a message or a function call's output (None: text only)."""
        for i, item in enumerate(() if isinstance(self.input, str) else self.input):
            field = {"message": "content", "function_call_output": "output"}.get(item.type)
            parts = getattr(item, field) if field else ()
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                if part.type == "input_image":
                    return f"input.{i}.{field}.{j}"
        return None

    def template_messages(self) -> list[dict]:
        """`instructions` and `input` as chat-template messages; consecutive function calls join
        the assistant message before them."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        thought = ""  # reasoning items go to the assistant message that follows them
        for i, item in enumerate(items):
            if item.type == "reasoning":
                thought += item.text()
                continue
            if item.type == "message":
                content = (
                    item.content if isinstance(item.content, str) else _content(item.content, f"input.{i}.content")
                )
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
                name = flat_name(item.namespace, item.name)
                out[-1].setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": args}}
                )
            else:
                output = item.output if isinstance(item.output, str) else _content(item.output, f"input.{i}.output")
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            if thought and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"], thought = thought, ""
        return out

    def tool_set(self) -> ResponsesTools:
        return ResponsesTools(self.tools, self.tool_choice)

    def tool_mode(self):
        return "auto" if self.tool_choice in (None, "auto") else "none" if self.tool_choice == "none" else "forced"

    def echo(self) -> dict:
        """The request fields a response object repeats."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "tool_choice": self.tool_choice.model_dump()
            if isinstance(self.tool_choice, NamedFunction)
            else self.tool_choice or "auto",
            "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)}
            if self.text and self.text.format
            else {"format": {"type": "text"}},
        }

    def prompt(self, tools: ResponsesTools) -> Prompt:
        """The prompt, with a forced tool call or `text.format` as its constraint; reasoning is on
        as `reasoning.effort` says (the template's default without one), and off before a
        constrained output unless asked."""
        if self.tool_mode() == "forced":
            name = self.tool_choice.name if isinstance(self.tool_choice, NamedFunction) else None
            constraint, where = tool_constraint(tools.specs(), name, "tool_choice"), "tool_choice"
        else:
            constraint, where = format_constraint(self.text and self.text.format, "text.format"), "text.format"
        switch = thinking_switch(self.reasoning and self.reasoning.effort)
        if constraint is not None and not switch:
            switch = {"enable_thinking": False}
        return Prompt(
            "input",
            self.template_messages(),
            chosen_tools(tools.template_tools(), self.tool_mode()),
            template_kwargs=switch,
            constraint=constraint,
            constraint_param=where,
            notes=tools.notes(),
            cache_salt=self.cache_salt,
            image_param=self.image_param(),
        )


@router.post("/v1/responses")
@router.post("/responses", include_in_schema=False)
async def create_response(body: ResponsesRequest, request: Request):
    """OpenAI Responses: chat with the tokenizer's template; SSE when `stream` is true."""
    model = check_model(request, body.model)
    if body.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this server stores no responses; send the "
            "whole conversation in 'input'",
            "previous_response_id",
            "unsupported_value",
        )
    params = sampling_params(body.max_output_tokens, body.temperature, body.top_p, logprobs=body.logprobs_count())
    tools = body.tool_set()
    fmt = ResponseFormat(model, body.echo(), tools.split)
    return await respond(request, fmt, body.prompt(tools), params, body.stream)
