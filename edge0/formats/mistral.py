"""Mistral's `[TOOL_CALLS]` formats, the turn ending at </s>: v3 (Mixtral-8x22B-Instruct,
Mistral-7B-Instruct-v0.3, Nemo, Small 3.1) writes a JSON list of calls after it; v11/v13 (Mistral
Large 3, Ministral 3, Magistral, Small 3.2, Devstral) write `NAME[ARGS]{...}` after each one (v11
with `[CALL_ID]ID` before `[ARGS]`) and reason in `[THINK]...[/THINK]`. Call ids are 9 letters and
digits: the templates refuse any other in the history."""

from __future__ import annotations

import json
import re
import string

from edge0.formats.base import ChatFormat
from edge0.formats.markup import MarkupSplitter, ShortIds, ToolCallSplitter, tokenizer_calls

ALPHANUMERIC = string.ascii_letters + string.digits
IDS = ShortIds(ALPHANUMERIC, 9)
HEADER = re.compile(r"\s*([\w.-]+)\s*(?:\[CALL_ID\]\s*(\w+)\s*)?\[ARGS\]\s*")


class MistralFormat(ChatFormat):
    """v3: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, read by mlx-lm's mistral parser
    (the tokenizer's); a single object is read too (the shape of a forced call)."""

    name = "mistral"
    priority = 50
    families = "Mixtral-8x22B-Instruct, Mistral-7B-Instruct-v0.3, Mistral Nemo, Mistral Small 3.1"
    call_start = "[TOOL_CALLS]"
    json_calls = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def matches(cls, template: str, vocab: dict) -> bool:
        return "[TOOL_CALLS]" in template and "[ARGS]" not in template

    def call_length(self, text: str) -> int | None:
        """The length of the call at the start of `text` (after the call marker) once it is
        complete, else None (it may still be written)."""
        start = len(text) - len(text.lstrip())
        if text[start : start + 1] not in ("[", "{"):
            return None
        try:
            return json.JSONDecoder().raw_decode(text, start)[1]
        except json.JSONDecodeError:
            return None

    def parse(self, raw: str, tools: list[dict] | None) -> list[dict]:
        raw = raw.strip()
        return self._parser(f"[{raw}]" if raw.startswith("{") else raw, tools)

    def _parser(self, raw: str, tools: list[dict] | None) -> list[dict]:
        return tokenizer_calls(self.tokenizer, "mistral", raw, tools)

    def splitter(self, tools: list[dict] | None, opened: bool):
        split = MarkupSplitter(self, tools, opened)
        if split.tools:
            split.tools = MistralCallSplitter(self, tools)
        return split

    def call_id(self) -> str:
        return IDS.new()

    def history_id(self, call_id: str) -> str:
        return IDS.of(call_id)


class Mistral3Format(MistralFormat):
    """v11/v13: `[TOOL_CALLS]NAME[ARGS]{...}`, once per call; `[ARGS]`, `[CALL_ID]`, `[THINK]` and
    `[/THINK]` are special tokens, kept in the text for the parser."""

    name = "mistral3"
    priority = 40
    families = "Mistral Large 3, Ministral 3, Magistral, Mistral Small 3.2, Devstral"
    think = ("[THINK]", "[/THINK]")
    visible = ("[ARGS]", "[CALL_ID]")
    json_calls = False

    @classmethod
    def matches(cls, template: str, vocab: dict) -> bool:
        return "[TOOL_CALLS]" in template and "[ARGS]" in template

    def call_length(self, text: str) -> int | None:
        header = HEADER.match(text)
        if header is None or text[header.end() : header.end() + 1] != "{":
            return None
        try:
            return json.JSONDecoder().raw_decode(text, header.end())[1]
        except json.JSONDecodeError:
            return None

    def parse(self, raw: str, tools: list[dict] | None) -> list[dict]:
        header = HEADER.match(raw)
        if header is None:
            raise ValueError(f"not a NAME[ARGS]{{...}} call: {raw!r}")
        calls = self._parser(f"{header[1]}[ARGS]{raw[header.end() :]}", tools)
        if header[2] and len(calls) == 1:  # v11: the model wrote the call's id
            calls[0]["id"] = header[2]
        return calls


class MistralCallSplitter(ToolCallSplitter):
    """A call has no end marker: it ends where its JSON does, and is emitted there."""

    def feed(self, text: str) -> list:
        out = list(super().feed(text))
        while self._in_call and (end := self.fmt.call_length(self._buf)) is not None:
            raw, self._buf, self._in_call = self._buf[:end], self._buf[end:], False
            out += self._parse(raw)
            out += super().feed("")
        return out
