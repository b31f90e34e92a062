"""OpenAI's harmony format (gpt-oss-20b, gpt-oss-120b). A reply is a run of messages, each
`<|channel|>CHANNEL<|message|>TEXT<|end|>` after `<|start|>assistant` (the generation prompt
writes the first one's): the analysis channel is reasoning, the final channel the answer (the
turn ends at <|return|>), a commentary message addressed `to=functions.NAME` a call, its JSON
arguments ending the turn at <|call|> (the recipient may also stand before the channel, and
`<|constrain|>json` or `json` after it). A commentary message to no one is a preamble the spec
means for the user: answer text. <|return|> and <|call|> are end ids, whose text never reaches
the splitter: a call still open when the output ends is emitted then.

openai-harmony is not used: its encodings load the o200k vocabulary from the internet (or a
hash-checked copy of that file), and its parsers read o200k token ids, not the text seen here."""

from __future__ import annotations

import json
import logging

from edge0.formats.base import ChatFormat
from edge0.formats.markup import Reasoning, Segment, openai_call
from edge0.textstream import find_first, partial_suffix_len

log = logging.getLogger("edge0.server")

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
FUNCTIONS = "functions."  # the namespace the template declares the request's tools in
HEADER_LIMIT = 256  # longer text without <|message|> is no header: the model wrote without the format
REASONING, TEXT, CALLING = "reasoning", "text", "call"  # what an open message's body is


class HarmonyFormat(ChatFormat):
    """The harmony format (module docstring); its splitter reads the messages' headers."""

    name = "harmony"
    priority = 50
    families = "gpt-oss-20b, gpt-oss-120b (OpenAI's harmony format)"
    call_start = "to=" + FUNCTIONS  # a call is a message addressed to a function: no token of its own
    end_tokens = (RETURN, CALL)  # the spec's two stop tokens, whatever the store's config files list
    visible = MARKERS

    def __init__(self, tokenizer):  # detect's call: nothing of the tokenizer is needed
        pass

    @classmethod
    def matches(cls, template: str, vocab: dict) -> bool:
        return CHANNEL in template and MESSAGE in template and START in template

    def parse(self, raw: str, tools: list[dict] | None) -> list[dict]:
        """The calls of a whole reply `raw` (the text after the prompt's `<|start|>assistant`);
        raises when it holds none, or one that is malformed."""
        splitter = HarmonySplitter(self, calling=True)
        found = [*splitter.feed(raw), *splitter.finish()]
        calls = [p["function"] for p in found if isinstance(p, dict)]
        if not calls or splitter.malformed:
            raise ValueError(f"no well-formed harmony call in {raw[:80]!r}")
        return [{"name": c["name"], "arguments": c["arguments"]} for c in calls]

    def splitter(self, tools: list[dict] | None, opened: bool):
        return HarmonySplitter(self, calling=bool(tools))

    @property
    def reasons(self) -> bool:
        return True  # the analysis channel

    def render_tools(self, tools: list[dict] | None) -> list[dict] | None:
        """The published template writes `"// " + description` for every tool: a tool without one
        would fail the whole request."""
        return [_described(t) for t in tools] if tools else tools

    def render_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[dict]:
        """The template reads an assistant message's reasoning as `thinking`, renders a message's
        first call only and names each tool result after the call before it: one message per call,
        each followed by its result."""
        return super().render_messages([_thinking(m) for m in _one_call_each(messages)], tools)

    def describe(self) -> str:
        return f"chat format: {self.name} ({self.families}; reasoning in the analysis channel)"


