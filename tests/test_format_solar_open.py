"""Solar Open's chat format (edge0/formats/solar_open.py): the reasoning message, then an answer
after <|content|> or calls in a <|tool_calls|> section, each call emitted at its own end, however
the text is split into deltas; the model's ids kept when they have the template's shape, others and
repeated ones replaced; ids of other servers rendered in that shape; malformed calls come back as
text, never raising; what follows the turn dropped; detection on the published markup; the end
tokens and markers through edge0's tokenizer."""

from __future__ import annotations

import json
import re

import pytest

from edge0.backend import io as bio
from edge0.formats import Reasoning, detect
from edge0.formats.solar_open import SolarOpenFormat
from tests.fixtures.formats import WEATHER_TOOL, cases, write_tokenizer
from tests.fixtures.formats.solar_open import CASE

TOOLS = [WEATHER_TOOL]
NEXT = "<|end|><|begin|>assistant"  # between two messages of the reply
ID = re.compile(r"[a-z0-9]{10}")


@pytest.fixture(scope="module")
def fmt(tmp_path_factory):
    found = detect(bio.load_tokenizer(write_tokenizer(CASE, tmp_path_factory.mktemp("solar_open"))))
    assert isinstance(found, SolarOpenFormat)
    return found


def call(args: str = '{"city": "Paris"}', call_id: str = "a1b2c3d4e5", name: str = "get_weather") -> str:
    return f"<|tool_call:begin|>{call_id}<|tool_call:name|>{name}<|tool_call:args|>{args}<|tool_call:end|>"


def section(*calls: str) -> str:
    return "<|tool_calls|>" + "".join(calls) + "<|calls|>"


def run(fmt, chunks, tools=TOOLS, opened=False) -> list:
    """The segments of a reply fed as `chunks`: (kind, value) with adjacent text merged and
    stripped; a call is ("call", (id, name, arguments))."""
    splitter = fmt.splitter(tools, opened)
    out = [p for c in chunks for p in splitter.feed(c)] + splitter.finish()
    merged: list = []
    for seg in out:
        kind, value = (
            ("reasoning", seg.text)
            if isinstance(seg, Reasoning)
            else ("text", seg)
            if isinstance(seg, str)
            else ("call", (seg["id"], seg["function"]["name"], json.loads(seg["function"]["arguments"])))
        )
        if merged and kind != "call" and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + value)
        else:
            merged.append((kind, value))
    assert splitter.calls == sum(1 for k, _ in merged if k == "call")
    return [(k, v.strip() if k != "call" else v) for k, v in merged if k == "call" or v.strip()]


def every_split(fmt, text, **kw):
    """`run` on `text` whole, one character at a time and cut in two at every index: all equal."""
    whole = run(fmt, [text], **kw)
    assert run(fmt, list(text), **kw) == whole
    for i in range(1, len(text)):
        assert run(fmt, [text[:i], text[i:]], **kw) == whole, i
    return whole


PARIS = ("call", ("a1b2c3d4e5", "get_weather", {"city": "Paris"}))


# -- calls -------------------------------------------------------------------------------------


def test_reasoning_then_a_call(fmt):
    text = f"<|think|>The user wants the weather.{NEXT}" + section(call())
    assert every_split(fmt, text) == [("reasoning", "The user wants the weather."), PARIS]


def test_calls_without_reasoning_and_several_of_them(fmt):
    text = section(call(), call('{"city": "Rome"}', "f6g7h8i9j0"))
    assert every_split(fmt, text) == [PARIS, ("call", ("f6g7h8i9j0", "get_weather", {"city": "Rome"}))]


def test_an_answer_message_then_calls(fmt):
    """vLLM's tests: `Let me check.<|end|><|begin|>assistant<|tool_calls|>...`."""
    text = f"<|content|>Let me check.{NEXT}" + section(call())
    assert every_split(fmt, text) == [("text", "Let me check."), PARIS]


