"""Llama 4 (Scout-17B-16E-Instruct, Maverick-17B-128E-Instruct): header turns
`<|header_start|>ROLE<|header_end|>\\n\\n...<|eot|>`, tool results in the `ipython` role. The
published template asks for a call as JSON, `{"name": ..., "parameters": {...}}`, with no marker
before it, and renders a call in the history as `<|python_start|>CONTENT<|python_end|>` then the
JSON; vLLM's llama4_pythonic template has the model write `[get_weather(city="Paris")]` instead.

A call is read in three places: a reply that opens with a JSON object or a list (the bare shape:
JSON calls, a JSON list of them, or a pythonic list), anything between `<|python_start|>` and
`<|python_end|>`, and what follows such a block or a call. Text elsewhere is answer text: a call
after answer text needs the python markers. A bare JSON object or list is held back until it
closes; when it is not a call (or names none of the request's tools) it is released as text. The
turn ends at <|eot|> or <|eom|> (the checkpoints' generation_config.json lists both with
<|end_of_text|>)."""

from __future__ import annotations

import ast
import json
import logging

from edge0.formats.base import ChatFormat
from edge0.formats.markup import Segment, StepSplitter, openai_call
from edge0.textstream import partial_suffix_len

log = logging.getLogger("edge0.server")

HEADER_START, EOT, EOM = "<|header_start|>", "<|eot|>", "<|eom|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
OPENERS = "{["
CLOSERS = {"{": "}", "[": "]", "(": ")"}
LEAD, TEXT, BLOCK, BARE = "lead", "text", "block", "bare"  # the splitter's modes


class Llama4Format(ChatFormat):
    """Llama 4's JSON and pythonic calls (module docstring). A forced call is generated between
    the python markers, as `{"name": ..., "arguments": ...}`, which the parser reads too."""

    name = "llama4"
    priority = 50
    families = "Llama-4-Scout-17B-16E-Instruct, Llama-4-Maverick-17B-128E-Instruct"
    call_start, call_end = PYTHON_START, PYTHON_END
    end_tokens = (EOT, EOM)
    json_calls = True

    def __init__(self, tokenizer):  # detect's call: nothing of the tokenizer is needed
        pass

    @classmethod
    def matches(cls, template: str, vocab: dict) -> bool:
        return HEADER_START in template and EOT in template

    def parse(self, raw: str, tools: list[dict] | None) -> list[dict]:
        """The calls in `raw`: JSON call objects (one, several, or a list) or a pythonic list."""
        text = raw.strip()
        if text.startswith(("{", "[")):
            try:
                return _json_calls(text)
            except ValueError:
                if text.startswith("{"):
                    raise
        return _pythonic_calls(text)

    def splitter(self, tools: list[dict] | None, opened: bool):
        return Llama4Splitter(self, tools)


