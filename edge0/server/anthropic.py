"""Anthropic's Messages API, `POST /v1/messages` and `POST /v1/messages/count_tokens`, on the
shared pipeline.

Content blocks become chat-template messages: text joins into the message content, `tool_use`
blocks become the assistant's tool calls and `tool_result` blocks tool messages, `thinking`
blocks the assistant's `reasoning_content`; the model's tool calls come back as `tool_use`
blocks and its reasoning as `thinking` blocks. Errors have Anthropic's shape (errors.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import Field

from edge0.server import images
from edge0.server.anthropic_format import MessageFormat
from edge0.server.errors import APIError
from edge0.server.grammar import ToolSpec
from edge0.server.pipeline import Prompt, check_model, chosen_tools, prompt_tokens, respond, sampling_params
from edge0.server.schemas import CacheSalt, Stops, Strict, TopP, join_text, temperature_field
from edge0.server.structured import tool_constraint

router = APIRouter()
AnthropicTemperature = temperature_field(1)  # Anthropic's range is 0 to 1
THINKING_BUDGET_LEAST = 1024  # Anthropic's smallest budget_tokens
THINKING_IGNORED = (
    "thinking_without_reasoning_format",
    "a request asked for thinking, but this model has no reasoning format (no <think>-style markers in its "
    "tokenizer): answering without reasoning (counted in /v1/stats as thinking_without_reasoning_format)",
)


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class ImageSource(Strict):
    type: Literal["base64", "url", "file"]
    media_type: Optional[str] = None
    data: Optional[str] = None
    url: Optional[str] = None
    file_id: Optional[str] = None


class ImageBlock(Strict):
    """An image (Claude Code sends a pasted screenshot so, and in a tool's result)."""

    type: Literal["image"]
    source: ImageSource

    def part(self, param: str) -> dict:
        """The block as a template message's image part (base64 data; a link or file is a 400)."""
        s = self.source
        if s.type == "url" and s.url:
            return images.link_part(s.url, f"{param}.source")
        if s.type != "base64":
            return images.url_refused(f"{param}.source", "a file id" if s.type == "file" else "an empty URL")
        return images.base64_part(s.media_type, s.data, f"{param}.source")


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolReferenceBlock(Strict):
    """A tool search's answer (Claude Code's ToolSearch): the deferred tool it names is loaded from here on."""

    type: Literal["tool_reference"]
    tool_name: str


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[
        str, list[Annotated[Union[TextBlock, ImageBlock, ToolReferenceBlock], Field(discriminator="type")]]
    ] = ""
    is_error: bool = False

    def references(self) -> list[str]:
        return (
            [] if isinstance(self.content, str) else [b.tool_name for b in self.content if b.type == "tool_reference"]
        )

    def content_for(self, param: str) -> str | list[dict]:
        """The result as a tool message's content: its text, with its images when it has some."""
        if isinstance(self.content, list) and any(b.type == "image" for b in self.content):
            parts = [b.part(f"{param}.content.{k}") for k, b in enumerate(self.content) if b.type == "image"]
            return images.content([{"type": "text", "text": self.text()}, *parts])
        return self.text()

    def text(self) -> str:
        if isinstance(self.content, str):
            text = self.content
        else:  # a reference says which tool it loaded; its definition joins the prompt's tools
            loaded = [f"Tool loaded: {name}" for name in self.references()]
            text = "\n".join(filter(None, [join_text(b for b in self.content if b.type == "text"), *loaded]))
        # Chat templates have no error flag for a tool result, so it is said in the text.
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Strict):
    """An earlier reply's reasoning, as clients send it back (its signature is not checked)."""

    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
    Field(discriminator="type"),
]


class InputMessage(Strict):
    # "system" inside `messages` is Claude Code's mid-conversation system turn (beta
    # mid-conversation-system-2026-04-07); other roles are refused in Anthropic's words (below).
    role: str
    content: Union[str, list[Block]]


class ToolDef(Strict):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    # out of the prompt until a tool search's tool_reference (or an earlier call) loads it, as in Anthropic's API
    defer_loading: Optional[bool] = None