def test_a_call_is_emitted_at_its_own_end(fmt):
    splitter = fmt.splitter(TOOLS, False)
    assert splitter.feed("<|tool_calls|>" + call()[:-3]) == []
    [found] = splitter.feed(call()[-3:])
    assert found["id"] == "a1b2c3d4e5" and splitter.calls == 1
    assert splitter.feed(call(call_id="f6g7h8i9j0"))[0]["id"] == "f6g7h8i9j0"
    assert splitter.feed("<|calls|>") == [] and splitter.finish() == []


def test_ids_of_another_shape_and_repeated_ones_are_replaced(fmt):
    found = run(fmt, [section(call(call_id="NOT-VALID"), call(call_id="0000000000"), call(call_id="0000000000"))])
    ids = [v[0] for _, v in found]
    assert all(ID.fullmatch(i) for i in ids) and len(set(ids)) == 3
    assert ids[0] != "NOT-VALID" and ids[1] == "0000000000"


def test_python_literal_arguments(fmt):
    """Upstage's parser reads them too (vLLM's test_python_literal_args_normalized)."""
    assert every_split(fmt, section(call("{'city': 'Paris'}"))) == [PARIS]


def test_a_call_the_output_ends_in(fmt):
    """<|calls|> is an end id: its text never arrives."""
    assert run(fmt, ["<|tool_calls|>" + call()]) == [PARIS]


@pytest.mark.parametrize(
    "bad",
    [
        call('{"city": Paris}'),  # not JSON or a literal
        call('["Paris"]'),  # not an object
        "<|tool_call:begin|>a1b2c3d4e5<|tool_call:args|>{}<|tool_call:end|>get_weather",  # no name marker
        "<|tool_call:begin|>a1b2c3d4e5<|tool_call:name|>get weather<|tool_call:args|>{}<|tool_call:end|>",
        '<|tool_call:begin|>a1b2c3d4e5<|tool_call:name|>get_weather<|tool_call:args|>{"city": "Pa',  # cut short
    ],
)
def test_a_malformed_call_comes_back_as_text(fmt, bad):
    [(kind, text)] = every_split(fmt, "<|tool_calls|>" + bad)
    assert kind == "text" and text.startswith("<|tool_call:begin|>") and "get" in text


# -- answers and reasoning ------------------------------------------------------------------------


def test_reasoning_then_an_answer(fmt):
    text = f"<|think|>A greeting.{NEXT}<|content|>Hello there."
    assert every_split(fmt, text) == [("reasoning", "A greeting."), ("text", "Hello there.")]
    assert every_split(fmt, text, tools=None) == [("reasoning", "A greeting."), ("text", "Hello there.")]


def test_an_answer_without_reasoning(fmt):
    """reasoning_effort low/minimal: the prompt holds an empty reasoning message."""
    assert every_split(fmt, "<|content|>Hello there.") == [("text", "Hello there.")]


def test_reasoning_the_prompt_opened(fmt):
    text = f"Still thinking.{NEXT}<|content|>Hello there."
    assert every_split(fmt, text, opened=True) == [("reasoning", "Still thinking."), ("text", "Hello there.")]


def test_a_body_marker_ends_reasoning_left_open(fmt):
    """Upstage's parser ends the reasoning at <|content|> or <|tool_calls|> too."""
    expected = [("reasoning", "No end marker."), ("text", "Hello there.")]
    assert every_split(fmt, "<|think|>No end marker.<|content|>Hello there.") == expected
    assert every_split(fmt, "No end marker.<|content|>Hello there.", opened=True) == expected
    text = "<|think|>No end marker." + section(call())
    assert every_split(fmt, text) == [("reasoning", "No end marker."), PARIS]


def test_another_roles_message_after_the_answer_is_dropped(fmt):
    text = "<|content|>Hello there.<|end|><|begin|>user<|content|>And then?<|end|>"
    assert every_split(fmt, text) == [("text", "Hello there.")]
    assert every_split(fmt, "<|content|>Hello there.<|flush|>more") == [("text", "Hello there.")]


