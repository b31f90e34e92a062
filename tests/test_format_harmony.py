"""OpenAI's harmony format (edge0/formats/harmony.py, gpt-oss): replies of the shapes the spec and
the published template show, split whole, a character at a time and at every boundary; a call
emitted when its message or the output ends (<|call|> is an end id: its text never arrives);
malformed calls as text; the model running past its turn; detection on the published template's
markup; the conversation as the template takes it; the markers through edge0's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge0.backend import io as bio
from edge0.engine.reply import Reply
from edge0.formats import Reasoning, detect
from edge0.formats.harmony import HEADER_LIMIT, HarmonyFormat
from tests.fixtures.formats import RESULT, WEATHER_TOOL, write_tokenizer
from tests.fixtures.formats.gpt_oss import CASE

TOOLS = [WEATHER_TOOL]
FMT = HarmonyFormat(None)

ANALYSIS = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"  # one message ends, the next begins
FINAL = "<|channel|>final<|message|>"
# A call as the spec writes it (recipient after the channel) and as the template renders it (before).
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
CALL_BEFORE = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
TOOL_RESULT = '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"made up"<|end|>'

# A snippet of the published chat template (openai/gpt-oss-20b, as llama.cpp ships it:
# models/templates/openai-gpt-oss-120b.jinja).
PUBLISHED = (
    "{%- elif message.thinking and not future_final_message.found %}\n"
    '    {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}\n'
    "{%- endif %}\n"
    '{{- "<|start|>assistant to=" }}\n'
    '{{- "functions." + tool_call.name + "<|channel|>commentary " }}'
)
QWEN_TEMPLATE = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"


def split(chunks, tools=TOOLS) -> tuple[list, int]:
    """The splitter's Segments for `chunks`, adjacent text and reasoning merged: ("text", s),
    ("reasoning", s), ("call", name, arguments)."""
    s = FMT.splitter(tools, False)
    parts = [p for c in chunks for p in s.feed(c)] + s.finish()
    out: list = []
    for p in parts:
        if isinstance(p, dict):
            out.append(("call", p["function"]["name"], json.loads(p["function"]["arguments"])))
            continue
        kind, text = ("reasoning", p.text) if isinstance(p, Reasoning) else ("text", p)
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out, s.calls


def streamed_every_way(text: str, **kw) -> list:
    """The same Segments whole, one character at a time and split in two at every boundary."""
    whole = split([text], **kw)
    assert split(list(text), **kw) == whole
    for i in range(1, len(text)):
        assert split([text[:i], text[i:]], **kw) == whole, i
    return whole[0]


# -- replies -----------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [CALL, CALL_BEFORE], ids=["after", "before"])
def test_reasoning_then_a_call_with_the_recipient_after_or_before_the_channel(call):
    text = ANALYSIS + "Need the weather." + NEXT + call
    assert streamed_every_way(text) == [("reasoning", "Need the weather."), ("call", "get_weather", {"city": "Paris"})]


def test_a_call_as_the_first_message():
    # The generation prompt wrote `<|start|>assistant`: the recipient follows it at once.
    assert streamed_every_way(CALL_BEFORE) == [("call", "get_weather", {"city": "Paris"})]


def test_reasoning_then_the_answer():
    text = ANALYSIS + 'User asks: "What is 2 + 2?" Simple.' + NEXT + FINAL + "2 + 2 = 4."
    assert streamed_every_way(text) == [("reasoning", 'User asks: "What is 2 + 2?" Simple.'), ("text", "2 + 2 = 4.")]


def test_two_calls_with_a_preamble_before_them():
    # <|call|> ends the turn as an end id; were it written as text, a second call could follow.
    preamble = "<|channel|>commentary<|message|>I will check both cities."
    second = CALL.replace("Paris", "Rome")
    text = ANALYSIS + "Two cities." + NEXT + preamble + NEXT + CALL + "<|call|><|start|>assistant" + second
    assert streamed_every_way(text) == [
        ("reasoning", "Two cities."),
        ("text", "I will check both cities."),
        ("call", "get_weather", {"city": "Paris"}),
        ("call", "get_weather", {"city": "Rome"}),
    ]
    assert split([text])[1] == 2


def test_messages_of_one_kind_are_set_apart():
    text = ANALYSIS + "First." + NEXT + ANALYSIS + "Second." + NEXT + FINAL + "Answer."
    assert split([text])[0] == [("reasoning", "First.\n\nSecond."), ("text", "Answer.")]


def test_the_model_running_past_its_turn_is_cut_off():
    text = ANALYSIS + "Need it." + NEXT + CALL + "<|call|>" + TOOL_RESULT + "<|start|>assistant" + FINAL + "Sunny."
    assert streamed_every_way(text) == [("reasoning", "Need it."), ("call", "get_weather", {"city": "Paris"})]
    text = FINAL + "Hi.<|return|><|start|>user<|message|>And then?<|end|><|start|>assistant" + FINAL + "More."
    assert streamed_every_way(text) == [("text", "Hi.")]


def test_reasoning_and_the_answer_stream_as_they_are_written():
    s = FMT.splitter(TOOLS, False)
    assert s.feed(ANALYSIS + "Need the") == [Reasoning("Need the")] and s.inside
    assert s.feed(" weather.<|e") == [Reasoning(" weather.")]  # a marker's start is held back
    assert s.feed("nd|><|start|>assistant" + FINAL + "It is") == ["It is"] and not s.inside
    assert s.feed(" sunny.") == [" sunny."] and s.finish() == []


def test_a_call_is_emitted_when_its_message_or_the_output_ends():
    s = FMT.splitter(TOOLS, False)
    assert s.feed(CALL) == [] and s.calls == 0  # its arguments may go on
    [call] = s.finish()  # <|call|>, an end id, never reaches the text
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and s.calls == 1
    assert call["id"].startswith("call_")
    s = FMT.splitter(TOOLS, False)
    assert [p["function"]["name"] for p in s.feed(CALL + "<|call|>")] == ["get_weather"] and s.finish() == []


def test_a_bare_channel_marker_begins_the_next_message():
    # gpt-oss sometimes leaves out `<|end|><|start|>assistant` between its messages.
    text = ANALYSIS + "Short." + FINAL + "Answer."
    assert streamed_every_way(text) == [("reasoning", "Short."), ("text", "Answer.")]


def test_a_built_in_tool_call_is_reasoning():
    text = '<|channel|>analysis to=browser.search code<|message|>{"query": "x"}'
    assert split([text])[0] == [("reasoning", '{"query": "x"}')]


def test_text_without_the_markup_is_the_answer():
    assert streamed_every_way("Hello there.") == [("text", "Hello there.")]
    long = "word " * (HEADER_LIMIT // 4)
    s = FMT.splitter(TOOLS, False)
    assert "".join(s.feed(long)) + "".join(s.finish()) == long  # streamed once it is no header
    assert split(['{"a": 1}'], tools=None)[0] == [("text", '{"a": 1}')]  # a structured output's JSON


def test_an_unfinished_header_is_dropped():
    assert split([ANALYSIS + "Hm." + NEXT + "<|channel|>fin"])[0] == [("reasoning", "Hm.")]
    assert split([" to=functions.get_wea"])[0] == []


@pytest.mark.parametrize(
    "bad",
    [
        '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Par',  # cut off
        "<|channel|>commentary to=functions.get_weather json<|message|>not json",
        "<|channel|>commentary to=functions.get_weather json<|message|>[1, 2]",  # not an object
        '<|channel|>commentary to=functions. json<|message|>{"city": "Paris"}',  # no name
    ],
)
def test_a_malformed_call_comes_back_as_text(bad):
    out, calls = split([ANALYSIS + "Hm." + NEXT + bad])
    assert out == [("reasoning", "Hm."), ("text", "<|start|>assistant" + bad)] and calls == 0
    assert split([bad]) == ([("text", bad)], 0)  # the first message: the prompt wrote its start
    with pytest.raises(ValueError):
        FMT.parse(bad, TOOLS)


def test_without_tools_a_call_is_text():
    assert split([CALL], tools=None) == ([("text", CALL)], 0)


def test_parse_reads_the_calls_of_a_whole_reply():
    calls = FMT.parse(ANALYSIS + "Hm." + NEXT + CALL, TOOLS)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    with pytest.raises(ValueError):
        FMT.parse(FINAL + "No call.", TOOLS)


# -- detection, the conversation ---------------------------------------------------------------


@pytest.mark.parametrize(
    "template,found",
    [(PUBLISHED, True), (CASE.template, True), (QWEN_TEMPLATE, False), ("", False)],
    ids=["published", "fixture", "qwen", "none"],
)
def test_detection_on_the_published_markup(template, found):
    assert HarmonyFormat.matches(template, {"<|channel|>": 200005}) == found


def test_the_conversation_as_the_template_takes_it():
    def call(n):
        return {"id": f"call_{n}", "type": "function", "function": {"name": f"f{n}", "arguments": {"n": n}}}

    messages = [
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two calls.",
            "tool_calls": [call(1), call(2)],
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "Dropped by the template."},
    ]
    out = FMT.render_messages(messages)
    assert [(m["role"], m.get("tool_call_id"), [c["id"] for c in m.get("tool_calls", [])]) for m in out] == [
        ("user", None, []),
        ("assistant", None, ["call_1"]),
        ("tool", "call_1", []),
        ("assistant", None, ["call_2"]),
        ("tool", "call_2", []),
        ("assistant", None, []),
    ]
    # The template renders a call's content or its thinking, not both: the content joins it.
    assert out[1]["thinking"] == "Two calls.\n\nChecking." and out[1]["content"] == ""
    assert out[5]["thinking"] == "Dropped by the template." and out[5]["content"] == "Done."
    assert FMT.render_messages(messages[:1]) == messages[:1]


def test_the_fixture_renders_each_call_with_its_own_result(tmp_path):
    tok = bio.load_tokenizer(write_tokenizer(CASE, tmp_path))
    calls = [
        {"id": f"call_{c}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
        for c in ("Paris", "Rome")
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two cities.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_Paris", "content": RESULT},
        {"role": "tool", "tool_call_id": "call_Rome", "content": "rain"},
    ]
    prompt = tok.decode(tok.apply_chat_template(FMT.render_messages(messages), tools=TOOLS, add_generation_prompt=True))
    result = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    tail = (
        "<|start|>user<|message|>Weather?<|end|><|start|>assistant<|channel|>analysis<|message|>Two cities.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        f'{result}"{RESULT}"<|end|>'
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>'
        f'{result}"rain"<|end|><|start|>assistant'
    )
    assert prompt.endswith(tail)
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in prompt
    assert "// The weather in a city\ntype get_weather = (_: {\ncity: string,\n}) => any;\n\n} // namespace" in prompt


# -- the special tokens through edge0's tokenizer and Reply -----------------------------------


def test_the_markers_survive_the_streaming_detokenizer_and_the_call_ends_the_turn(tmp_path: Path):
    tok = bio.load_tokenizer(write_tokenizer(CASE, tmp_path))
    fmt = detect(tok)
    assert fmt.name == "harmony"
    for token in fmt.end_tokens:
        tok.add_eos_token(token)
    script = ANALYSIS + "Café." + NEXT + CALL + "<|call|>" + TOOL_RESULT
    reply = Reply(tok, bio.control_token_ids(tok, fmt.markers()), set(tok.eos_token_ids), None, 500)
    s = fmt.splitter(TOOLS, False)
    parts, steps = [], []
    for token in tok.encode(script, add_special_tokens=False):
        steps.append(reply.add(token))
        parts += s.feed(steps[-1].text)
        if steps[-1].finish_reason:
            break
    assert steps[-1].finish_reason == "stop" and steps[-1].token == tok.convert_tokens_to_ids("<|call|>")
    assert "".join(st.text for st in steps) == script[: script.index("<|call|>")]
    parts += s.finish()
    assert "".join(p.text for p in parts[:-1]) == "Café." and parts[-1]["function"]["name"] == "get_weather"
    assert s.calls == 1


def test_a_tool_without_a_description_renders_and_the_format_reasons(tmp_path):
    """The published template writes `"// " + description` for every tool: render_tools gives one
    that has none an empty description (else the whole request failed); the analysis channel is
    reasoning, so Anthropic's thinking is not reported as ignored."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert FMT.render_tools(tools)[0]["function"]["description"] == "" and FMT.reasons
    assert FMT.render_tools([WEATHER_TOOL]) == [WEATHER_TOOL]
    import jinja2

    source = "{% for t in tools %}{{ '// ' + t.function.description }}{% endfor %}"
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    assert env.from_string(source).render(tools=FMT.render_tools(tools)) == "// "
    with pytest.raises(jinja2.UndefinedError):
        env.from_string(source).render(tools=tools)
