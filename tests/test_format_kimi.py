"""Kimi-K2's chat format (edge0/formats/kimi.py) on its fixture tokenizer (mlx-lm's kimi_k2 parser):
calls in a section, each emitted at its own end, however the text is split into deltas; reasoning,
also when the model goes to its calls without </think>; malformed calls come back as text; the
model's ids kept and other servers' ids rendered in its shape; detection on the published markup."""

from __future__ import annotations

import json

import pytest

from edge0.backend import io as bio
from edge0.formats import Reasoning, detect
from edge0.formats.kimi import KimiFormat
from tests.fixtures.formats import WEATHER_TOOL, write_tokenizer
from tests.fixtures.formats.kimi_k2 import CASE

TOOLS = [WEATHER_TOOL]


@pytest.fixture(scope="module")
def fmt(tmp_path_factory):
    found = detect(bio.load_tokenizer(write_tokenizer(CASE, tmp_path_factory.mktemp("kimi"))))
    assert isinstance(found, KimiFormat)
    return found


def call(name: str, args: str, n: int = 0) -> str:
    return f"<|tool_call_begin|>functions.{name}:{n}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


def run(fmt, chunks, tools=TOOLS, opened=False):
    """The segments of a reply fed as `chunks`: (kind, value) with adjacent text merged."""
    splitter = fmt.splitter(tools, opened)
    out = []
    for chunk in chunks:
        out += splitter.feed(chunk)
    out += splitter.finish()
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
    return [(k, v.strip() if k != "call" else v) for k, v in merged if k == "call" or v.strip()]


def every_split(fmt, text, **kw):
    """`run` on `text` whole, one character at a time and cut in two at every index: all equal."""
    whole = run(fmt, [text], **kw)
    assert run(fmt, list(text), **kw) == whole
    for i in range(1, len(text)):
        assert run(fmt, [text[:i], text[i:]], **kw) == whole, i
    return whole


def test_one_call_after_reasoning(fmt):
    text = "<think>The user wants the weather.</think>" + section(call("get_weather", '{"city": "Paris"}'))
    assert every_split(fmt, text) == [
        ("reasoning", "The user wants the weather."),
        ("call", ("functions.get_weather:0", "get_weather", {"city": "Paris"})),
    ]


def test_two_calls_and_text_before_them(fmt):
    text = "Let me check both." + section(
        call("get_weather", '{"city": "Paris"}'), call("get_weather", '{"city": "Rome"}', 1)
    )
    assert every_split(fmt, text) == [
        ("text", "Let me check both."),
        ("call", ("functions.get_weather:0", "get_weather", {"city": "Paris"})),
        ("call", ("functions.get_weather:1", "get_weather", {"city": "Rome"})),
    ]


def test_the_section_ends_reasoning_left_open(fmt):
    # K2-Thinking may go from its reasoning straight to its calls.
    text = "<think>No end marker." + section(call("get_weather", '{"city": "Paris"}'))
    expected = [
        ("reasoning", "No end marker."),
        ("call", ("functions.get_weather:0", "get_weather", {"city": "Paris"})),
    ]
    assert every_split(fmt, text) == expected
    assert every_split(fmt, text.removeprefix("<think>"), opened=True) == expected


def test_a_call_is_emitted_at_its_own_end(fmt):
    splitter = fmt.splitter(TOOLS, False)
    first = splitter.feed("<|tool_calls_section_begin|>" + call("get_weather", '{"city": "Paris"}'))
    assert [s["function"]["name"] for s in first] == ["get_weather"] and splitter.calls == 1
    assert splitter.feed(call("get_weather", '{"city": "Rome"}', 1))[0]["id"] == "functions.get_weather:1"
    assert splitter.feed("<|tool_calls_section_end|>") == [] and splitter.finish() == []


@pytest.mark.parametrize(
    "bad",
    [
        call("get_weather", '{"city": Paris}'),  # not JSON
        call("get_weather", '["Paris"]'),  # not an object
        "<|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}<|tool_call_end|>",  # no index
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Pa',  # cut short
    ],
)
def test_a_malformed_call_comes_back_as_text(fmt, bad):
    [(kind, text)] = every_split(fmt, "Before." + section(bad))
    assert kind == "text" and text.startswith("Before.<|tool_call_begin|>") and "get_weather" in text


def test_without_tools_the_reply_is_text_and_reasoning(fmt):
    assert every_split(fmt, "<think>A greeting.</think>Hello there.", tools=None) == [
        ("reasoning", "A greeting."),
        ("text", "Hello there."),
    ]


def test_ids_the_model_did_not_write_are_rendered_in_its_shape(fmt):
    def turn(call_id, name="get_weather"):
        fn = {"name": name, "arguments": {"city": "Paris"}}
        return [
            {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": fn}]},
            {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
        ]

    messages = [{"role": "user", "content": "hi"}, *turn("functions.get_weather:0"), *turn("call_abc", "get_time")]
    messages += turn("toolu_functions.get_weather:2") + turn("toolu_01XYZ")
    out = fmt.render_messages(messages)
    ids = [m["tool_calls"][0]["id"] for m in out if m.get("tool_calls")]
    assert ids == [
        "functions.get_weather:0",
        "functions.get_time:1",
        "functions.get_weather:2",
        "functions.get_weather:3",
    ]
    assert [m["tool_call_id"] for m in out if m["role"] == "tool"] == ids
    assert messages[1]["tool_calls"][0]["id"] == "functions.get_weather:0"  # the request is left as it was
    assert out[3]["tool_calls"][0]["id"] != messages[3]["tool_calls"][0]["id"]


def test_the_turn_ends_at_im_end(fmt):
    assert "<|im_end|>" in fmt.end_tokens and fmt.think == ("<think>", "</think>")


# The published templates' markup (moonshotai Kimi-K2-Instruct-0905 / K2-Thinking chat_template.jinja).
PUBLISHED = (
    "{%- macro render_toolcalls(message) -%}\n  <|tool_calls_section_begin|>\n"
    "  {%- for tool_call in message['tool_calls'] -%}\n"
    "    <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{{ args }}<|tool_call_end|>\n"
    "  {%- endfor -%}\n  <|tool_calls_section_end|>\n{%- endmacro -%}"
)


def test_detection_on_the_published_markup():
    assert KimiFormat.matches(PUBLISHED, {})
    assert not KimiFormat.matches("<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>", {})
    assert not KimiFormat.matches("<tool_call>{{ tool_call.name }}</tool_call>", {})
