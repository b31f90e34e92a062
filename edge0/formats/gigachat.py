"""GigaChat3 (GigaChat3-702B-A36B-preview, GigaChat3-10B-A1.8B; mlx-lm's deepseek_v3 module) and
GigaChat3.1: every message is `ROLE<|role_sep|>\\nCONTENT<|message_sep|>\\n\\n`, the assistant's
reply starting after the generation prompt `assistant<|role_sep|>\\n`. GigaChat3 writes a call as a
message of its own right after the assistant's, `<|message_sep|>\\n\\nfunction call<|role_sep|>\\n`
then `{"name": NAME, "arguments": {...}}`; GigaChat3.1 writes it inside the assistant's message,
`CONTENT<|function_call|>{"name": ..., "arguments": {...}}<|message_sep|>\\n\\n`. One call a turn
(the templates render `tool_calls[0]` only), no reasoning markup, no call ids; a tool result is a
`function result` message. The reply ends at </s>, which the parsers strip from the output.

Where each fact comes from:
- the roles, separators, `function call` message, `function result` role, one call a turn, the
  generation prompt: the published chat template of GigaChat3-10B-A1.8B (ggml-org/llama.cpp
  models/templates/GigaChat3-10B-A1.8B.jinja), and GigaChat3.1's `<|function_call|>` (the
  GigaChat3.1-10B-A1.8B.jinja llama.cpp carries, read in a fork: acproject/seq2seq_llama.cpp);
- `<|role_sep|>\\n` and `<|message_sep|>\\n\\n` as tokens, newlines included: the template's
  `add_tokens` ("SPECIAL TOKENS") and llama.cpp's GigaChat v3 handler
  (common_chat_params_init_gigachat_v3), which preserves exactly those two and parses a call as the
  content up to `<|message_sep|>\\n\\n`, then `<|message_sep|>\\n\\nfunction call<|role_sep|>\\n`
  and one JSON object with "name" and "arguments" (`max_calls = 1`: "parallel toolcalls are not
  supported"), no reasoning (`supports_thinking = false`); llama.cpp detects the format on
  <|role_sep|> and <|message_sep|> in the template (common/chat.cpp);
- the call's JSON and the reply's end: vLLM's gigachat3 tool parser (vllm-project/vllm
  vllm/tool_parsers/gigachat3_tool_parser.py: both call markers, "arguments" an object, the
  content before `<|message_sep|>`, a trailing `</s>` stripped, special tokens kept in the output)
  and SGLang's GigaChat3Detector (sgl-project/sglang python/sglang/srt/function_call/
  gigachat3_detector.py, END_TOKEN "</s>"); the bos `<s>`: the prompt format printed on bartowski's
  GGUF quantizations of both models.
Not found: the checkpoints' tokenizer_config.json, config.json and generation_config.json (the
tokens' special flags and the end ids are not confirmed): </s> is added as an end token where the
vocabulary has it.

GigaChat3.5 writes GCML calls (`<｜GCML｜tool_calls>`, vLLM's gigachat35 parser) with the same
separators: a template with GCML is not this format."""

from __future__ import annotations

import json

from edge0.formats.base import ChatFormat
from edge0.formats.markup import Segment, StepSplitter, parsed_calls
from edge0.textstream import split_at_first

ROLE_SEP, MESSAGE_SEP = "<|role_sep|>", "<|message_sep|>"  # the tokens add their own newlines
FUNCTION_CALL = "<|function_call|>"  # GigaChat3.1
CALL_HEADER = "function call" + ROLE_SEP  # GigaChat3: the call's message after the assistant's
EOS = "</s>"
GCML = "｜GCML｜"  # GigaChat3.5's call markup
TEXT, SEP, CALL, DONE = "text", "sep", "call", "done"  # the splitter's modes


