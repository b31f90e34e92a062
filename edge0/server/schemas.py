"""Pydantic schemas: the numeric fields every API shares, and the OpenAI Chat Completions and
Completions requests and responses.

Requests are strict (no "5" for 5, no true for 1), as OpenAI's and Anthropic's APIs are, and
unknown fields are ignored so that clients sending options we do not implement still work.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag

from edge0.sampling import SEED_MAX
from edge0.server import images
from edge0.server.errors import APIError
from edge0.server.grammar import ToolSpec
from edge0.server.pipeline import ToolChoice


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def tagged_union(kind_of: Callable[[Any], Optional[str]], members: dict[str, Any], error_type: str, message: str):
    """The union of `members` (kind -> type) that pydantic validates a value as the member
    `kind_of(value)` names; a value it names none for (None: not an object) is a 400 of
    `error_type` saying `message`. The tags read "type=KIND": errors.py leaves such a tag out of
    the field names in an error's location."""

    def tag(value) -> Optional[str]:
        kind = kind_of(value)
        return None if kind is None else f"type={kind}"

    return Annotated[
        Union[tuple(Annotated[member, Tag(f"type={kind}")] for kind, member in members.items())],
        Discriminator(tag, custom_error_type=error_type, custom_error_message=message),
    ]


# Sampling fields with edge0.sampling's ranges (check_sampling), so the engine never sees a value
# it refuses; each API may narrow them (OpenAI caps temperature at 2, Anthropic at 1).
def temperature_field(most: float):
    """An optional temperature from 0 (greedy) to `most`."""
    return Annotated[Optional[float], Field(ge=0, le=most, allow_inf_nan=False)]


OpenAITemperature = temperature_field(2)
TopP = Annotated[Optional[float], Field(gt=0, le=1, allow_inf_nan=False)]
Seed = Annotated[Optional[int], Field(ge=0, le=SEED_MAX)]
TokenCount = Annotated[Optional[int], Field(ge=1)]  # the server's --max-tokens caps it
Stops = Annotated[list[str], Field(max_length=16)]
TopLogprobs = Annotated[Optional[int], Field(ge=0, le=20)]  # OpenAI's range
# vLLM's request field: requests with different salts never share a cached prefix (docs/server.md)
CacheSalt = Annotated[Optional[str], Field(min_length=1, max_length=1024)]


MAX_CHOICES = 8  # n: each choice is a generation, counted against the queue like a request

FORMAT_NAME = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule for a format's name


class TextFormat(Strict):
    type: Literal["text"]


class JSONObjectFormat(Strict):
    type: Literal["json_object"]


class JSONSchemaSpec(Strict):
    name: FORMAT_NAME
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None


class ChatJSONSchemaFormat(Strict):
    """Chat Completions: `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`."""

    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


