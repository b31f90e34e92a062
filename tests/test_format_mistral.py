"""Mistral's chat formats (edge0/formats/mistral.py) on their fixture tokenizers (mlx-lm's mistral
parser): v3's `[TOOL_CALLS] [JSON list]` and v13's `[TOOL_CALLS]NAME[ARGS]{...}` after a `[THINK]`
block, each call emitted as soon as its JSON is complete, however the text is split into deltas;
malformed calls come back as text; 9-character ids, any id sent back mapped to one the templates
accept; detection on the published markup."""

from __future__ import annotations

import json
import re

import pytest

from edge0.backend import io as bio
from edge0.formats import Reasoning, detect
from edge0.formats.mistral import Mistral3Format, MistralFormat
from tests.fixtures.formats import WEATHER_TOOL, mistral3, mistral_v3, write_tokenizer

TOOLS = [WEATHER_TOOL]
NEW = "NEWID0000"  # the id a test's format makes for a call the model wrote none for


def load(case, root):
    return detect(bio.load_tokenizer(write_tokenizer(case, root)))


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    found = load(mistral_v3.CASE, tmp_path_factory.mktemp("mistral_v3"))
    assert type(found) is MistralFormat
    return found


@pytest.fixture(scope="module")
def v13(tmp_path_factory):
    found = load(mistral3.CASE, tmp_path_factory.mktemp("mistral3"))
    assert type(found) is Mistral3Format
    return found


@pytest.fixture(autouse=True)
def fixed_ids(monkeypatch, request):
    for name in ("v3", "v13"):
        if name in request.fixturenames:
            monkeypatch.setattr(request.getfixturevalue(name), "call_id", lambda: NEW)


def run(fmt, chunks, tools=TOOLS):
    """The segments of a reply fed as `chunks`: (kind, value) with adjacent text merged."""
    splitter = fmt.splitter(tools, False)
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


PARIS = ("get_weather", {"city": "Paris"})
ROME = ("get_weather", {"city": "Rome"})


# -- v3: a JSON list after [TOOL_CALLS] -------------------------------------------------------


def test_v3_one_call(v3):
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert every_split(v3, text) == [("call", (NEW, *PARIS))]


def test_v3_two_calls_with_the_models_ids_and_text_before_them(v3):
    text = (
        'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}, '
        '{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "XYZ987abc"}]'
    )
    assert every_split(v3, text) == [
        ("text", "Checking."),
        ("call", ("abcDEF123", *PARIS)),
        ("call", ("XYZ987abc", *ROME)),
    ]


def test_v3_a_single_object_the_shape_of_a_forced_call(v3):
    assert v3.json_calls
    assert every_split(v3, '[TOOL_CALLS]\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n') == [
        ("call", (NEW, *PARIS))
    ]


def test_v3_a_call_is_emitted_when_its_json_ends(v3):
    splitter = v3.splitter(TOOLS, False)
    assert splitter.feed('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}') == []
    [call] = splitter.feed("]")
    assert call["function"]["name"] == "get_weather" and splitter.calls == 1
    assert splitter.finish() == []


@pytest.mark.parametrize(
    "bad",
    [
        '[{"name": "get_weather", "arguments": {"city": Paris}}]',  # not JSON
        "[1, 2]",  # not calls
        '[{"name": "get_weather", "arguments": ["Paris"]}]',  # arguments not an object
        'get_weather {"city": "Paris"}',  # not a list
        '[{"name": "get_weather", "arguments": {"city": "Pa',  # cut short
    ],
)
def test_v3_a_malformed_call_comes_back_as_text(v3, bad):
    assert every_split(v3, "Before.[TOOL_CALLS] " + bad) == [("text", "Before.[TOOL_CALLS] " + bad)]


# -- v13: NAME[ARGS]{...} after each [TOOL_CALLS], reasoning in [THINK] ------------------------


def test_v13_one_call_after_reasoning(v13):
    text = '[THINK]The user wants the weather.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    assert every_split(v13, text) == [("reasoning", "The user wants the weather."), ("call", (NEW, *PARIS))]


def test_v13_two_calls_text_before_them_and_nested_arguments(v13):
    nested = {"filter": {"tags": ["a}", {"b": "[ARGS]"}]}, "n": 2}
    text = f'Let me check.[TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}[TOOL_CALLS]search[ARGS]{json.dumps(nested)}'
    assert every_split(v13, text) == [
        ("text", "Let me check."),
        ("call", (NEW, *PARIS)),
        ("call", (NEW, "search", nested)),
    ]


