"""The formats mlx-lm's tokenizer infers from a chat template or vocabulary (`<tool_call>` JSON,
Qwen3-Coder's `<function=..>` XML, MiniMax's `<minimax:tool_call>`, GLM's `<arg_key>`, pythonic
calls, Kimi-K2's sections, Mistral's `[TOOL_CALLS]`, Gemma 4's `<|tool_call>`, Kimi K3's XTML, ...): its
markers, reasoning markers, structural markers and parser (`TokenizerWrapper.tool_parser`), reused as they
are; the special tokens a marker is spelled with, and those a parser reads, stay in the text."""

from __future__ import annotations

from edge0.formats.base import ChatFormat
from edge0.formats.markup import tokenizer_calls

# Special tokens a parser reads inside a call besides its markers (mlx_lm/tool_parsers/NAME.py):
# Gemma 4's string delimiter, `call:get_weather{city:<|"|>Paris<|"|>}`.
PARSER_TOKENS = {"gemma4": ('<|"|>',)}


class MlxLmFormat(ChatFormat):
    """The format of a tokenizer mlx-lm has inferred one for (`tool_parser_type`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        kwargs = getattr(tokenizer, "init_kwargs", None) or {}
        self.name = kwargs.get("tool_parser_type") or "mlx-lm"
        if getattr(tokenizer, "has_thinking", False):
            self.think = (tokenizer.think_start, tokenizer.think_end)
        if getattr(tokenizer, "has_tool_calling", False):
            self.call_start, self.call_end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
            self.json_calls = _reads_json(tokenizer)
            self.families = f"mlx-lm's {self.name} parser"
        self.drop = tuple(getattr(tokenizer, "structural_markers", None) or ())
        self.visible = (*_pieces(tokenizer, self.markers()), *PARSER_TOKENS.get(self.name, ()))

    def parse(self, raw: str, tools: list[dict] | None) -> list[dict]:
        return tokenizer_calls(self.tokenizer, self.name, raw, tools)


def _pieces(tokenizer, markers: tuple[str, ...]) -> tuple[str, ...]:
    """The tokens a marker of several tokens is spelled with (Gemma 4's `<|channel>` of
    `<|channel>thought`, Kimi K3's `<|open|>` and `<|sep|>`): special tokens in the tokenizer, they
    must reach the text the splitter reads, as the whole marker does."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    found = []
    for marker in markers:
        if marker not in added:
            found += [t for t in added if t in marker and t not in found]
    return tuple(found)


def _reads_json(tokenizer) -> bool:
    """The parser reads a JSON {"name", "arguments"} object (the shape a forced call is generated in)."""
    try:
        parsed = tokenizer.tool_parser('{"name": "f", "arguments": {"a": 1}}', None)
    except Exception:  # another format's parser: it raises on JSON
        return False
    return isinstance(parsed, dict) and parsed.get("name") == "f" and parsed.get("arguments") in ({"a": 1}, '{"a": 1}')
