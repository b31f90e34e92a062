"""Kimi-K2 (Instruct, 0905), K2-Thinking and K2.5: the calls in a section,
`<|tool_calls_section_begin|>` `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>`
JSON `<|tool_call_end|>` ... `<|tool_calls_section_end|>`, after a `<think>` block on the thinking
models; the turn ends at <|im_end|>. All of these markers are special tokens in Kimi's tokenizer."""

from __future__ import annotations

import re

from edge0.formats.base import ChatFormat
from edge0.formats.markup import MarkupSplitter, Segment, tokenizer_calls
from edge0.textstream import split_at_first

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
ARGUMENTS = "<|tool_call_argument_begin|>"
MODEL_ID = re.compile(r"functions\.[^:\s]+:\d+")  # the ids the model writes and was trained on


class KimiFormat(ChatFormat):
    """Each call is emitted at its own <|tool_call_end|> (the section may hold several); mlx-lm's
    kimi_k2 parser (the tokenizer's) reads it. The model's ids (`functions.get_weather:0`) go to
    the client, which the template renders back."""

    name = "kimi_k2"
    families = "Kimi-K2, Kimi-K2-Thinking, Kimi-K2.5"
    call_start, call_end = "<|tool_call_begin|>", "<|tool_call_end|>"
    end_tokens = ("<|im_end|>",)
    visible = (SECTION_BEGIN, SECTION_END, ARGUMENTS)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        if "<think>" in vocab and "</think>" in vocab:  # K2-Thinking and K2.5; K2-Instruct has none
            self.think = ("<think>", "</think>")

    @classmethod
    def matches(cls, template: str, vocab: dict) -> bool:
        return SECTION_BEGIN in template and ARGUMENTS in template

    def parse(self, raw: str, tools: list[dict] | None) -> list[dict]:
        return tokenizer_calls(self.tokenizer, "kimi_k2", raw, tools)

    def splitter(self, tools: list[dict] | None, opened: bool):
        return KimiSplitter(self, tools, opened)

    def render_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[dict]:
        """Call ids not of the model's shape (another server's `call_...`, `toolu_...`) become
        `functions.NAME:N`, on the call and on its result alike, as the model writes them."""
        ids: dict[str, str] = {}
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [self._model_id(dict(c), ids) for c in m["tool_calls"]]
            found = m.get("tool_call_id")
            if isinstance(found, str):
                m["tool_call_id"] = ids.get(found, found)
            out.append(m)
        return out

    @staticmethod
    def _model_id(call: dict, ids: dict[str, str]) -> dict:
        given = call.get("id")
        if not isinstance(given, str):
            return call
        if given not in ids:
            own = given.removeprefix("toolu_")  # the Messages API's id of a call the model made
            if MODEL_ID.fullmatch(own):
                ids[given] = own
            else:
                fn = call.get("function") if isinstance(call.get("function"), dict) else {}
                name, n, used = fn.get("name") or "", len(ids), set(ids.values())
                while f"functions.{name}:{n}" in used:
                    n += 1
                ids[given] = f"functions.{name}:{n}"
        call["id"] = ids[given]
        return call


class KimiSplitter(MarkupSplitter):
    """MarkupSplitter on the text without the section markers. The section's start also closes a
    reasoning block left open: K2-Thinking may go from its reasoning to its calls without </think>."""

    def __init__(self, fmt: KimiFormat, tools: list[dict] | None, opened: bool):
        super().__init__(fmt, tools, opened)
        self.fmt = fmt
        self._buf = ""

    def feed(self, text: str) -> list[Segment]:
        self._buf += text
        out: list[Segment] = []
        while True:
            before, marker, self._buf = split_at_first(self._buf, (SECTION_BEGIN, SECTION_END))
            out += self._markup(before)
            if marker is None:
                return out
            if marker == SECTION_BEGIN and self.inside:
                out += super().feed(self.fmt.think[1])

    def finish(self) -> list[Segment]:
        rest, self._buf = self._buf, ""
        return self._markup(rest) + super().finish()

    def _markup(self, text: str) -> list[Segment]:
        return super().feed(text) if text else []
