"""Tool calls: split the model's tool-call markup out of streamed text and parse it.

The format is the tokenizer's: mlx-lm's TokenizerWrapper names the markers (`tool_call_start`,
`tool_call_end`) and a parser for the text between them (`tool_parser(text, tools)`, returning
a dict or a list of dicts with "name" and "arguments"). This module never imports mlx-lm.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Iterator, Union

from edge0.textstream import partial_suffix_len

log = logging.getLogger("edge0.server")

Segment = Union[str, dict]  # content text, or a tool call in OpenAI's shape


class ToolCallSplitter:
    """Turns a stream of text deltas into content text and parsed tool calls.

    Text that may be the start of `tool_call_start` is held back; text inside a call is
    buffered until `tool_call_end` (or the end of generation, when the format has no end marker).
    """

    def __init__(self, tokenizer, tools: list[dict]):
        self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
        self.parser, self.tools = tokenizer.tool_parser, tools
        self.calls = 0
        self._buf, self._in_call = "", False

    def feed(self, text: str) -> Iterator[Segment]:
        """Add a delta; yields what is decided: content strings and tool-call dicts."""
        self._buf += text
        while True:
            if not self._in_call:
                i = self._buf.find(self.start)
                if i < 0:
                    cut = len(self._buf) - partial_suffix_len(self._buf, [self.start])
                    out, self._buf = self._buf[:cut], self._buf[cut:]
                    if out:
                        yield out
                    return
                if i:
                    yield self._buf[:i]
                self._buf, self._in_call = self._buf[i + len(self.start) :], True
            else:
                j = self._buf.find(self.end) if self.end else -1
                if j < 0:
                    return
                raw, self._buf, self._in_call = self._buf[:j], self._buf[j + len(self.end) :], False
                yield from self._parse(raw)

    def finish(self) -> Iterator[Segment]:
        """End of generation: an unterminated call is parsed as is, held text is released."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            yield from self._parse(rest)
        elif rest:
            yield rest

    def _parse(self, raw: str) -> Iterator[Segment]:
        try:
            parsed = self.parser(raw, self.tools)
            calls = [_openai_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        except Exception as e:  # parsers raise many types on malformed model output
            log.warning("could not parse a tool call (%s: %s); returning it as text", type(e).__name__, e)
            yield self.start + raw + self.end
            return
        self.calls += len(calls)
        yield from calls


def _openai_call(call: dict) -> dict:
    args = call["arguments"]
    # Every API carries arguments as a JSON object (Anthropic's tool_use input is one).
    if not isinstance(json.loads(args) if isinstance(args, str) else args, dict):
        raise ValueError("the arguments are not a JSON object")
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": call["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        },
    }