class HarmonySplitter:
    """A reply's messages as Segments: reasoning and answer text as they are written, a call once
    its message ends (or the output does). Text that may be the start of a marker is held back."""

    def __init__(self, fmt: HarmonyFormat, calling: bool):
        self.fmt, self.calling = fmt, calling  # not calling (the request gave no tools): a call is text
        self.calls = 0
        self.malformed = 0  # calls returned as text
        self._buf = ""  # undecided text: a header, or the unsent end of a body
        self._kind: str | None = None  # the open message's body (None: reading a header)
        self._header = ""  # the open message's header, as written (after its <|start|>, if any)
        self._started = False  # the header being read follows a <|start|> of the output
        self._lead = False  # nothing of the open message sent yet
        self._wrote: set[str] = set()  # the kinds sent: a later message of one is set apart by a blank line
        self._done = False  # another author's message: the model ran past its turn

    @property
    def inside(self) -> bool:
        return self._kind == REASONING

    def feed(self, text: str) -> list[Segment]:
        out: list[Segment] = []
        self._buf += text
        while self._buf and not self._done and (self._body(out) if self._kind else self._head(out)):
            pass
        return out

    def finish(self) -> list[Segment]:
        """End of generation: an open message ends with it (a call is parsed); text written
        without the format's markup is answer text, an unfinished header is dropped."""
        out: list[Segment] = []
        rest, self._buf = self._buf, ""
        if self._done:
            return out
        if self._kind == CALLING:
            self._call(rest, out)
        elif self._kind:
            self._send(rest, out)
        elif _plain(rest):
            out.append(rest)
        self._kind = None
        return out

    def _head(self, out: list[Segment]) -> bool:
        """Read a header up to its <|message|>; True when something was decided."""
        hit = find_first(self._buf, (MESSAGE, START, END, CALL, RETURN))
        if hit is None:
            if len(self._buf) > HEADER_LIMIT and _plain(self._buf):
                self._open("", TEXT)
                return True
            return False
        i, marker = hit
        header, self._buf = self._buf[:i], self._buf[i + len(marker) :]
        if marker == MESSAGE:
            self._begin(header)
        elif _plain(header):  # a message's start or end with no header before it
            out.append(header)
        self._started = marker == START
        return True

    def _begin(self, header: str) -> None:
        author, channel, recipient = _read_header(header)
        header = (START if self._started else "") + header
        if author not in ("", "assistant"):  # a tool's result or the next user turn
            self._done, self._buf = True, ""
        elif recipient and recipient.startswith(FUNCTIONS):
            self._open(header, CALLING)
        elif recipient or channel == "analysis":  # a built-in tool's call (browser, python) is reasoning too
            self._open(header, REASONING)
        else:
            self._open(header, TEXT)

    def _open(self, header: str, kind: str) -> None:
        self._header, self._kind, self._lead = header, kind, True

    def _body(self, out: list[Segment]) -> bool:
        """Read the open message's body up to its end; True when the message ended."""
        hit = find_first(self._buf, MARKERS)
        if hit is None:
            if self._kind != CALLING:
                cut = len(self._buf) - partial_suffix_len(self._buf, MARKERS)
                self._send(self._buf[:cut], out)
                self._buf = self._buf[cut:]
            return False
        i, marker = hit
        body, rest = self._buf[:i], self._buf[i:]
        if marker in (MESSAGE, CONSTRAIN):  # header tokens have no place in a body: dropped
            self._buf = body + rest[len(marker) :]
            return True
        if self._kind == CALLING:
            self._call(body, out)
        else:
            self._send(body, out)
        self._kind = None
        # A <|start|> or a bare <|channel|> begins the next message's header.
        self._buf = rest if marker in (START, CHANNEL) else rest[len(marker) :]
        return True

    def _send(self, piece: str, out: list[Segment]) -> None:
        if not piece:
            return
        if self._lead and self._kind in self._wrote:
            piece = "\n\n" + piece
        self._lead = False
        self._wrote.add(self._kind)
        out.append(Reasoning(piece) if self._kind == REASONING else piece)

    def _call(self, arguments: str, out: list[Segment]) -> None:
        name = _read_header(self._header)[2][len(FUNCTIONS) :]
        try:
            if not self.calling:
                raise ValueError("the request gave no tools")
            if not name or any(c.isspace() for c in name):
                raise ValueError(f"not a function name: {name!r}")
            call = openai_call({"name": name, "arguments": json.loads(arguments)}, self.fmt)
        except ValueError as e:  # json.JSONDecodeError is one
            log.warning("could not parse a tool call (%s: %s); returning it as text", type(e).__name__, e)
            self.malformed += 1
            self._kind = TEXT
            self._send(self._header.lstrip() + MESSAGE + arguments, out)
            return
        self.calls += 1
        out.append(call)


def _read_header(header: str) -> tuple[str, str, str]:
    """(author, channel, recipient) of a header such as `assistant to=functions.f<|channel|>
    commentary json` or `<|channel|>commentary to=functions.f <|constrain|>json`; "" for what it
    does not name (the author of the first message is the generation prompt's)."""
    head, _, rest = header.partition(CHANNEL)
    before, after = head.split(), rest.replace(CONSTRAIN, " ").split()
    recipient = next((w[3:] for w in before + after if w.startswith("to=")), "")
    author = next((w for w in before if not w.startswith("to=")), "")
    channel = next((w for w in after if not w.startswith("to=")), "")
    return author, channel, recipient


def _plain(text: str) -> bool:
    """Text written without the format's markup (not the start of a header), not blank."""
    words = text.split()
    return bool(words) and not words[0].startswith("to=") and not any(m in text for m in MARKERS)


def _thinking(message: dict) -> dict:
    """An assistant message's reasoning as the template's `thinking`. The template renders a
    call's content or its thinking as its analysis, refusing both: the content joins the thinking."""
    reasoning = message.get("reasoning_content")
    if message.get("role") != "assistant" or not isinstance(reasoning, str) or not reasoning:
        return message
    message = dict(message, thinking=reasoning)
    if message.get("tool_calls") and message.get("content"):
        message["thinking"], message["content"] = reasoning + "\n\n" + message["content"], ""
    return message


def _one_call_each(messages: list[dict]) -> list[dict]:
    """An assistant message with several calls as one message per call, each followed by its
    result (by call id; a result with an id of none of them takes the next call without one)."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        i += 1
        calls = m.get("tool_calls") or []
        if m.get("role") != "assistant" or len(calls) < 2:
            out.append(m)
            continue
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        ids = {c.get("id") for c in calls}
        for n, call in enumerate(calls):
            out.append(
                dict(m, tool_calls=[call]) if n == 0 else {"role": "assistant", "content": "", "tool_calls": [call]}
            )
            mine = [r for r in results if r.get("tool_call_id") == call.get("id")]
            mine = mine or [r for r in results if r.get("tool_call_id") not in ids]
            if mine:
                results.remove(mine[0])
                out.append(mine[0])
        out += results
    return out


def _described(tool: dict) -> dict:
    fn = tool.get("function")
    if isinstance(fn, dict) and not isinstance(fn.get("description"), str):
        return {**tool, "function": {**fn, "description": ""}}
    return tool
