"""Llama 4's chat format (edge0/formats/llama4.py): the bare JSON call the published template asks
for (`parameters`, or `arguments`), several of them, a JSON list, vLLM's pythonic list, calls
between <|python_start|> and <|python_end|> (after answer text, or after the empty block the
template renders before a call), each emitted once complete however the text is split; replies
that are not calls (plain text, JSON that is no call, a list that is no call) come back as text;
malformed calls as text, never raising; detection on the published template's markup; the end
tokens and markers through edge0's tokenizer."""

from __future__ import annotations

import json

import pytest

from edge0.backend import io as bio
from edge0.formats import detect
from edge0.formats.llama4 import Llama4Format
from tests.fixtures.formats import WEATHER_TOOL, write_tokenizer
from tests.fixtures.formats.llama4 import CASE

TOOLS = [WEATHER_TOOL]
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
FMT = Llama4Format(None)
PARIS = ("call", "get_weather", {"city": "Paris"})
ROME = ("call", "get_weather", {"city": "Rome"})

# A snippet of the published chat template (meta-llama/Llama-4-Scout-17B-16E-Instruct's
# tokenizer_config.json, as transformers' convert_llama4_weights_to_hf.py writes it).
PUBLISHED = (
    "{%- elif 'tool_calls' in message and message.tool_calls|length > 0 %}\n"
    "   {{- '<|header_start|>assistant<|header_end|>\\n\\n' -}}\n"
    "   {{- '<|python_start|>' }}\n"
    "    {%- for tool_call in message.tool_calls %}\n"
    "       {{- '{\"name\": \"' + tool_call.function.name + '\", ' }}\n"
    "       {{- '\"parameters\": ' }}\n"
    '   {{- "<|eot|>" }}\n'
    '{%- elif message.role == "tool" or message.role == "ipython" %}\n'
    '    {{- "<|header_start|>ipython<|header_end|>\\n\\n" }}'
)
LLAMA3 = "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"


def run(chunks, tools=TOOLS) -> list:
    """The Segments for `chunks`: ("text", s) with adjacent text merged, ("call", name, arguments)."""
    s = FMT.splitter(tools, False)
    out: list = []
    for part in [p for c in chunks for p in s.feed(c)] + s.finish():
        if isinstance(part, dict):
            fn = part["function"]
            out.append(("call", fn["name"], json.loads(fn["arguments"])))
        elif out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + part)
        else:
            out.append(("text", part))
    assert s.calls == sum(1 for p in out if p[0] == "call")
    return out


def every_split(text: str, tools=TOOLS) -> list:
    """`run` on `text` whole, a character at a time and cut in two at every index: all equal."""
    whole = run([text], tools)
    assert run(list(text), tools) == whole
    for i in range(1, len(text)):
        assert run([text[:i], text[i:]], tools) == whole, i
    return whole


# -- calls -------------------------------------------------------------------------------------


def test_the_bare_json_call_the_published_template_asks_for():
    assert every_split('{"name": "get_weather", "parameters": {"city": "Paris"}}') == [PARIS]
    assert every_split('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n') == [PARIS]


def test_two_bare_calls_and_a_json_list_of_them():
    one, two = (json.dumps({"name": "get_weather", "parameters": {"city": c}}) for c in ("Paris", "Rome"))
    assert every_split(f"{one}; {two}") == [PARIS, ROME]
    assert every_split(f"{one}\n{two}") == [PARIS, ROME]
    assert every_split(f"[{one}, {two}]") == [PARIS, ROME]


def test_the_pythonic_list_of_vllms_llama4_pythonic_template():
    text = '[get_weather(city="Paris"), search(query="it\'s [raining]", n=2, exact=true, near=None)]'
    assert every_split(text, [WEATHER_TOOL, SEARCH]) == [
        PARIS,
        ("call", "search", {"query": "it's [raining]", "n": 2, "exact": True, "near": None}),
    ]


def test_a_call_in_python_markers_after_answer_text():
    text = 'Let me check.<|python_start|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|python_end|>'
    assert every_split(text) == [("text", "Let me check."), PARIS]
    pythonic = 'Checking both.\n<|python_start|>[get_weather(city="Paris"), get_weather(city="Rome")]<|python_end|>'
    assert every_split(pythonic) == [("text", "Checking both.\n"), PARIS, ROME]


