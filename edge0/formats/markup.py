"""The markup most families share: a reasoning block between two markers at the start of the
output (`<think>` ... `</think>`), then answer text with tool calls between two markers (the end
marker may be empty: the call runs to the end of the output), each call parsed by the format.
Text that may be the start of a marker is held back until it is decided."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
from dataclasses import dataclass
from typing import Iterator, Union

from edge0.textstream import partial_suffix_len, split_at_first

log = logging.getLogger("edge0.server")


@dataclass(frozen=True)
class Reasoning:
    """A piece of the model's reasoning text (not part of the answer)."""

    text: str


Segment = Union[str, dict, Reasoning]  # answer text, a tool call (OpenAI's shape), reasoning


class ReasoningSplitter:
    """Turns streamed text into Reasoning pieces and answer text.

    A reasoning block is recognized at the start of the output (or the prompt opened one); the
    whitespace around its text and before the answer after it is dropped, as templates put
    newlines there (an answer without a block is left as it is).
    Text that may be the start of a marker is held back until it is decided.
    """

    def __init__(self, start: str, end: str, inside: bool):
        self.start, self.end = start, end
        self.inside = inside
        self._buf = ""
        self._began = inside  # a block was seen: later markers are answer text
        self._lead = inside  # at the start of reasoning or of the answer after it: drop whitespace

    def feed(self, text: str) -> Iterator[Union[Reasoning, str]]:
        self._buf += text
        while self._buf:
            if self.inside:
                i = self._buf.find(self.end)
                if i >= 0:
                    piece, self._buf = self._buf[:i].rstrip(), self._buf[i + len(self.end) :]
                    yield from self._emit(piece, Reasoning)
                    self.inside, self._lead = False, True
                    continue
                # Hold back a possible marker start and trailing whitespace (it may end the block).
                cut = len(self._buf[: len(self._buf) - partial_suffix_len(self._buf, [self.end])].rstrip())
                piece, self._buf = self._buf[:cut], self._buf[cut:]
                yield from self._emit(piece, Reasoning)
                return
            if not self._began:
                stripped = self._buf.lstrip()
                if stripped.startswith(self.start):
                    self._buf, self._began, self.inside, self._lead = stripped[len(self.start) :], True, True, True
                    continue
                if self.start.startswith(stripped):  # maybe the marker, not complete yet
                    return
                self._began = True
            piece, self._buf = self._buf, ""
            yield from self._emit(piece, str)

    def _emit(self, piece: str, kind) -> Iterator[Union[Reasoning, str]]:
        if self._lead:
            piece = piece.lstrip()
            self._lead = not piece
        if piece:
            yield Reasoning(piece) if kind is Reasoning else piece

    def finish(self) -> Iterator[Union[Reasoning, str]]:
        """End of generation: release held text (an unfinished block stays reasoning)."""
        rest, self._buf = self._buf, ""
        yield from self._emit(rest.rstrip() if self.inside else rest, Reasoning if self.inside else str)


class ToolCallSplitter:
    """Turns a stream of text deltas into content text and parsed tool calls.

    Text that may be the start of the format's call marker is held back; text inside a call is
    buffered until its end marker (or the end of generation, when the format has none).
    """

    def __init__(self, fmt, tools: list[dict] | None):
        self.fmt, self.start, self.end, self.tools = fmt, fmt.call_start, fmt.call_end, tools
        self.calls = 0
        self._buf, self._in_call = "", False

    def feed(self, text: str) -> Iterator[Segment]:
        """Add a delta; yields what is decided: content strings and tool-call dicts."""
        self._buf += text
        while True:
            if not self._in_call:
                out, marker, self._buf = split_at_first(self._buf, (self.start,))
                if out:
                    yield out
                if marker is None:
                    return
                self._in_call = True
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
        calls = parsed_calls(self.fmt, raw, self.tools)
        if calls is None:
            yield self.start + raw + self.end
            return
        self.calls += len(calls)
        yield from calls


class Dropper:
    """Leaves a format's structural markers out of the answer text (Kimi K3's
    `<|open|>response<|sep|>` ... `<|close|>response<|sep|>`, as mlx-lm's text state machine does);
    text that may be the start of one is held back until it is decided."""

    def __init__(self, markers: tuple[str, ...]):
        self.markers, self._buf = markers, ""

    def feed(self, text: str) -> str:
        self._buf += text
        for marker in self.markers:
            self._buf = self._buf.replace(marker, "")
        cut = len(self._buf) - partial_suffix_len(self._buf, self.markers)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out

    def finish(self) -> str:
        rest, self._buf = self._buf, ""
        return rest


