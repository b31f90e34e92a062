"""Solar Open (upstage/Solar-Open-100B; mlx-lm's solar_open module). The generation prompt ends
with `<|begin|>assistant`; a reply is one or more messages, each after `<|begin|>assistant`, the
first one's header being the prompt's:

    <|think|>REASONING<|end|><|begin|>assistant<|content|>ANSWER<|flush|>
    <|think|>REASONING<|end|><|begin|>assistant<|tool_calls|>CALLS<|calls|>
    <|content|>ANSWER<|flush|>        (no reasoning: reasoning_effort "low" or "minimal" puts an
    <|tool_calls|>CALLS<|calls|>       empty <|begin|>assistant<|think|><|end|> in the prompt)

with each call `<|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{JSON}<|tool_call:end|>`,
the id 10 lowercase letters and digits. <|flush|> and <|calls|> end the turn (with <|endoftext|>,
generation_config.json's eos_token_id [2, 24, 25]); <|end|> only ends a message (another role's
`<|begin|>ROLE` after it is past the turn: dropped). Every marker is a token of its own that is
not special (the tokenizer's decode keeps it).

Where each fact comes from:
- the reply's messages, their markers, <|flush|> and <|calls|> as end tokens, the markers not
  being special: the solar_open reasoning parser proposed to vLLM (oesni/vllm
  vllm/reasoning/solar_open_reasoning_parser.py, its docstring) and a vLLM logits processor for
  the model (SolarOpenTemplateEnforcer, its "Response format specs": think, tool, tool-with-think
  and no-think modes, token ids 20-25 and 30-34; repository not named in the code index);
- a reasoning block also ending at <|content|> or <|tool_calls|>: Upstage's reasoning parser
  (UpstageAI/vllm vllm/reasoning/solar_open_reasoning_parser.py, `_parse_reasoning_prefix`);
- the call's markup and ids: Upstage's vLLM fork (UpstageAI/vllm
  vllm/tool_parsers/solar_open_tool_parser.py, `ToolCallID`: 10 characters of [a-z0-9]), the tests
  of the parser proposed to vLLM (oesni/vllm tests/tool_parsers/test_solar_open_tool_parser.py:
  `^[a-z0-9]{10}$`, an id of another shape is replaced, a duplicate id made unique, arguments also
  read as a Python literal, a content message before the calls), the template rendering
  `<|tool_call:begin|>a1b2c3d4e5<|tool_call:name|>my_tool` for a call in the history (a Dart
  package's test of the published template);
- the end ids [2, 24, 25] (<|endoftext|>, <|flush|>, <|calls|>; <|end|> = 21 is not one): a
  Tenstorrent port's test against the checkpoint's generation_config.json (changh95/tt-metal
  models/demos/solar_open/tests/unit/test_model_config.py); config.json's eos_token_id 2 and
  bos_token_id 1: that port's copy of config.json;
- detection: llama.cpp's (common/chat.cpp) and a Dart port's, on the template's
  <|tool_response:begin|>, <|tool_response:name|> and <|tool_response:result|>; the template also
  writes <|tool_call:begin|> (above). The published template's text itself was not found (llama.cpp's
  copy, models/templates/upstage-Solar-Open-100B.jinja, is stored as a Git LFS pointer here).
Solar Open2 writes `<|tool_call:start|>` calls with `<|tool_arg:...|>` arguments: not this format."""

from __future__ import annotations

import ast
import json
import string

from edge0.formats.base import ChatFormat
from edge0.formats.markup import Reasoning, ReasoningSplitter, Segment, ShortIds, StepSplitter, parsed_calls
from edge0.textstream import split_at_first