def test_the_shape_the_template_renders_a_call_in():
    """`<|python_start|>CONTENT<|python_end|>` then the JSON: the block's text is answer text."""
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert every_split(f"<|python_start|><|python_end|>{call}") == [PARIS]
    assert every_split(f"<|python_start|>Let me look.<|python_end|>{call}") == [("text", "Let me look."), PARIS]


def test_a_call_is_emitted_when_it_closes():
    s = FMT.splitter(TOOLS, False)
    assert s.feed('{"name": "get_weather", "parameters": {"city": "Paris"}') == []
    [call] = s.feed("}")
    assert call["function"]["name"] == "get_weather" and s.calls == 1
    assert s.feed("<|python_start|>[get_weather(city=") == []
    assert len(s.feed('"Rome")]')) == 0  # the block is not over yet
    assert len(s.feed("<|python_end|>")) == 1 and s.calls == 2
    assert s.finish() == []


def test_a_call_the_output_ends_in():
    """<|eot|> and <|eom|> are end ids: their text never arrives, an open block ends with the output."""
    assert run(['<|python_start|>{"name": "get_weather", "parameters": {"city": "Paris"}}']) == [PARIS]


# -- replies that are no call -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello there.",
        "  Hello there, with leading spaces.",
        '{"answer": 42}',  # JSON that is no call
        '{"name": "Paris", "parameters": {"population": 2}}',  # a call of no tool the request gave
        "[1] is a reference, [2] another.",
        '["Paris", "Rome"]',
        "Use {braces} and [brackets] freely.",
    ],
)
def test_a_reply_that_is_no_call_is_text(text):
    assert every_split(text) == [("text", text)]


def test_without_tools_everything_is_text():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert every_split(text, tools=None) == [("text", text)]


def test_text_after_a_call_is_text():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}\nDone.'
    assert every_split(text) == [PARIS, ("text", "Done.")]


@pytest.mark.parametrize(
    "bad",
    [
        '{"name": "get_weather", "parameters": {"city": Paris}}',  # not JSON
        '{"name": "get_weather", "parameters": ["Paris"]}',  # arguments not an object
        '[get_weather("Paris")]',  # a positional argument
        "[get_weather(city=Paris)]",  # not a literal
        "print('hello')",  # code, not a call
    ],
)
def test_a_malformed_call_in_python_markers_comes_back_as_text(bad):
    assert every_split(f"Before.<|python_start|>{bad}<|python_end|>") == [("text", "Before." + bad)]


def test_a_bare_call_cut_short_comes_back_as_text():
    text = '{"name": "get_weather", "parameters": {"city": "Pa'
    assert every_split(text) == [("text", text)]


def test_the_parser_raises_on_what_is_no_call():
    for bad in ('{"name": 1}', "[]", "[f(1)]", "{}", "not a call"):
        with pytest.raises((ValueError, SyntaxError)):
            FMT.parse(bad, TOOLS)


# -- detection and the tokenizer ----------------------------------------------------------------


def test_detection_on_the_published_markup():
    assert Llama4Format.matches(PUBLISHED, {})
    assert Llama4Format.matches(CASE.template, {})
    assert not Llama4Format.matches(LLAMA3, {})


def test_the_fixture_tokenizer_gets_the_format_its_end_tokens_and_markers(tmp_path):
    tokenizer = bio.load_tokenizer(write_tokenizer(CASE, tmp_path))
    fmt = detect(tokenizer)
    assert type(fmt) is Llama4Format and fmt.calls and fmt.json_calls
    for token in fmt.end_tokens:
        tokenizer.add_eos_token(token)
    ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|eot|>", "<|eom|>", "<|end_of_text|>")}
    assert ids <= set(tokenizer.eos_token_ids)
    hidden = bio.control_token_ids(tokenizer, fmt.markers())
    assert tokenizer.convert_tokens_to_ids("<|python_start|>") not in hidden
    assert tokenizer.convert_tokens_to_ids("<|header_start|>") in hidden