class ToolChoiceParam(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None  # the tool that type "tool" forces
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=THINKING_BUDGET_LEAST)


class ThinkingOther(Strict):
    type: Literal["disabled", "adaptive"]


Thinking = Annotated[Union[ThinkingEnabled, ThinkingOther], Field(discriminator="type")]


BILLING_HEADER = "x-anthropic-billing-header:"


def _without_billing(blocks: list[TextBlock]) -> list[TextBlock]:
    """The system blocks without Claude Code's billing line (`x-anthropic-billing-header:
    cc_version=2.1.197.a7b; ...`): its suffix differs between requests and sessions, and at the
    very start of the prompt it would keep any two of them from sharing a cached prefix; it means
    nothing to the model."""
    return [b for b in blocks if not b.text.startswith(BILLING_HEADER)]


class CountTokensRequest(Strict):
    """What decides the prompt: the body of count_tokens, and the base of a Messages request."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[ToolChoiceParam] = None
    thinking: Optional[Thinking] = None

    def image_param(self) -> str | None:
        """Where the first image block is, in a message or a tool's result (None: text only)."""
        for i, m in enumerate(self.messages):
            for j, block in enumerate(m.content if isinstance(m.content, list) else ()):
                inner = block.content if block.type == "tool_result" and isinstance(block.content, list) else ()
                if block.type == "image":
                    return f"messages.{i}.content.{j}"
                k = next((k for k, b in enumerate(inner) if b.type == "image"), None)
                if k is not None:
                    return f"messages.{i}.content.{j}.content.{k}"
        return None

    def template_messages(self) -> list[dict]:
        """The conversation as chat-template messages (OpenAI's shape, which templates take)."""
        out = []
        system = self.system if isinstance(self.system, str) else join_text(_without_billing(self.system or []))
        if system:
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            if m.role not in ("user", "assistant", "system"):
                # Worded as Anthropic's API words it: clients match it to fall back (Claude Code).
                raise APIError(
                    400,
                    f'messages.{i}: Unexpected role "{m.role}". The Messages API accepts "user", "assistant" '
                    'and "system" as input message roles; tool results go in user messages as tool_result blocks',
                    f"messages.{i}.role",
                    "invalid_value",
                )
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            texts = [b for b in blocks if b.type == "text"]
            uses = [b for b in blocks if b.type == "tool_use"]
            results = [b for b in blocks if b.type == "tool_result"]
            thoughts = [b.thinking for b in blocks if b.type == "thinking"]
            if m.role == "system":
                if len(texts) != len(blocks):
                    raise APIError(
                        400,
                        f"messages.{i}: a system message holds text blocks only",
                        f"messages.{i}.content",
                        "invalid_value",
                    )
                out.append({"role": "system", "content": join_text(texts)})
                continue
            if (uses and m.role == "user") or (results and m.role == "assistant"):
                raise APIError(
                    400,
                    f"messages.{i}: tool_use blocks belong in assistant messages and "
                    "tool_result blocks in user messages",
                    f"messages.{i}.content",
                    "invalid_value",
                )
            if m.role == "user":
                out += [
                    {
                        "role": "tool",
                        "tool_call_id": r.tool_use_id,
                        "content": r.content_for(f"messages.{i}.content.{j}"),
                    }
                    for j, r in enumerate(blocks)
                    if r.type == "tool_result"
                ]
                shown = [
                    {"type": "text", "text": b.text} if b.type == "text" else b.part(f"messages.{i}.content.{j}")
                    for j, b in enumerate(blocks)
                    if b.type in ("text", "image")
                ]
                if shown or not results:
                    out.append({"role": "user", "content": images.content(shown)})
            else:
                message = {"role": "assistant", "content": join_text(texts)}
                if thoughts:
                    message["reasoning_content"] = "".join(thoughts)
                if uses:
                    message["tool_calls"] = [
                        {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": u.input}}
                        for u in uses
                    ]
                out.append(message)
        turns = [m.role for m in self.messages if m.role != "system"]
        if not turns:
            raise APIError(400, "messages: the conversation has no user message", "messages", "invalid_value")
        if turns[-1] == "assistant":
            raise APIError(
                400,
                "The last message must be a user message: continuing a partial assistant reply "
                "(prefill) is not supported",
                "messages",
                "unsupported_value",
            )
        return out

    def tool_dicts(self) -> list[dict] | None:
        """Anthropic tools as the chat template takes them (OpenAI function tools): the loaded ones."""
        loaded = self.loaded_tools()
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
            }
            for t in self.tools or []
            if t.name in loaded
        ] or None

    def loaded_tools(self) -> set[str]:
        """The tools in the prompt: every tool not deferred, and each deferred one that a
        tool_reference block in the conversation named or an earlier tool_use called."""
        names = {t.name for t in self.tools or []}
        loaded = {t.name for t in self.tools or [] if not t.defer_loading}
        for i, m in enumerate(self.messages):
            for j, b in enumerate([] if isinstance(m.content, str) else m.content):
                if b.type == "tool_use":
                    loaded.add(b.name)
                for name in b.references() if b.type == "tool_result" else ():
                    if name not in names:
                        raise APIError(
                            400,
                            f"messages.{i}.content.{j}: a tool_reference names the tool '{name}', which is not "
                            "in 'tools'",
                            f"messages.{i}.content.{j}.content",
                            "invalid_value",
                        )
                    loaded.add(name)
        return loaded & names

    def tool_mode(self):
        kind = self.tool_choice.type if self.tool_choice else "auto"
        return kind if kind in ("auto", "none") else "forced"

    def prompt(self, fmt) -> Prompt:
        """The prompt: thinking on only when asked (Anthropic's default is off), and a forced
        tool call (tool_choice any / tool) generated under its tool's input schema."""
        thinking = self.thinking is not None and self.thinking.type != "disabled"
        notes = ()
        if thinking and not fmt.reasons:
            # Claude Code asks for thinking by default; answer without it rather than refuse.
            thinking, notes = False, (THINKING_IGNORED,)
        tools, constraint = self.tool_dicts(), None
        if self.tool_mode() == "forced":
            if thinking:  # as Anthropic's API
                raise APIError(
                    400, "Thinking may not be enabled when tool_choice forces tool use", "tool_choice", "invalid_value"
                )
            if self.tool_choice.type == "tool" and not self.tool_choice.name:
                raise APIError(
                    400, "tool_choice of type 'tool' needs the tool's 'name'", "tool_choice", "invalid_value"
                )
            specs = [ToolSpec(t.name, t.input_schema) for t in self.tools or []]
            constraint = tool_constraint(specs, self.tool_choice.name, "tool_choice")
        return Prompt(
            "messages",
            self.template_messages(),
            chosen_tools(tools, self.tool_mode()),
            template_kwargs={"enable_thinking": thinking},
            constraint=constraint,
            constraint_param="tool_choice",
            image_param=self.image_param(),
            thinking_budget=self.thinking.budget_tokens
            if thinking and isinstance(self.thinking, ThinkingEnabled)
            else None,
            notes=notes,
        )


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API; clamped to the server's limits
    stop_sequences: Optional[Stops] = None
    temperature: AnthropicTemperature = None
    top_p: TopP = None
    top_k: Optional[int] = Field(None, ge=1)
    stream: bool = False
    cache_salt: CacheSalt = None


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request):
    """Anthropic Messages: chat with the tokenizer's template; SSE when `stream` is true."""
    model = check_model(request, body.model)
    params = sampling_params(
        body.max_tokens, body.temperature, body.top_p, stop=body.stop_sequences, top_k=body.top_k or 0
    )
    prompt = replace(body.prompt(request.app.state.engine.chat_format), cache_salt=body.cache_salt)
    return await respond(request, MessageFormat(model), prompt, params, body.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    """The prompt tokens /v1/messages would prefill for the same request (system and tools
    included, after the chat template), without generating."""
    check_model(request, body.model)
    tokens, _ = await prompt_tokens(request, body.prompt(request.app.state.engine.chat_format))
    return {"input_tokens": len(tokens)}