class GigaChatFormat(ChatFormat):
    """GigaChat3's and GigaChat3.1's calls (module docstring): a JSON object after its marker,
    emitted once it closes. The turn ends with the assistant's message and its call; what the model
    writes after them is another role's message and is dropped."""

    name = "gigachat3"
    priority = 50
    families = "GigaChat3-702B-A36B-preview, GigaChat3-10B-A1.8B, GigaChat3.1"
    call_start = CALL_HEADER
    visible = (f"{ROLE_SEP}\n", f"{MESSAGE_SEP}\n\n", ROLE_SEP, MESSAGE_SEP, FUNCTION_CALL)

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.end_tokens = (EOS,) if EOS in vocab else ()

    @classmethod
    def matches(cls, template: str, vocab: dict) -> bool:
        separators = ROLE_SEP in template and MESSAGE_SEP in template
        calls = "'function call'" in template or '"function call"' in template or FUNCTION_CALL in template
        return separators and calls and GCML not in template

    def parse(self, raw: str, tools: list[dict] | None) -> list[dict]:
        """One call: `{"name": NAME, "arguments": {...}}` (the arguments may be their JSON text)."""
        value = json.JSONDecoder(strict=False).decode(raw.strip())
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"].strip():
            raise ValueError(f"not a call: {raw.strip()[:80]!r}")
        args = value.get("arguments")
        if isinstance(args, str):
            args = json.loads(args, strict=False)
        if not isinstance(args, dict):
            raise ValueError("the arguments are not a JSON object")
        return [{"name": value["name"].strip(), "arguments": args}]

    def splitter(self, tools: list[dict] | None, opened: bool):
        return GigaChatSplitter(self, tools)


class GigaChatSplitter(StepSplitter):
    """A reply's Segments: the assistant's text up to its message's end, then (with tools) the call
    of GigaChat3's `function call` message or GigaChat3.1's `<|function_call|>`, emitted once its
    JSON object closes. A call that does not parse comes back as its text; text after the call or
    after a message that is no call (another role's) is dropped. Text that may be the start of a
    marker is held back until it is decided."""

    def __init__(self, fmt: GigaChatFormat, tools: list[dict] | None):
        self.fmt, self.tools = fmt, tools
        self.calls = 0
        self._buf = ""
        self._mode = TEXT
        self._head = ""  # the markup before the call's JSON, given back if the call does not parse
        self._decoder = json.JSONDecoder(strict=False)

    def finish(self) -> list[Segment]:
        """End of generation: held text is released, an open call parsed as it is."""
        out: list[Segment] = []
        rest, self._buf = self._buf, ""
        if self._mode == TEXT and rest:
            out.append(rest)
        elif self._mode == CALL:
            out += self._call(rest)
        self._mode = DONE
        return out

    def _step(self, out: list[Segment]) -> bool:
        """Decide what the buffer's start is; True when the mode changed."""
        if self._mode == TEXT:
            return self._text(out)
        if self._mode == SEP:
            return self._sep()
        if self._mode == CALL:
            return self._call_body(out)
        self._buf = ""  # DONE: past the turn
        return False

    def _text(self, out: list[Segment]) -> bool:
        text, marker, self._buf = split_at_first(self._buf, (MESSAGE_SEP, FUNCTION_CALL))
        if text:
            out.append(text)
        if marker is None:
            return False
        if not self.tools:
            self._mode = DONE
        elif marker == FUNCTION_CALL:
            self._mode, self._head = CALL, marker
        else:
            self._mode, self._head = SEP, marker
        return True

    def _sep(self) -> bool:
        """After the assistant's message: GigaChat3's call message, or the end of the turn."""
        stripped = self._buf.lstrip()
        if stripped.startswith(CALL_HEADER):
            self._head += self._buf[: len(self._buf) - len(stripped)] + CALL_HEADER
            self._buf, self._mode = stripped[len(CALL_HEADER) :], CALL
            return True
        if not stripped or CALL_HEADER.startswith(stripped):
            return False  # maybe the call's header, not complete yet
        self._mode = DONE
        return True

    def _call_body(self, out: list[Segment]) -> bool:
        """The call's JSON: complete when its object closes, or cut at a message end."""
        body = self._buf.lstrip()
        if body.startswith("{") and "}" in body:
            try:
                end = self._decoder.raw_decode(body)[1]
            except json.JSONDecodeError:
                end = None
            if end is not None:
                lead = len(self._buf) - len(body)
                raw = self._buf[: lead + end]
                self._buf, self._mode = "", DONE
                out += self._call(raw)
                return True
        j = self._buf.find(MESSAGE_SEP)
        if j >= 0:
            raw, self._buf, self._mode = self._buf[:j], "", DONE
            out += self._call(raw)
            return True
        return False

    def _call(self, raw: str) -> list[Segment]:
        calls = parsed_calls(self.fmt, raw, self.tools)
        if calls is None:
            return [self._head + raw]
        self.calls += len(calls)
        return calls