BEGIN, END, THINK, CONTENT = "<|begin|>", "<|end|>", "<|think|>", "<|content|>"
FLUSH, CALLS = "<|flush|>", "<|calls|>"  # the turn's end after an answer, after calls
TOOL_CALLS = "<|tool_calls|>"
CALL_BEGIN, CALL_NAME, CALL_ARGS, CALL_END = (
    "<|tool_call:begin|>",
    "<|tool_call:name|>",
    "<|tool_call:args|>",
    "<|tool_call:end|>",
)
TOOL_RESPONSE = ("<|tool_response:begin|>", "<|tool_response:name|>", "<|tool_response:result|>")
HEADER = BEGIN + "assistant"  # a message's start within the reply
BODY = (CONTENT, TOOL_CALLS)  # an answer's or a call section's start
ID_CHARS = string.ascii_lowercase + string.digits
IDS = ShortIds(ID_CHARS, 10)
HEAD, TEXT, SECTION, CALL, DONE = "head", "text", "section", "call", "done"  # the splitter's modes


class SolarOpenFormat(ChatFormat):
    """Solar Open's messages and calls (module docstring); each call is emitted at its own
    <|tool_call:end|>, with the model's id when it has the template's shape."""

    name = "solar_open"
    priority = 50
    families = "Solar-Open-100B"
    think = (THINK, END)
    call_start, call_end = CALL_BEGIN, CALL_END
    visible = (BEGIN, CONTENT, TOOL_CALLS, CALL_NAME, CALL_ARGS, FLUSH, CALLS)

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.end_tokens = tuple(t for t in (FLUSH, CALLS) if t in vocab)

    @classmethod
    def matches(cls, template: str, vocab: dict) -> bool:
        return all(m in template for m in TOOL_RESPONSE) and CALL_BEGIN in template

    def parse(self, raw: str, tools: list[dict] | None) -> list[dict]:
        """One call, `ID<|tool_call:name|>NAME<|tool_call:args|>ARGS` (the text between its
        markers): ARGS a JSON object, or a Python literal one as Upstage's parser reads it."""
        head, sep, args = raw.partition(CALL_ARGS)
        call_id, named, name = head.partition(CALL_NAME)
        name = name.strip()
        if not sep or not named or not name or any(c.isspace() for c in name):
            raise ValueError(f"not an ID{CALL_NAME}NAME{CALL_ARGS}ARGS call: {raw[:80]!r}")
        call = {"name": name, "arguments": _arguments(args)}
        if IDS.shape.fullmatch(call_id.strip()):
            call["id"] = call_id.strip()
        return [call]

    def splitter(self, tools: list[dict] | None, opened: bool):
        return SolarOpenSplitter(self, tools, opened)

    def call_id(self) -> str:
        return IDS.new()

    def history_id(self, call_id: str) -> str:
        return IDS.of(call_id)


def _arguments(text: str) -> dict:
    text = text.strip()
    try:
        value = json.loads(text)
    except ValueError:
        value = ast.literal_eval(text)  # Upstage's parser reads Python literals too
    if not isinstance(value, dict):
        raise ValueError(f"the arguments are not an object: {text[:80]!r}")
    return value