def test_text_without_a_message_marker_is_text(fmt):
    assert every_split(fmt, "Hello <there>.") == [("text", "Hello <there>.")]


def test_without_tools_a_call_section_is_text(fmt):
    [(kind, text)] = every_split(fmt, section(call()), tools=None)
    assert kind == "text" and text.startswith("<|tool_calls|><|tool_call:begin|>a1b2c3d4e5")


def test_the_parser_reads_one_call_and_raises_on_what_is_none(fmt):
    assert fmt.parse("a1b2c3d4e5<|tool_call:name|>f<|tool_call:args|>{}", TOOLS) == [
        {"name": "f", "arguments": {}, "id": "a1b2c3d4e5"}
    ]
    assert "id" not in fmt.parse("call_1<|tool_call:name|>f<|tool_call:args|>{}", TOOLS)[0]
    for bad in ("f<|tool_call:args|>{}", "a<|tool_call:name|>f<|tool_call:args|>[]", "a<|tool_call:name|>f"):
        with pytest.raises((ValueError, SyntaxError)):
            fmt.parse(bad, TOOLS)


# -- ids, detection and the tokenizer -----------------------------------------------------------


def test_call_ids_in_the_shape_the_template_takes(fmt):
    assert ID.fullmatch(fmt.call_id()) and fmt.call_id() != fmt.call_id()
    assert fmt.history_id("a1b2c3d4e5") == "a1b2c3d4e5"
    assert fmt.history_id("toolu_a1b2c3d4e5") == "a1b2c3d4e5"  # the Messages API's id of the model's call
    other = fmt.history_id("call_abc")
    assert ID.fullmatch(other) and other == fmt.history_id("call_abc") != fmt.history_id("call_abd")
    fn = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_abc", "type": "function", "function": fn}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
    ]
    out = fmt.render_messages(messages)
    assert out[0]["tool_calls"][0]["id"] == out[1]["tool_call_id"] == other
    assert messages[0]["tool_calls"][0]["id"] == "call_abc"  # the request is left as it was


# Markup of the published template, as llama.cpp (common/chat.cpp) detects it and as it renders a call.
PUBLISHED = "<|tool_response:begin|>{{ id }}<|tool_response:name|>{{ name }}<|tool_response:result|>{{ r }}"
PUBLISHED += "<|tool_call:begin|>{{ tool_call.id }}<|tool_call:name|>{{ tool_call.function.name }}"
OPEN2 = "<|tool_call:start|>{{ name }}\n<|tool_arg:start|>k<|tool_arg:value|>v<|tool_arg:end|><|tool_response:start|>"


def test_detection_on_the_published_markup():
    assert SolarOpenFormat.matches(PUBLISHED, {})
    assert SolarOpenFormat.matches(CASE.template, {})
    assert not SolarOpenFormat.matches(OPEN2, {})  # Solar Open2: another format
    assert not SolarOpenFormat.matches("<|begin|>{{ m.role }}<|content|>{{ m.content }}<|end|>", {})


def test_no_other_fixture_is_detected_as_solar_open():
    for case in cases():
        assert SolarOpenFormat.matches(case.template, {}) == (case.name == "solar_open"), case.name


def test_the_fixture_tokenizer_gets_the_format_its_end_tokens_and_markers(tmp_path):
    tokenizer = bio.load_tokenizer(write_tokenizer(CASE, tmp_path))
    fmt = detect(tokenizer)
    assert type(fmt) is SolarOpenFormat and fmt.calls and fmt.think == ("<|think|>", "<|end|>")
    assert fmt.end_tokens == ("<|flush|>", "<|calls|>")
    ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|flush|>", "<|calls|>")}
    assert ids <= set(tokenizer.eos_token_ids)  # generation_config.json's
    assert tokenizer.convert_tokens_to_ids("<|end|>") not in tokenizer.eos_token_ids  # only a message's end
    hidden = bio.control_token_ids(tokenizer, fmt.markers())
    assert not {tokenizer.convert_tokens_to_ids(m) for m in fmt.markers()} & hidden
