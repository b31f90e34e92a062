"""GigaChat3's chat format (edge0/formats/gigachat.py): GigaChat3's `function call` message after
the assistant's and GigaChat3.1's `<|function_call|>`, each call emitted once its JSON closes,
however the text is split into deltas; the assistant's text up to its message's end, what follows
(another role's message, text after the call) dropped; malformed calls come back as text, never
raising; detection on the published templates' markup; the end token and markers through edge0's
tokenizer."""

from __future__ import annotations

import json

import pytest

from edge0.backend import io as bio
from edge0.formats import detect
from edge0.formats.gigachat import GigaChatFormat
from tests.fixtures.formats import WEATHER_TOOL, cases, write_tokenizer
from tests.fixtures.formats.gigachat3 import CASE

TOOLS = [WEATHER_TOOL]
SEP, ROLE = "<|message_sep|>\n\n", "<|role_sep|>\n"
PARIS = ("call", "get_weather", {"city": "Paris"})


@pytest.fixture(scope="module")
def fmt(tmp_path_factory):
    found = detect(bio.load_tokenizer(write_tokenizer(CASE, tmp_path_factory.mktemp("gigachat3"))))
    assert isinstance(found, GigaChatFormat)
    return found


def call(args: str = '{"city": "Paris"}', name: str = "get_weather") -> str:
    """GigaChat3's call: a `function call` message after the assistant's."""
    return f'{SEP}function call{ROLE}{{"name": "{name}", "arguments": {args}}}'


def inline(args: str = '{"city": "Paris"}', name: str = "get_weather") -> str:
    """GigaChat3.1's call, inside the assistant's message."""
    return f'<|function_call|>{{"name": "{name}", "arguments": {args}}}'


def run(fmt, chunks, tools=TOOLS) -> list:
    """The Segments for `chunks`: ("text", s) with adjacent text merged and stripped, ("call", name, arguments)."""
    splitter = fmt.splitter(tools, False)
    out: list = []
    for part in [p for c in chunks for p in splitter.feed(c)] + splitter.finish():
        if isinstance(part, dict):
            out.append(("call", part["function"]["name"], json.loads(part["function"]["arguments"])))
        elif out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + part)
        else:
            out.append(("text", part))
    assert splitter.calls == sum(1 for p in out if p[0] == "call")
    return [("text", p[1].strip()) if p[0] == "text" else p for p in out if p[0] == "call" or p[1].strip()]


def every_split(fmt, text: str, tools=TOOLS) -> list:
    """`run` on `text` whole, a character at a time and cut in two at every index: all equal."""
    whole = run(fmt, [text], tools)
    assert run(fmt, list(text), tools) == whole
    for i in range(1, len(text)):
        assert run(fmt, [text[:i], text[i:]], tools) == whole, i
    return whole


# -- calls -------------------------------------------------------------------------------------


def test_the_call_message_after_an_empty_assistant_message(fmt):
    assert every_split(fmt, call()) == [PARIS]


def test_text_then_the_call(fmt):
    assert every_split(fmt, "Let me check." + call()) == [("text", "Let me check."), PARIS]


def test_the_gigachat31_call_inside_the_assistants_message(fmt):
    assert every_split(fmt, "Let me check." + inline() + SEP) == [("text", "Let me check."), PARIS]
    assert every_split(fmt, inline()) == [PARIS]


def test_arguments_given_as_their_json_text(fmt):
    assert every_split(fmt, call(json.dumps('{"city": "Paris"}'))) == [PARIS]


def test_a_call_is_emitted_when_its_json_closes(fmt):
    splitter = fmt.splitter(TOOLS, False)
    assert splitter.feed("Checking." + call()[:-1]) == ["Checking."]
    [found] = splitter.feed("}")
    assert found["function"]["name"] == "get_weather" and splitter.calls == 1
    assert splitter.feed(SEP + "function result" + ROLE + "made up" + SEP) == [] and splitter.finish() == []


def test_what_follows_the_call_is_dropped(fmt):
    """One call a turn (the template renders the first only): then comes another role's message."""
    assert every_split(fmt, call() + f"{SEP}function result{ROLE}made up{SEP}") == [PARIS]
    assert every_split(fmt, call() + " and more") == [PARIS]


def test_a_call_cut_at_the_end_of_the_output(fmt):
    """</s> is an end id: its text never arrives, the call's JSON ends with the output."""
    assert run(fmt, [call()]) == [PARIS]


# -- text ----------------------------------------------------------------------------------------


def test_the_answer_ends_with_its_message(fmt):
    assert every_split(fmt, f"It is sunny.{SEP}user{ROLE}more{SEP}") == [("text", "It is sunny.")]