class MarkupSplitter:
    """A reply's text through the format's reasoning splitter (when it has markers), its
    structural markers dropped (when it has any), then its tool-call splitter (when the request
    gave tools): Segments as they are decided."""

    def __init__(self, fmt, tools: list[dict] | None, opened: bool):
        self.thinking = ReasoningSplitter(*fmt.think, opened) if fmt.think else None
        self.dropper = Dropper(fmt.drop) if getattr(fmt, "drop", ()) else None
        self.tools = ToolCallSplitter(fmt, tools) if tools and fmt.calls else None

    @property
    def calls(self) -> int:
        return self.tools.calls if self.tools else 0

    @property
    def inside(self) -> bool:
        """Inside a reasoning block (its tokens count as reasoning tokens)."""
        return bool(self.thinking and self.thinking.inside)

    def feed(self, text: str) -> list[Segment]:
        return self._calls(self.thinking.feed(text) if self.thinking else (text,))

    def finish(self) -> list[Segment]:
        out = self._calls(self.thinking.finish()) if self.thinking else []
        if self.dropper:
            rest, self.dropper = self.dropper.finish(), None
            out += self._calls([rest] if rest else [])
        return out + (list(self.tools.finish()) if self.tools else [])

    def _calls(self, parts) -> list[Segment]:
        out = []
        for part in parts:
            if not isinstance(part, Reasoning) and self.dropper:
                part = self.dropper.feed(part)
                if not part:
                    continue
            if isinstance(part, Reasoning) or not self.tools:
                out.append(part)
            else:
                out += self.tools.feed(part)
        return out


class StepSplitter:
    """A splitter run as a state machine over its buffer: `_step(out)` decides what the buffer's
    start is, appends the Segments that decides and returns True while something changed."""

    inside = False  # no reasoning markup
    _buf = ""

    def feed(self, text: str) -> list[Segment]:
        out: list[Segment] = []
        self._steps(text, out)
        return out

    def _steps(self, text: str, out: list[Segment]) -> None:
        """Add `text` to the buffer and step until nothing more can be decided."""
        self._buf += text
        while self._step(out):
            pass

    def _step(self, out: list[Segment]) -> bool:
        raise NotImplementedError


def parsed_calls(fmt, raw: str, tools: list[dict] | None) -> list[dict] | None:
    """The calls `fmt` reads in `raw`, in OpenAI's shape; None (with a warning) where the model's
    text does not parse as calls, for the splitter to return as text."""
    try:
        return [openai_call(c, fmt) for c in fmt.parse(raw, tools)]
    except Exception as e:  # parsers raise many types on malformed model output
        log.warning("could not parse a tool call (%s: %s); returning it as text", type(e).__name__, e)
        return None


def tokenizer_calls(tokenizer, parser_name: str, raw: str, tools: list[dict] | None) -> list[dict]:
    """The calls the tokenizer's own tool parser (mlx-lm's `parser_name` module) reads in `raw`."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None:
        raise ValueError(f"the tokenizer has no {parser_name} tool parser")
    parsed = parser(raw, tools)
    return parsed if isinstance(parsed, list) else [parsed]


def openai_call(call: dict, fmt) -> dict:
    """A parsed call in OpenAI's shape, with the model's own id or a new one in the format's shape."""
    args = call["arguments"]
    # Every API carries arguments as a JSON object (Anthropic's tool_use input is one).
    if not isinstance(json.loads(args) if isinstance(args, str) else args, dict):
        raise ValueError("the arguments are not a JSON object")
    given = call.get("id")
    return {
        "id": given if isinstance(given, str) and given else fmt.call_id(),
        "type": "function",
        "function": {
            "name": call["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        },
    }


class ShortIds:
    """Call ids of a fixed shape a template demands (Mistral: 9 letters and digits; Solar Open: 10
    lowercase letters and digits): new ones at random, and any other id a client sends back
    mapped to that shape the same way every time, on a call and on its result alike."""

    def __init__(self, alphabet: str, length: int):
        self.alphabet, self.length = alphabet, length
        self.shape = re.compile(f"[{re.escape(alphabet)}]{{{length}}}")

    def new(self) -> str:
        return "".join(secrets.choice(self.alphabet) for _ in range(self.length))

    def of(self, call_id: str) -> str:
        own = call_id.removeprefix("toolu_")  # the Messages API's id of a call the model made
        if self.shape.fullmatch(own):
            return own
        n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        out = ""
        for _ in range(self.length):
            n, d = divmod(n, len(self.alphabet))
            out += self.alphabet[d]
        return out
