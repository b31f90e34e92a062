"""DeepSeek's chat formats. V3, V3.1 and R1 write tool calls in tokens of their own:
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`
(V3-0324 and R1: `function<｜tool▁sep｜>NAME` and the JSON in a ```json fence). V3.2 writes DSML,
plain text: `<｜DSML｜function_calls>` holding `<｜DSML｜invoke name="NAME">` blocks of
`<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>` (V4 names the block
`<｜DSML｜tool_calls>`). Both reason in `<think>...</think>` (the generation prompt opens the block
in thinking mode) and end the turn at <｜end▁of▁sentence｜>, the tokenizer's eos. Each call is
emitted once its own end marker is in, not when the whole block of calls ends."""

from __future__ import annotations

import json
import re

from edge0.formats.base import ChatFormat
from edge0.formats.markup import Reasoning, ReasoningSplitter, Segment, parsed_calls
from edge0.textstream import split_at_first

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DSML = "｜DSML｜"
INVOKE_BEGIN, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"

_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)(?:" + re.escape(CALL_END) + r"|\Z)", re.S)
_FENCED = re.compile(r"\s*([^\s`]+)\s*\n```(?:json)?[ \t]*\n(.*?)\n?```\s*\Z", re.S)
_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]+)"\s*>(.*?)(?:</{DSML}invoke>|\Z)', re.S)
_PARAM = re.compile(rf'<{DSML}parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>(.*?)</{DSML}parameter>', re.S)


class DeepSeekFormat(ChatFormat):
    """DeepSeek's tool tokens (V3, V3.1, R1); a tokenizer whose template writes DSML, or that has
    no template (mlx-lm renders V3.2 with its own encoder, `chat_template_type`), gets DSML."""

    name = "deepseek_v31"
    priority = 50
    families = "DeepSeek-V3, V3.1, R1 (tool-call tokens)"
    think = ("<think>", "</think>")
    call_start, call_end = CALLS_BEGIN, CALLS_END
    visible = (CALL_BEGIN, SEP, CALL_END)
    arguments_as_text = True  # the template concatenates a call's arguments as given
    blocks: tuple[tuple[str, str], ...] = ((CALLS_BEGIN, CALLS_END),)  # a block of calls: its markers
    call_markers = (CALL_BEGIN, CALL_END)  # one call in a block

    @classmethod
    def matches(cls, template: str, vocab: dict) -> bool:
        if CALLS_BEGIN in template or DSML in template:
            return True
        # No template: only mlx-lm's DeepSeek-V3.2 encoder can render chat for this vocabulary.
        return not template.strip() and CALLS_BEGIN in vocab and "<｜Assistant｜>" in vocab

    def __new__(cls, tokenizer):
        if cls is DeepSeekFormat and _writes_dsml(tokenizer):
            cls = DeepSeekDsmlFormat
        return super().__new__(cls)

    def __init__(self, tokenizer):
        # the published V3.1 template renders no tools: the model card's block goes in its system message
        self.renders_tools = "tools" in _template(tokenizer)

    def parse(self, raw: str, tools: list[dict] | None) -> list[dict]:
        """Calls `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>` (or V3's
        `function<｜tool▁sep｜>NAME` and a fenced JSON), whitespace between them; the last call's
        end marker may be missing (the output ended)."""
        return [_tool_token_call(body) for body in _spans(_CALL, raw, "tool call")]

    def splitter(self, tools: list[dict] | None, opened: bool):
        return BlockSplitter(self, tools, opened)

    def render_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[dict]:
        # The template renders `tool_calls: []` as a block without calls (and drops the content).
        messages = [_without_empty_calls(m) for m in messages]
        if tools and not self.renders_tools:  # the published V3.1 template lists no tools: the model card's block
            messages = _with_tools_block(messages, tools)
        return super().render_messages(messages, tools)