class Llama4Splitter(StepSplitter):
    """A reply's text and calls as Segments, each call emitted once it is complete (its JSON or
    list closes, or its block ends). Without tools the reply is text as it is."""

    def __init__(self, fmt: Llama4Format, tools: list[dict] | None):
        self.fmt, self.tools = fmt, tools
        self.names = {_tool_name(t) for t in tools or []} - {None}
        self.calls = 0
        self._buf = ""
        self._mode = LEAD if tools else TEXT
        self._ws = ""  # whitespace before a bare candidate, given back if it is text
        self._first = True  # nothing decided yet: leading text keeps its whitespace

    def finish(self) -> list[Segment]:
        """End of generation: an open block or bare candidate is parsed as it is, held text released."""
        out: list[Segment] = []
        rest, self._buf = self._buf, ""
        if self._mode == BLOCK:
            self._block(rest, out)
        elif self._mode == BARE:
            self._bare(rest, out)
        elif self._mode == TEXT or rest.strip():
            self._send(rest, out)
        self._mode = TEXT
        return out

    def _step(self, out: list[Segment]) -> bool:
        """Decide what the buffer's start is; True when something was consumed."""
        if self._mode == LEAD:
            return self._lead()
        if self._mode == TEXT:
            return self._text(out)
        if self._mode == BLOCK:
            j = self._buf.find(PYTHON_END)
            if j < 0:
                return False
            raw, self._buf = self._buf[:j], self._buf[j + len(PYTHON_END) :]
            self._block(raw, out)
            return True
        end = _closed(self._buf)
        if end is None:
            return False
        raw, self._buf = self._buf[:end], self._buf[end:]
        self._bare(raw, out)
        return True

    def _lead(self) -> bool:
        """At a call position (the reply's start, after a call or a block): whitespace (and a `;`
        between calls) is held; `{` or `[` opens a bare candidate, anything else is text."""
        stripped = self._buf.lstrip() if self._first else self._buf.lstrip(" \t\r\n;")
        if not stripped or PYTHON_START.startswith(stripped):
            return False  # only whitespace yet, or maybe the python marker
        self._ws, self._buf = self._buf[: len(self._buf) - len(stripped)], stripped
        self._mode = BARE if stripped[0] in OPENERS else TEXT
        return True

    def _text(self, out: list[Segment]) -> bool:
        i = self._buf.find(PYTHON_START) if self.tools else -1
        if i < 0:
            cut = len(self._buf) - (partial_suffix_len(self._buf, [PYTHON_START]) if self.tools else 0)
            self._send(self._buf[:cut], out)
            self._buf = self._buf[cut:]
            return False
        self._send(self._buf[:i], out)
        self._buf, self._mode = self._buf[i + len(PYTHON_START) :], BLOCK
        return True

    def _send(self, text: str, out: list[Segment]) -> None:
        if self._first:
            text, self._ws = self._ws + text, ""
        if text:
            out.append(text)
            self._first = False

    def _block(self, raw: str, out: list[Segment]) -> None:
        """A python block: its calls, else its text (the published template puts a message's text
        there, before the calls). A call may follow it either way."""
        self._mode = LEAD
        if not raw.strip():
            return
        calls = self._calls(raw, bare=False)
        if calls is None:
            self._send(raw, out)
        else:
            out += calls

    def _bare(self, raw: str, out: list[Segment]) -> None:
        """A JSON object or list at a call position: calls, else text."""
        calls = self._calls(raw, bare=True)
        if calls is None:
            self._mode = TEXT
            self._send((self._ws if not self._first else "") + raw, out)
            return
        self._mode, self._ws, self._first = LEAD, "", False
        out += calls

    def _calls(self, raw: str, bare: bool) -> list[dict] | None:
        try:
            calls = self.fmt.parse(raw, self.tools)
            if bare and self.names and any(c["name"] not in self.names for c in calls):
                raise ValueError("it names none of the request's tools")
            found = [openai_call(c, self.fmt) for c in calls]
        except (ValueError, SyntaxError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
            if not bare:
                log.warning("could not parse a tool call (%s: %s); returning it as text", type(e).__name__, e)
            return None
        self.calls += len(found)
        self._first = False
        return found


def _closed(text: str) -> int | None:
    """The length of the bracketed value `text` opens, once it is closed (strings, JSON's and
    Python's, skipped), else None."""
    stack: list[str] = []
    quote = ""
    escaped = False
    for i, c in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in CLOSERS:
            stack.append(CLOSERS[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        elif c in ")]}":
            return i + 1  # unbalanced: decided (not a call)
    return None


def _json_calls(text: str) -> list[dict]:
    """JSON call objects, one after another (a `;` or whitespace between them), or one JSON list of them."""
    decoder = json.JSONDecoder()
    found: list = []
    i = 0
    while i < len(text):
        value, i = decoder.raw_decode(text, i)
        found += value if isinstance(value, list) else [value]
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
    if not found:
        raise ValueError("no call")
    return [_json_call(v) for v in found]


def _json_call(value) -> dict:
    """{"name", "parameters"} as the published template asks, or {"name", "arguments"}."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        raise ValueError(f"not a call: {str(value)[:80]!r}")
    args = value.get("parameters", value.get("arguments", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError("the arguments are not a JSON object")
    return {"name": value["name"], "arguments": args}


class _JSONLiterals(ast.NodeTransformer):
    """Models write true/false/null in pythonic calls too."""

    VALUES = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id in self.VALUES:
            return ast.copy_location(ast.Constant(self.VALUES[node.id]), node)
        return node


def _pythonic_calls(text: str) -> list[dict]:
    """`[f(a="x", b=1), g()]`: keyword arguments only, literal values."""
    tree = ast.parse(text, mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        raise ValueError(f"not a list of calls: {text[:80]!r}")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            raise ValueError(f"not a call with keyword arguments: {ast.unparse(node)[:80]!r}")
        name = _dotted(node.func)
        args = {k.arg: ast.literal_eval(_JSONLiterals().visit(k.value)) for k in node.keywords}
        calls.append({"name": name, "arguments": args})
    return calls


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ValueError("not a function name")


def _tool_name(tool) -> str | None:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    return fn.get("name") if isinstance(fn, dict) else None
