"""A family's chat format, as far as the model's output goes: where its turn ends, how its
reasoning and its tool calls are marked up, which special tokens its parser must see, and the
call ids its template accepts back. One small module per format (the families' published
templates and tokenizers are the reference); `edge0.formats.detect` picks one for a tokenizer."""

from __future__ import annotations

import json
import uuid

from edge0.formats.markup import MarkupSplitter


class ChatFormat:
    """The defaults describe a format without tool calls or reasoning; a format overrides what
    its family marks up. `splitter` turns the streamed text of a reply into Segments."""

    name = "plain"
    priority = 100  # detection order of the formats of our own (edge0.formats.detect)
    families = ""  # the models that write it (docs, the start-up line)
    think: tuple[str, str] | None = None  # reasoning block markers
    call_start: str | None = None  # a tool call's markers (None: the format has no tool calls)
    call_end = ""  # empty: a call runs to the end of the output
    end_tokens: tuple[str, ...] = ()  # tokens that end the turn besides the declared end ids
    visible: tuple[str, ...] = ()  # special tokens the parser reads besides the markers
    drop: tuple[str, ...] = ()  # structural markers left out of the answer text (Kimi K3's `<|open|>response<|sep|>`)
    json_calls = False  # a call is {"name": ..., "arguments": ...} JSON: a forced call can be generated
    arguments_as_text = False  # the template renders a call's arguments as given: send it the JSON text

    @property
    def calls(self) -> bool:
        return self.call_start is not None

    def markers(self) -> tuple[str, ...]:
        """Every token text the splitter reads: never hidden from the text as a control token."""
        found = [*(self.think or ()), self.call_start or "", self.call_end, *self.drop, *self.visible]
        return tuple(m for m in found if m)

    def parse(self, raw: str, tools: list[dict] | None) -> list[dict]:
        """The calls in `raw` (the text between the call markers): dicts with "name",
        "arguments" (a dict or its JSON text) and, when the model writes one, "id". Raises on
        text that is not a call."""
        raise NotImplementedError(f"the {self.name} format has no tool calls")

    def splitter(self, tools: list[dict] | None, opened: bool):
        """A splitter of one reply's text (feed / finish -> Segments; `calls` counts the calls):
        reasoning first when the format has markers for it (`opened`: the prompt opened the
        block), then tool calls when the request gave tools."""
        return MarkupSplitter(self, tools, opened)

    @property
    def reasons(self) -> bool:
        """The model writes reasoning this format returns as reasoning."""
        return self.think is not None

    def render_tools(self, tools: list[dict] | None) -> list[dict] | None:
        """The tools as the family's template takes them."""
        return tools

    def render_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[dict]:
        """The conversation as the family's template takes it (`tools`: the request's, for a
        format whose template does not render them itself): the call ids a client sends back in
        the shape the template accepts (history_id), a call's arguments as its JSON text where the
        template renders them as given (arguments_as_text)."""
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [self._render_call(c) for c in m["tool_calls"]]
            if isinstance(m.get("tool_call_id"), str):
                m["tool_call_id"] = self.history_id(m["tool_call_id"])
            out.append(m)
        return out

    def _render_call(self, call: dict) -> dict:
        call = dict(call)
        if isinstance(call.get("id"), str):
            call["id"] = self.history_id(call["id"])
        fn = call.get("function")
        if self.arguments_as_text and isinstance(fn, dict) and not isinstance(fn.get("arguments"), str):
            call["function"] = {**fn, "arguments": json.dumps(fn.get("arguments") or {}, ensure_ascii=False)}
        return call

    def call_id(self) -> str:
        """A new call's id, in the shape the family's template accepts back."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def history_id(self, call_id: str) -> str:
        """The id to render for a call id a client sends back (one this server made, or another's)."""
        return call_id

    def describe(self) -> str:
        """One line for the start-up log."""
        if not self.calls:
            return f"chat format: {self.name} (no tool calls: requests with tools are refused, docs/clients.md)"
        reasoning = f"reasoning {self.think[0]}...{self.think[1]}" if self.think else "no reasoning markup"
        return f"chat format: {self.name} ({self.families or 'tool calls ' + self.call_start}; {reasoning})"