def test_v11_the_models_call_id(v13):
    text = '[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris"}'
    assert every_split(v13, text) == [("call", ("abcDEF123", *PARIS))]


def test_v13_a_call_is_emitted_when_its_json_ends(v13):
    splitter = v13.splitter(TOOLS, False)
    assert splitter.feed('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"') == []
    [call] = splitter.feed("}")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"} and splitter.calls == 1
    assert splitter.feed("[TOOL_CALLS]get_weather[ARGS]{}")[0]["function"]["arguments"] == "{}"
    assert splitter.finish() == []


def test_v13_reasoning_and_text_without_tools(v13):
    assert every_split(v13, "[THINK]A greeting.[/THINK]Hello there.", tools=None) == [
        ("reasoning", "A greeting."),
        ("text", "Hello there."),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        'get_weather[ARGS]{"city": Paris}',  # not JSON
        'get_weather{"city": "Paris"}',  # no [ARGS]
        'get_weather[ARGS]["Paris"]',  # arguments not an object
        'get_weather[ARGS]{"city": "Pa',  # cut short
    ],
)
def test_v13_a_malformed_call_comes_back_as_text(v13, bad):
    assert every_split(v13, "Before.[TOOL_CALLS]" + bad) == [("text", "Before.[TOOL_CALLS]" + bad)]


# -- ids ---------------------------------------------------------------------------------------


def test_call_ids_are_nine_letters_and_digits(tmp_path):
    fmt = load(mistral_v3.CASE, tmp_path)
    ids = {fmt.call_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)


def test_any_id_sent_back_renders_as_nine_letters_and_digits(v3):
    assert v3.history_id("abcDEF123") == "abcDEF123"
    assert v3.history_id("toolu_abcDEF123") == "abcDEF123"  # the Messages API's id of one of ours
    for other in ("call_3f2a9c1e8b7d4a6f9e0c1b2a", "toolu_01A09q90qw90lq917835lq9", "fc_1", ""):
        mapped = v3.history_id(other)
        assert re.fullmatch(r"[A-Za-z0-9]{9}", mapped) and mapped == v3.history_id(other)
    assert v3.history_id("call_a") != v3.history_id("call_b")


def test_the_history_renders_with_any_id(v3, tmp_path):
    tokenizer = bio.load_tokenizer(write_tokenizer(mistral_v3.CASE, tmp_path))
    call_id = "call_3f2a9c1e8b7d4a6f9e0c1b2a"
    fn = {"name": "get_weather", "arguments": {"city": "Paris"}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": fn}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]
    with pytest.raises(Exception, match="length 9"):
        tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    text = tokenizer.apply_chat_template(v3.render_messages(messages), tools=TOOLS, tokenize=False)
    mapped = v3.history_id(call_id)
    assert f'"id": "{mapped}"' in text and f'"call_id": "{mapped}"' in text


# -- detection and end ids ---------------------------------------------------------------------

# The published templates' markup: Mixtral-8x22B-Instruct-v0.1 / Mistral-7B-Instruct-v0.3 (v3) and
# Ministral-3 / Mistral-Large-3 (v13) chat templates.
V3 = (
    '{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}'
    "{{- out[:-1] }}{{- ', \"id\": \"' + tool_call.id + '\"}' }}{%- endfor %}"
    '{{- \'[TOOL_RESULTS] {"content": \' + content|string + ", " }}'
)
V13 = (
    "{%- for tool in message['tool_calls'] %}{{- '[TOOL_CALLS]' }}{%- set name = tool['function']['name'] %}"
    "{{- name + '[ARGS]' + arguments }}{%- endfor %}{{- '[THINK]' + block['thinking'] + '[/THINK]' }}"
)


def test_detection_on_the_published_markup():
    assert MistralFormat.matches(V3, {}) and not Mistral3Format.matches(V3, {})
    assert Mistral3Format.matches(V13, {}) and not MistralFormat.matches(V13, {})
    plain = "{{ bos_token }}{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"
    assert not MistralFormat.matches(plain, {}) and not Mistral3Format.matches(plain, {})


def test_the_turn_ends_at_eos(v3, v13):
    for fmt in (v3, v13):
        assert fmt.tokenizer.convert_tokens_to_ids("</s>") in fmt.tokenizer.eos_token_ids
    assert v13.think == ("[THINK]", "[/THINK]") and v3.think is None