def test_without_tools_the_message_is_text_and_a_call_is_dropped(fmt):
    assert every_split(fmt, "Hello there.", tools=None) == [("text", "Hello there.")]
    assert every_split(fmt, "Hello there." + call(), tools=None) == [("text", "Hello there.")]


def test_text_like_the_markup_is_text(fmt):
    text = 'A function call is not a call; {"name": 1} neither.'
    assert every_split(fmt, text) == [("text", text)]


@pytest.mark.parametrize(
    "bad",
    [
        call('{"city": Paris}'),  # not JSON
        call('["Paris"]'),  # the arguments not an object
        f'{SEP}function call{ROLE}{{"arguments": {{"city": "Paris"}}, "tool": "get_weather"}}',  # no name
        f'{SEP}function call{ROLE}{{"name": "get_weather", "arguments": {{"city": "Pa',  # cut short
        f"{SEP}function call{ROLE}get_weather(city='Paris')",  # no JSON
        inline('{"city": Paris}') + SEP,
    ],
)
def test_a_malformed_call_comes_back_as_text(fmt, bad):
    [(kind, text)] = every_split(fmt, "Before." + bad)
    assert kind == "text" and text.startswith("Before.<|") and "get_weather" in text


def test_the_parser_raises_on_what_is_no_call(fmt):
    for bad in (
        '{"name": 1, "arguments": {}}',
        '{"name": "f"}',
        "[]",
        "{}",
        "not a call",
        '{"name": "f", "arguments": 1}',
    ):
        with pytest.raises(ValueError):
            fmt.parse(bad, TOOLS)


# -- detection and the tokenizer ------------------------------------------------------------------

# Snippets of the published templates (llama.cpp models/templates/GigaChat3-10B-A1.8B.jinja,
# GigaChat3.1-10B-A1.8B.jinja and GigaChat3.5.jinja).
GIGACHAT3 = (
    "{{- render_role_message(\n        {\n            'role': 'function call',\n"
    "            'content': '{\"name\": \"' ~ call['name'] ~ '\", \"arguments\": ' ~ arguments ~ '}'\n"
    "        }\n    ) -}}\n"
    '{%- set add_tokens = namespace(\n    role_sep="<|role_sep|>\\n", \n    message_sep="<|message_sep|>\\n\\n"\n) -%}'
)
GIGACHAT31 = (
    "{{- add_tokens.function_call + render_function_call(message.tool_calls[0]) -}}\n"
    '{%- set add_tokens = namespace(\n    role_sep="<|role_sep|>\\n", \n    message_sep="<|message_sep|>\\n\\n",\n'
    '    function_call="<|function_call|>"\n) -%}'
)
GIGACHAT35 = (
    "{%- elif message['role'] in ['function call', 'reasoning function call'] -%}\n"
    "{{- '<｜GCML｜tool_calls>\\n' -}}\n"
    '{%- set add_tokens = namespace(\n    role_sep="<|role_sep|>\\n", \n    message_sep="<|message_sep|>\\n\\n",\n) -%}'
)


def test_detection_on_the_published_markup():
    assert GigaChatFormat.matches(GIGACHAT3, {})
    assert GigaChatFormat.matches(GIGACHAT31, {})
    assert GigaChatFormat.matches(CASE.template, {})
    assert not GigaChatFormat.matches(GIGACHAT35, {})  # GCML calls: another format
    assert not GigaChatFormat.matches("user<|role_sep|>{{ m.content }}<|message_sep|>", {})  # no calls


def test_no_other_fixture_is_detected_as_gigachat3():
    for case in cases():
        assert GigaChatFormat.matches(case.template, {}) == (case.name == "gigachat3"), case.name


def test_the_fixture_tokenizer_gets_the_format_its_end_token_and_markers(tmp_path):
    tokenizer = bio.load_tokenizer(write_tokenizer(CASE, tmp_path))
    fmt = detect(tokenizer)
    assert type(fmt) is GigaChatFormat and fmt.calls and not fmt.json_calls and not fmt.reasons
    assert fmt.end_tokens == ("</s>",)
    for token in fmt.end_tokens:
        tokenizer.add_eos_token(token)
    assert tokenizer.convert_tokens_to_ids("</s>") in tokenizer.eos_token_ids
    hidden = bio.control_token_ids(tokenizer, fmt.markers())
    assert not {tokenizer.convert_tokens_to_ids(t) for t in (ROLE, SEP)} & hidden
    assert tokenizer.convert_tokens_to_ids("<s>") in hidden


def test_no_end_token_a_vocabulary_lacks():
    class Vocab:
        def get_vocab(self):
            return {"<|role_sep|>\n": 1}

    assert GigaChatFormat(Vocab()).end_tokens == ()