class ResponsesJSONSchemaFormat(JSONSchemaSpec):
    """Responses: `{"type": "json_schema", "name", "schema", "strict"}` (the spec inline; OpenAI
    requires its schema here, where Chat Completions makes it optional)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


ChatResponseFormat = Annotated[Union[TextFormat, JSONObjectFormat, ChatJSONSchemaFormat], Field(discriminator="type")]
ResponsesTextFormat = Annotated[
    Union[TextFormat, JSONObjectFormat, ResponsesJSONSchemaFormat], Field(discriminator="type")
]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


def join_text(parts) -> str:
    """The text of a list of text parts or blocks, as one message content (images have none)."""
    return "".join(t for p in parts if (t := getattr(p, "text", None)) is not None)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str
    detail: Optional[str] = None


class ImagePart(Strict):
    """An image (a data URL or a link), as coding agents send a screenshot."""

    type: Literal["image_url"]
    image_url: ImageURL


ChatPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class FunctionCall(Strict):
    name: str
    arguments: Union[str, dict[str, Any]]


class ToolCall(Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ChatPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None  # an earlier reply's reasoning, as this server returns it


class FunctionDef(Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingRequest(Strict):
    model: Optional[str] = None
    max_tokens: TokenCount = None
    temperature: OpenAITemperature = None
    top_p: TopP = None
    seed: Seed = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices: samples of one prompt (choices.py)
    stop: Union[str, Stops, None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, Any]] = None  # token id -> bias, checked by structured.logit_bias
    cache_salt: CacheSalt = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    # Newer OpenAI clients send this instead of max_tokens.
    max_completion_tokens: TokenCount = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedToolChoice, None] = None
    response_format: Optional[ChatResponseFormat] = None
    logprobs: Optional[StrictBool] = None
    top_logprobs: TopLogprobs = None
    reasoning_effort: Optional[ReasoningEffort] = None

    def logprobs_count(self) -> int | None:
        """Top log-probs per token when log-probs are asked, else None; top_logprobs without
        logprobs is a 400, as in OpenAI's API."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None

    def image_param(self) -> str | None:
        """Where the first image part is (None: the messages are text)."""
        return next(
            (
                f"messages.{i}.content.{j}"
                for i, m in enumerate(self.messages)
                for j, part in enumerate(m.content if isinstance(m.content, list) else ())
                if part.type == "image_url"
            ),
            None,
        )

    def template_messages(self) -> list[dict]:
        """Messages as the chat template expects them: text content, tool-call arguments as dicts."""
        out = []
        for i, m in enumerate(self.messages):
            content = (
                m.content if not isinstance(m.content, list) else _chat_content(m.content, f"messages.{i}.content")
            )
            # Most chat templates know no "developer" role; it is OpenAI's new name for system.
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.reasoning_content:
                msg["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                msg["tool_calls"] = [_template_tool_call(c, i) for c in m.tool_calls]
            out.append(msg)
        return out

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template takes them (without `strict`, which is ours)."""
        return [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in self.tools or []] or None

    def tool_specs(self) -> list[ToolSpec]:
        return [
            ToolSpec(t.function.name, t.function.parameters or {"type": "object"}, bool(t.function.strict))
            for t in self.tools or []
        ]

    def forced_tool(self) -> str | None:
        """The tool a named tool_choice forces (None: any tool, or none forced)."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def tool_mode(self) -> ToolChoice:
        return "auto" if self.tool_choice in (None, "auto") else "none" if self.tool_choice == "none" else "forced"


def _chat_content(parts: list, param: str) -> str | list[dict]:
    """Text parts and image_url parts (data URLs) as a template message's content (server/images.py)."""
    return images.content(
        [
            {"type": "text", "text": p.text}
            if p.type == "text"
            else images.data_url_part(p.image_url.url, f"{param}.{j}")
            for j, p in enumerate(parts)
        ]
    )


def _template_tool_call(call: ToolCall, index: int) -> dict:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise APIError(
                400, f"tool call arguments are not valid JSON: {e}", f"messages.{index}.tool_calls", "invalid_value"
            ) from None
    out = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out


class CompletionRequest(SamplingRequest):
    prompt: str = Field(min_length=1)
    logprobs: TopLogprobs = None  # the legacy API's: how many top log-probs per token


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]  # name, arguments (a JSON string)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ResponseToolCall]] = None


class CompletionResponse(BaseModel):
    """The response both completion APIs send; each names its object and the shape of its choices."""

    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: Usage


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: Optional[dict[str, Any]] = None


class ChatCompletion(CompletionResponse):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: Optional[dict[str, Any]] = None


class Completion(CompletionResponse):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "edge0"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AnthropicModelCard(BaseModel):
    """A model as Anthropic's Models API describes one (a request with an `anthropic-version` header)."""

    id: str
    type: Literal["model"] = "model"
    display_name: str
    created_at: str  # RFC 3339: when the server started (the checkpoint's release date is unknown)
    lifecycle: Literal["active"] = "active"
    max_input_tokens: int
    max_tokens: int


class AnthropicModelList(BaseModel):
    data: list[AnthropicModelCard]
    has_more: bool = False
    first_id: str | None
    last_id: str | None
