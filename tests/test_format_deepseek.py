"""DeepSeek's chat formats (edge0/formats/deepseek.py): the V3/V3.1/R1 tool-call tokens and
V3.2's DSML, parsed whole and streamed a character at a time; malformed calls come back as text;
detection on the published templates' markup; the conversation as the templates take it; and
V3.2 served through mlx-lm's own encoder (`chat_template_type`), as mlx-lm's conversions are."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from edge0.backend import io as bio
from edge0.engine.reply import Reply
from edge0.formats import Reasoning, detect
from edge0.formats.deepseek import DeepSeekDsmlFormat, DeepSeekFormat
from tests.fixtures.formats import ANSWER, CITY, RESULT, WEATHER_TOOL, write_tokenizer
from tests.fixtures.formats.deepseek_v31 import CASE as V31_CASE
from tests.fixtures.formats.deepseek_v32 import CASE as V32_CASE

TOOLS = [WEATHER_TOOL]

# Snippets of the published templates' markup (DeepSeek-V3.1's tokenizer_config.json, R1's, and
# the DeepSeek-V3.2 jinja llama.cpp ships, models/templates/DeepSeek-V3.2.jinja).
V31_TEMPLATE = (
    "{%- if message['content'] is none -%}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] "
    "+ '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
)
R1_TEMPLATE = (
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}"
)
V32_TEMPLATE = (
    '{%- set dsml_token = "｜DSML｜" -%}\n'
    '{{ "\\n" }}<{{ dsml_token }}invoke name="{{ tool_call.function.name }}">{{ "\\n" }}'
)
QWEN_TEMPLATE = "{%- for tool_call in message.tool_calls %}<tool_call>\n{{ tool_call.name }}</tool_call>{% endfor %}"
DEEPSEEK_VOCAB = {"<｜begin▁of▁sentence｜>": 0, "<｜Assistant｜>": 128804, "<｜tool▁calls▁begin｜>": 128806}


def tokenizer(template: str = "", **init_kwargs):
    return SimpleNamespace(chat_template=template, init_kwargs=init_kwargs)


V31 = DeepSeekFormat(tokenizer(V31_TEMPLATE))
V32 = DeepSeekFormat(tokenizer(V32_TEMPLATE))


def call_v31(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


def block_v31(*calls: str) -> str:
    return "<｜tool▁calls▁begin｜>" + "".join(calls) + "<｜tool▁calls▁end｜>"


def invoke(name: str, *params: tuple[str, str, str]) -> str:
    body = "".join(f'\n<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>' for k, s, v in params)
    return f'<｜DSML｜invoke name="{name}">{body}\n</｜DSML｜invoke>'


def block_v32(*invokes: str, tag: str = "function_calls") -> str:
    return f"\n\n<｜DSML｜{tag}>\n" + "\n".join(invokes) + f"\n</｜DSML｜{tag}>"


def split(fmt, chunks, tools=TOOLS, opened=True) -> tuple[list, int]:
    """The splitter's Segments for `chunks`, adjacent text and reasoning merged: ("text", s),
    ("reasoning", s), ("call", name, arguments)."""
    s = fmt.splitter(tools, opened)
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


def streamed_every_way(fmt, text: str, **kw) -> list:
    """The same Segments whole, one character at a time and split in two at every boundary."""
    whole = split(fmt, [text], **kw)
    assert split(fmt, list(text), **kw) == whole
    for i in range(1, len(text)):
        assert split(fmt, [text[:i], text[i:]], **kw) == whole, i
    return whole[0]


# -- V3 / V3.1 / R1: tool-call tokens ---------------------------------------------------------


def test_v31_a_call_after_reasoning():
    text = "I need the weather.</think>" + block_v31(call_v31("get_weather", '{"city": "Paris"}'))
    assert streamed_every_way(V31, text) == [
        ("reasoning", "I need the weather."),
        ("call", "get_weather", {"city": "Paris"}),
    ]


def test_v31_two_calls_with_text_before_them():
    text = "Let me check both." + block_v31(
        call_v31("get_weather", '{"city": "Paris"}'), call_v31("get_weather", '{"city": "Rome", "days": 2}')
    )
    assert streamed_every_way(V31, text, opened=False) == [
        ("text", "Let me check both."),
        ("call", "get_weather", {"city": "Paris"}),
        ("call", "get_weather", {"city": "Rome", "days": 2}),
    ]


def test_v3_and_r1_fenced_calls():
    fenced = 'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```'
    text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + fenced + "<｜tool▁call▁end｜>\n"
    text += "<｜tool▁call▁begin｜>" + fenced.replace("Paris", "Rome") + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert streamed_every_way(V31, text, opened=False) == [
        ("call", "get_weather", {"city": "Paris"}),
        ("call", "get_weather", {"city": "Rome"}),
    ]


def test_v31_a_call_is_emitted_before_the_block_ends():
    s = V31.splitter(TOOLS, False)
    out = s.feed("<｜tool▁calls▁begin｜>" + call_v31("get_weather", '{"city": "Paris"}'))
    assert [p["function"]["name"] for p in out] == ["get_weather"] and s.calls == 1
    assert s.feed("<｜tool▁calls▁end｜>") == [] and s.finish() == []


def test_v31_a_call_without_its_block_and_text_after_the_block():
    text = call_v31("get_weather", '{"city": "Paris"}') + " done"
    assert split(V31, [text], opened=False)[0] == [("call", "get_weather", {"city": "Paris"}), ("text", " done")]
    text = block_v31(call_v31("get_weather", '{"city": "Paris"}')) + "After."
    assert split(V31, [text], opened=False)[0] == [("call", "get_weather", {"city": "Paris"}), ("text", "After.")]


@pytest.mark.parametrize(
    "bad",
    [
        call_v31("get_weather", '{"city": "Par'),  # JSON cut off
        call_v31("get_weather", '["Paris"]'),  # not an object
        call_v31("get weather", '{"city": "Paris"}'),  # not a name
        "<｜tool▁call▁begin｜>get_weather{}<｜tool▁call▁end｜>",  # no separator
    ],
)
def test_v31_a_malformed_call_comes_back_as_text(bad):
    out, calls = split(V31, ["Hi " + block_v31(bad)], opened=False)
    assert calls == 0 and out == [("text", "Hi " + bad)]
    with pytest.raises(Exception):
        V31.parse(bad, TOOLS)


def test_v31_a_call_cut_off_by_the_token_limit():
    whole = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    assert split(V31, [whole + '{"city": "Paris"}'], opened=False)[0] == [("call", "get_weather", {"city": "Paris"})]
    assert split(V31, [whole + '{"ci'], opened=False)[0] == [
        ("text", '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"ci')
    ]


def test_without_tools_the_markup_stays_text():
    text = "Hm.</think>" + block_v31(call_v31("get_weather", "{}"))
    assert split(V31, [text], tools=None)[0] == [
        ("reasoning", "Hm."),
        ("text", block_v31(call_v31("get_weather", "{}"))),
    ]


# -- V3.2: DSML -------------------------------------------------------------------------------


def test_v32_a_call_after_reasoning():
    text = "I need the weather.</think>" + block_v32(invoke("get_weather", ("city", "true", "Paris")))
    assert streamed_every_way(V32, text) == [
        ("reasoning", "I need the weather."),
        ("call", "get_weather", {"city": "Paris"}),
    ]


def test_v32_two_calls_typed_values_and_text_before_them():
    text = "Checking." + block_v32(
        invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "2")),
        invoke("get_weather", ("city", "true", '"quoted" <b>'), ("opts", "false", '{"units": ["C"], "x": null}')),
    )
    assert streamed_every_way(V32, text, opened=False) == [
        ("text", "Checking.\n\n"),
        ("call", "get_weather", {"city": "Paris", "days": 2}),
        ("call", "get_weather", {"city": '"quoted" <b>', "opts": {"units": ["C"], "x": None}}),
    ]


def test_v32_a_call_is_emitted_before_the_block_ends_and_v4_block_name():
    s = V32.splitter(TOOLS, False)
    out = s.feed("<｜DSML｜function_calls>\n" + invoke("get_weather", ("city", "true", "Paris")))
    assert [p["function"]["name"] for p in out] == ["get_weather"] and s.calls == 1
    v4 = block_v32(invoke("get_weather", ("city", "true", "Paris")), tag="tool_calls")
    assert split(V32, [v4], opened=False)[0] == [("text", "\n\n"), ("call", "get_weather", {"city": "Paris"})]


def test_v32_values_and_calls_without_parameters():
    assert V32.parse(invoke("now"), TOOLS) == [{"name": "now", "arguments": {}}]
    # A value marked non-string that is not JSON is kept as its text.
    assert V32.parse(invoke("f", ("q", "false", "not json")), TOOLS)[0]["arguments"] == {"q": "not json"}


@pytest.mark.parametrize(
    "bad",
    [
        '<｜DSML｜invoke>\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>',
        '<｜DSML｜invoke name="get_weather">\ncity=Paris\n</｜DSML｜invoke>',
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>",  # no string attribute
    ],
)
def test_v32_a_malformed_call_comes_back_as_text(bad):
    out, calls = split(V32, ["Hi\n<｜DSML｜function_calls>\n" + bad + "\n</｜DSML｜function_calls>"], opened=False)
    assert calls == 0 and out == [("text", "Hi\n" + bad)]


# -- detection and the conversation as the templates take it ----------------------------------


@pytest.mark.parametrize(
    "template,vocab,found",
    [
        (V31_TEMPLATE, {}, "deepseek_v31"),
        (R1_TEMPLATE, {}, "deepseek_v31"),
        (V32_TEMPLATE, {}, "deepseek_v32"),
        ("", DEEPSEEK_VOCAB, "deepseek_v32"),  # mlx-lm's V3.2 encoder: no template
        ("", {}, None),
        (QWEN_TEMPLATE, DEEPSEEK_VOCAB, None),
    ],
)
def test_detection_on_the_published_markup(template, vocab, found):
    matched = DeepSeekFormat.matches(template, vocab)
    assert matched == (found is not None)
    if matched:
        assert DeepSeekFormat(tokenizer(template)).name == found


def test_mlx_lm_encoder_replaces_a_template():
    fmt = DeepSeekFormat(tokenizer(V31_TEMPLATE, chat_template_type="deepseek_v32"))
    assert isinstance(fmt, DeepSeekDsmlFormat) and fmt.arguments_as_text  # the encoder json.loads them
    assert not V32.arguments_as_text  # a jinja DSML template iterates them
    assert V31.arguments_as_text


def test_the_conversation_as_the_templates_take_it():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "tool_calls": []}]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]}]
    v31 = V31.render_messages(messages)
    assert "tool_calls" not in v31[1] and v31[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    v32 = V32.render_messages(messages)
    assert v32[0] == {"role": "system", "content": ""} and v32[1:2] == messages[:1]
    assert v32[3]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    system = [{"role": "system", "content": "Be brief."}, *messages]
    assert V32.render_messages(system)[0] == system[0] and len(V32.render_messages(system)) == len(system)


# -- the special tokens through edge0's tokenizer and Reply -----------------------------------


def test_the_markers_survive_the_streaming_detokenizer(tmp_path):
    write_tokenizer(V31_CASE, tmp_path)
    tok = bio.load_tokenizer(tmp_path)
    fmt = detect(tok)
    assert fmt.name == "deepseek_v31"
    # The fullwidth ｜ and ▁ are outside the byte-level alphabet; é split across two byte tokens.
    script = "Café</think>" + block_v31(call_v31("get_weather", '{"city": "Paris"}')) + V31_CASE.eos + "<｜User｜>x"
    reply = Reply(tok, bio.control_token_ids(tok, fmt.markers()), set(tok.eos_token_ids), None, 500)
    steps = []
    for token in tok.encode(script, add_special_tokens=False):
        steps.append(reply.add(token))
        if steps[-1].finish_reason:
            break
    assert steps[-1].finish_reason == "stop" and steps[-1].token == tok.convert_tokens_to_ids(V31_CASE.eos)
    assert "".join(s.text for s in steps) == script[: script.index(V31_CASE.eos)]


# -- V3.2 through mlx-lm's encoder (chat_template_type), as mlx-lm's conversions are ---------


def mlx_lm_conversion(case, out_dir, model_config=None):
    """The case's tokenizer as mlx-lm's DeepSeek-V3.2 conversions have it: no template, the
    encoder named in tokenizer_config.json."""
    out = write_tokenizer(case, out_dir, model_config)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    del config["chat_template"]
    path.write_text(json.dumps({**config, "chat_template_type": "deepseek_v32"}, ensure_ascii=False))
    return out


def normalized(prompt: str) -> str:
    """The prompt without the tools' prose (the fixture's words are its own), from '## Tools' up to the schemas."""
    if "## Tools" not in prompt:
        return prompt
    head, rest = prompt.split("## Tools", 1)
    return head + "## Tools" + rest[rest.index("Here are the functions") :]


def test_the_v32_fixture_template_renders_what_mlx_lm_encoder_renders(tmp_path):
    ours = bio.load_tokenizer(write_tokenizer(V32_CASE, tmp_path / "jinja"))
    theirs = bio.load_tokenizer(mlx_lm_conversion(V32_CASE, tmp_path / "encoder"))
    fmt_ours, fmt_theirs = detect(ours), detect(theirs)
    assert (fmt_ours.name, fmt_theirs.name) == ("deepseek_v32", "deepseek_v32")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": CITY, "days": 2}}}
    conversations = [
        [{"role": "user", "content": "Q"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}],
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
        + [{"role": "tool", "tool_call_id": "c1", "content": RESULT}],
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Both.", "tool_calls": [call, call]}]
        + [{"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}]
        + [{"role": "assistant", "content": ANSWER, "reasoning_content": "ok"}, {"role": "user", "content": "Q2"}],
    ]
    for messages in conversations:
        for tools in (None, TOOLS):
            for thinking in (True, False):
                kw = dict(add_generation_prompt=True, enable_thinking=thinking, tools=tools)
                a = ours.decode(ours.apply_chat_template(fmt_ours.render_messages(messages), **kw))
                b = theirs.decode(theirs.apply_chat_template(fmt_theirs.render_messages(messages), **kw))
                assert normalized(a) == normalized(b)
                assert (tools is not None) == ("get_weather" in b.split("<｜User｜>")[0])  # the tools reach the model


@pytest.fixture(scope="module")
def encoder_served(tmp_path_factory):
    from edge0.server.config import ServerConfig
    from tests import scripted_engine
    from tests.fake_server import running_server

    patch = pytest.MonkeyPatch()
    patch.setattr(scripted_engine, "write_tokenizer", mlx_lm_conversion)
    engine = scripted_engine.ScriptedEngine(V32_CASE, tmp_path_factory.mktemp("dsv32-encoder"))
    patch.undo()
    with running_server(engine, ServerConfig(max_tokens=512)) as base:
        yield engine, base


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_v32_through_mlx_lm_encoder_on_the_three_apis(encoder_served, api, stream):
    from tests.test_chat_formats import HISTORY, SEND

    engine, base = encoder_served
    assert engine.chat_format.name == "deepseek_v32" and engine.chat_format.arguments_as_text
    got = SEND[api](base, stream, tools=True)
    assert [(n, a) for _, n, a in got.calls] == [("get_weather", {"city": CITY})] and got.text.strip() == ""
    assert got.reasoning.strip() == V32_CASE.reasoning
    after = SEND[api](base, stream, tools=True, history=HISTORY[api](got.calls[0][0]))
    assert after.text.strip() == ANSWER and not after.calls


def test_v31_tools_go_into_the_system_message_when_the_template_renders_none():
    """The published V3.1 template renders no `tools`: the model card's block is added to the system
    message (one is made when there is none); a template that renders them gets none."""
    published = DeepSeekFormat(tokenizer("{{ bos_token }}{{ m.content }}<｜tool▁calls▁begin｜>"))
    out = published.render_messages([{"role": "user", "content": "hi"}], [WEATHER_TOOL])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("## Tools")
    assert "### get_weather" in out[0]["content"] and '"city"' in out[0]["content"]
    kept = published.render_messages(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], []
    )
    assert kept[0]["content"] == "Be brief."
    joined = published.render_messages([{"role": "system", "content": "Be brief."}], [WEATHER_TOOL])
    assert joined[0]["content"].startswith("Be brief.\n\n## Tools")
    rendering = DeepSeekFormat(tokenizer("{% if tools %}## Tools{% endif %}<｜tool▁calls▁begin｜>"))
    assert rendering.render_messages([{"role": "user", "content": "hi"}], [WEATHER_TOOL]) == [
        {"role": "user", "content": "hi"}
    ]