class SolarOpenSplitter(StepSplitter):
    """A reply's Segments: the reasoning block first (ReasoningSplitter; <|content|> or
    <|tool_calls|> also ends one left open), then its messages: an answer after <|content|>, calls
    in a <|tool_calls|> section (with tools), each call parsed once its <|tool_call:end|> is in.
    <|end|><|begin|>assistant between messages is dropped; text with no message marker is answer
    text. A call that does not parse comes back as its text; an id the reply already used is
    replaced. Text that may be the start of a marker is held back."""

    def __init__(self, fmt: SolarOpenFormat, tools: list[dict] | None, opened: bool):
        self.fmt, self.tools = fmt, tools
        self.thinking = ReasoningSplitter(THINK, END, opened)
        self.calls = 0
        self._pending = ""  # not yet through the reasoning splitter: maybe a body marker
        self._buf = ""
        self._mode = HEAD
        self._ids: set[str] = set()

    @property
    def inside(self) -> bool:
        """Inside the reasoning block (its tokens count as reasoning tokens)."""
        return self.thinking.inside

    def feed(self, text: str) -> list[Segment]:
        """A body marker also ends a reasoning block left open (Upstage's parser ends it there)."""
        self._pending += text
        out: list[Segment] = []
        while True:
            before, marker, self._pending = split_at_first(self._pending, BODY)
            out += self._reasoned(before)
            if marker is None:
                return out
            if self.thinking.inside:
                out += self._reasoned(END)
            out += self._reasoned(marker)

    def _reasoned(self, text: str) -> list[Segment]:
        return self._answer(self.thinking.feed(text)) if text else []

    def finish(self) -> list[Segment]:
        rest, self._pending = self._pending, ""
        out = self._reasoned(rest) + self._answer(self.thinking.finish())
        rest, self._buf = self._buf, ""
        if self._mode == TEXT and rest:
            out.append(rest)
        elif self._mode == CALL:
            out += self._call(rest)
        elif self._mode in (HEAD, SECTION) and rest.strip():
            out.append(rest)  # part of a marker, never completed
        self._mode = DONE
        return out

    def _answer(self, parts) -> list[Segment]:
        out: list[Segment] = []
        for part in parts:
            if isinstance(part, Reasoning):
                out.append(part)
            else:
                self._steps(part, out)
        return out

    def _step(self, out: list[Segment]) -> bool:
        """Decide what the buffer's start is; True when something was consumed."""
        if self._mode == HEAD:
            return self._head()
        if self._mode == TEXT:
            return self._text(out)
        if self._mode == SECTION:
            return self._section(out)
        if self._mode == CALL:
            j = self._buf.find(CALL_END)
            if j < 0:
                return False
            raw, self._buf, self._mode = self._buf[:j], self._buf[j + len(CALL_END) :], SECTION
            out += self._call(raw)
            return True
        self._buf = ""  # DONE: past the turn's end
        return False

    def _head(self) -> bool:
        """A message's start: its header, then <|content|> or <|tool_calls|>."""
        stripped = self._buf.lstrip()
        heads = [HEADER, END, CONTENT, TOOL_CALLS] + ([CALL_BEGIN] if self.tools else [])
        for head in heads:
            if stripped.startswith(head):
                self._buf = stripped if head == CALL_BEGIN else stripped[len(head) :]
                if head == CONTENT or (head == TOOL_CALLS and not self.tools):
                    self._mode = TEXT
                    if head == TOOL_CALLS:
                        self._buf = head + self._buf  # without tools, a call is text as it is
                elif head in (TOOL_CALLS, CALL_BEGIN):
                    self._mode = SECTION
                return True
        if not stripped or any(h.startswith(stripped) for h in heads):
            return False  # maybe a marker, not complete yet
        if stripped.startswith(BEGIN):  # another role's message: past the turn's end
            self._buf, self._mode = "", DONE
            return True
        self._mode = TEXT  # text with no message marker
        self._buf = stripped
        return True

    def _text(self, out: list[Segment]) -> bool:
        markers = [END, FLUSH, CALLS] + ([TOOL_CALLS, CALL_BEGIN] if self.tools else [])
        text, marker, self._buf = split_at_first(self._buf, markers)
        if text:
            out.append(text)
        if marker is None:
            return False
        if marker == CALL_BEGIN:  # a call with no section marker: the section reads it, marker and all
            self._buf = marker + self._buf
        self._mode = {END: HEAD, TOOL_CALLS: SECTION, CALL_BEGIN: SECTION}.get(marker, DONE)
        return True

    def _section(self, out: list[Segment]) -> bool:
        """Inside <|tool_calls|>: calls, whitespace between them, the section's end."""
        stripped = self._buf.lstrip()
        for marker, mode in ((CALL_BEGIN, CALL), (END, HEAD), (CALLS, DONE), (FLUSH, DONE)):
            if stripped.startswith(marker):
                self._buf, self._mode = stripped[len(marker) :], mode
                return True
        if not stripped or any(m.startswith(stripped) for m in (CALL_BEGIN, END, CALLS, FLUSH)):
            return False
        self._buf, self._mode = stripped, TEXT  # text in the section: answer text
        return True

    def _call(self, raw: str) -> list[Segment]:
        calls = parsed_calls(self.fmt, raw, self.tools)
        if calls is None:
            return [CALL_BEGIN + raw + CALL_END]
        for call in calls:
            while call["id"] in self._ids:  # greedy sampling can repeat the model's "random" id
                call["id"] = self.fmt.call_id()
            self._ids.add(call["id"])
        self.calls += len(calls)
        return calls