class DeepSeekDsmlFormat(DeepSeekFormat):
    """DeepSeek-V3.2's DSML calls (module docstring)."""

    name = "deepseek_v32"
    families = "DeepSeek-V3.2 (DSML tool calls)"
    call_start, call_end = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
    visible = ()
    blocks = ((call_start, call_end), (f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"))
    call_markers = (INVOKE_BEGIN, INVOKE_END)

    def __init__(self, tokenizer):
        # mlx-lm's encoder (no jinja template) json.loads a call's arguments; a jinja DSML
        # template iterates them as a mapping.
        self.arguments_as_text = DSML not in _template(tokenizer)

    def parse(self, raw: str, tools: list[dict] | None) -> list[dict]:
        """`<｜DSML｜invoke name="NAME">` blocks of parameters, whitespace between them: a
        string="true" value is the text as written, any other is JSON (kept as text when it is not)."""
        return [_dsml_call(name, body) for name, body in _spans(_INVOKE, raw, "DSML invoke")]

    def render_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[dict]:
        # DeepSeek's encoder renders the tools on the system message only: without one the
        # model would never see them.
        if not messages or messages[0].get("role") not in ("system", "developer"):
            messages = [{"role": "system", "content": ""}, *messages]
        return ChatFormat.render_messages(self, messages, tools)


def _template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else ""


def _writes_dsml(tokenizer) -> bool:
    """The tokenizer renders DeepSeek-V3.2's DSML: mlx-lm's encoder (`chat_template_type`, which
    replaces any template) or a jinja template writing DSML, or no template at all."""
    kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    template = _template(tokenizer)
    return kwargs.get("chat_template_type") == "deepseek_v32" or DSML in template or not template.strip()


def _without_empty_calls(message: dict) -> dict:
    if "tool_calls" in message and not message["tool_calls"]:
        message = {k: v for k, v in message.items() if k != "tool_calls"}
    return message


def _spans(pattern: re.Pattern, raw: str, what: str) -> list[tuple]:
    """Every match of `pattern` in `raw`, in order; anything but whitespace between them raises."""
    found, pos = [], 0
    while raw[pos:].strip():
        pos += len(raw[pos:]) - len(raw[pos:].lstrip())
        m = pattern.match(raw, pos)
        if not m:
            raise ValueError(f"not a {what}: {raw[pos : pos + 80]!r}")
        found.append(m.group(1) if pattern.groups == 1 else m.groups())
        pos = m.end()
    if not found:
        raise ValueError(f"no {what} in {raw[:80]!r}")
    return found


def _tool_token_call(body: str) -> dict:
    head, sep, tail = body.partition(SEP)
    if not sep:
        raise ValueError(f"no {SEP} in the call {body[:80]!r}")
    fenced = _FENCED.match(tail) if head.strip() == "function" else None
    name, args = (fenced.group(1), fenced.group(2)) if fenced else (head.strip(), tail)
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"not a function name: {name!r}")
    arguments = json.loads(args)
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments are not a JSON object: {args[:80]!r}")
    return {"name": name, "arguments": arguments}


def _dsml_call(name: str, body: str) -> dict:
    args = {}
    for key, string, value in _spans(_PARAM, body, "DSML parameter") if body.strip() else ():
        args[key] = value if string == "true" else _json_or_text(value)
    return {"name": name, "arguments": args}


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


class BlockSplitter:
    """A reply's Segments: the reasoning block first, then answer text with blocks of calls; each
    call is parsed once its own end marker is in (a call the model writes outside a block too),
    whitespace between the calls of a block dropped. Text that may be the start of a marker is
    held back until it is decided; a call that does not parse comes back as its text."""

    def __init__(self, fmt: DeepSeekFormat, tools: list[dict] | None, opened: bool):
        self.fmt, self.tools = fmt, tools
        self.thinking = ReasoningSplitter(*fmt.think, opened)
        self.calls = 0
        self._buf = ""
        self._block_end: str | None = None  # inside a block of calls: its end marker
        self._in_call = False

    @property
    def inside(self) -> bool:
        """Inside the reasoning block (its tokens count as reasoning tokens)."""
        return self.thinking.inside

    def feed(self, text: str) -> list[Segment]:
        return self._answer(self.thinking.feed(text))

    def finish(self) -> list[Segment]:
        out = self._answer(self.thinking.finish())
        return out + self._finish() if self.tools else out

    def _answer(self, parts) -> list[Segment]:
        out: list[Segment] = []
        for part in parts:
            if isinstance(part, Reasoning) or not self.tools:
                out.append(part)
            else:
                self._buf += part
                out += self._split()
        return out

    def _split(self) -> list[Segment]:
        out: list[Segment] = []
        start, end = self.fmt.call_markers
        while self._buf:
            if self._in_call:
                j = self._buf.find(end)
                if j < 0:
                    break
                raw, self._buf, self._in_call = start + self._buf[:j] + end, self._buf[j + len(end) :], False
                out += self._parse(raw)
                continue
            outside = self._block_end is None
            markers = [*(b for b, _ in self.fmt.blocks), start] if outside else [start, self._block_end]
            text, marker, self._buf = split_at_first(self._buf, markers)
            if text and (outside or text.strip()):
                out.append(text)
            if marker is None:
                break
            if marker == start:
                self._in_call = True
            elif outside:
                self._block_end = dict(self.fmt.blocks)[marker]
            else:
                self._block_end = None
        return out

    def _finish(self) -> list[Segment]:
        """End of generation: an unterminated call is parsed as it is, held text is released."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return self._parse(self.fmt.call_markers[0] + rest)
        return [rest] if rest and (self._block_end is None or rest.strip()) else []

    def _parse(self, raw: str) -> list[Segment]:
        calls = parsed_calls(self.fmt, raw, self.tools)
        if calls is None:
            return [raw]
        self.calls += len(calls)
        return calls


def _with_tools_block(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` with the tools listed in the system message as DeepSeek-V3.1's model card asks:
    each tool's name, description and parameter schema, then the call format."""
    lines = ["## Tools", "You have access to the following tools:"]
    for tool in tools:
        fn = tool.get("function", tool)
        lines += [
            f"\n### {fn.get('name', '')}",
            f"Description: {fn.get('description') or ''}",
            f"\nParameters: {json.dumps(fn.get('parameters') or {}, ensure_ascii=False)}",
        ]
    lines += [
        "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:",
        f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}{{additional_tool_calls}}{CALLS_END}",
        "\nWhere:\n- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces",
    ]
    block = "\n".join(lines)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        content = first.get("content") or ""
        return [{**first, "content": f"{content}\n\n{block}" if content else block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]
