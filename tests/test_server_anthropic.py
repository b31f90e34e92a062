"""Anthropic's Messages API (/v1/messages), driven by the official `anthropic` client against the
real server (tests/fake_server.py) around the fake engine."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from edge0.server.config import ServerConfig
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server

KEY = "sk-anthropic-test"
MODEL = FakeEngine.model_id
WEATHER = [
    {
        "name": "get_weather",
        "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def prompt_sum(usage) -> int:
    """Anthropic's three parts of the prompt: not cached, read from the cache, written to it."""
    return usage.input_tokens + usage.cache_read_input_tokens + (usage.cache_creation_input_tokens or 0)


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def url(engine):
    with running_server(
        engine, ServerConfig(api_key=KEY, max_tokens=256, default_max_tokens=128, max_prompt_tokens=1000)
    ) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=20)


def user(text):
    return [{"role": "user", "content": text}]


def test_message_with_system_prompt_and_usage(client, engine):
    r = client.messages.create(model=MODEL, max_tokens=100, system="Be brief.", messages=user("héllo 🙂"))
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "Echo: héllo 🙂"
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    prompt = engine.calls[-1].prompt
    assert prompt == engine.chat_prompt(  # no thinking asked: Anthropic's default is off
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂"}], enable_thinking=False
    )
    assert prompt_sum(r.usage) == len(prompt)
    assert r.usage.output_tokens == engine.calls[-1].steps
    blocks = client.messages.create(
        model=MODEL,
        max_tokens=100,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "héllo 🙂"}]}],
    )
    assert engine.calls[-1].prompt == prompt and blocks.content[0].text == r.content[0].text
    assert blocks.usage.cache_read_input_tokens == len(prompt) - 1  # the same prompt again: the KV cache


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, max_tokens=100, messages=user("streamed 🙂 text"), extra_body={"temperature": 0})
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens
    events = list(client.messages.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"} and len(kinds) > 10
    # The counts are known once generation starts: message_start has zeros, message_delta the totals.
    assert events[0].message.usage.input_tokens == 0 and events[0].message.usage.output_tokens == 0
    assert prompt_sum(events[-2].usage) == prompt_sum(whole.usage)
    assert prompt_sum(final.usage) == prompt_sum(events[-2].usage)


def test_max_tokens_and_stop_sequences(client):
    r = client.messages.create(model=MODEL, max_tokens=3, messages=user("hello"))
    assert r.content[0].text == "Ech" and r.stop_reason == "max_tokens"
    for stream in (False, True):
        kwargs = dict(model=MODEL, max_tokens=100, messages=user("hello 🙂 world"), stop_sequences=["never", "🙂 w"])
        if stream:
            with client.messages.stream(**kwargs) as s:
                r = s.get_final_message()
        else:
            r = client.messages.create(**kwargs)
        assert r.content[0].text == "Echo: hello " and (r.stop_reason, r.stop_sequence) == ("stop_sequence", "🙂 w")


def test_sampling_fields_in_the_body_reach_the_engine(client, engine):
    # Recent clients take temperature and top_p only in the body.
    client.messages.create(model=MODEL, max_tokens=5, messages=user("x"), extra_body={"temperature": 0.3, "top_p": 0.5})
    assert (engine.calls[-1].kwargs["temperature"], engine.calls[-1].kwargs["top_p"]) == (0.3, 0.5)
    client.messages.create(model=MODEL, max_tokens=5, messages=user("x"))
    assert (engine.calls[-1].kwargs["temperature"], engine.calls[-1].kwargs["top_p"]) == (
        1.0,
        1.0,
    )  # Anthropic's defaults


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(client, engine, stream):
    kwargs = dict(model=MODEL, max_tokens=200, tools=WEATHER, messages=user("call get_weather Paris"))
    if stream:
        with client.messages.stream(**kwargs) as s:
            r = s.get_final_message()
    else:
        r = client.messages.create(**kwargs)
    assert r.stop_reason == "tool_use"
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    assert "<tools>" in engine.tokenizer.decode(engine.calls[-1].prompt)  # the template got the tools
    messages = kwargs["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]},
    ]
    reply = client.messages.create(**{**kwargs, "messages": messages})
    assert reply.content[0].text == "The weather is sunny." and reply.stop_reason == "end_turn"
    rendered = engine.tokenizer.decode(engine.calls[-1].prompt)
    assert '"arguments": {"city": "Paris"}' in rendered and "<tool_response>\nsunny\n</tool_response>" in rendered


def test_tool_choice_none_hides_the_tools(client, engine):
    r = client.messages.create(
        model=MODEL,
        max_tokens=200,
        tools=WEATHER,
        tool_choice={"type": "none"},
        messages=user("call get_weather Paris"),
    )
    assert r.stop_reason == "end_turn" and "<tools>" not in engine.tokenizer.decode(engine.calls[-1].prompt)


def test_errors_have_anthropics_shape(client, url):
    with pytest.raises(anthropic.BadRequestError) as e:  # the client requires max_tokens; send 0
        client.messages.create(model=MODEL, max_tokens=0, messages=user("x"))
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "'max_tokens'" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(
            model=MODEL, max_tokens=5, messages=user("x"), thinking={"type": "enabled", "budget_tokens": 10}
        )
    with pytest.raises(anthropic.BadRequestError, match="needs the tool's 'name'"):
        client.messages.create(
            model=MODEL, max_tokens=5, messages=user("x"), tools=WEATHER, tool_choice={"type": "tool"}
        )
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(model=MODEL, max_tokens=5, messages=user("x"), extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.BadRequestError, match="Thinking may not be enabled"):
        client.messages.create(
            model=MODEL,
            max_tokens=5,
            messages=user("x"),
            tools=WEATHER,
            tool_choice={"type": "any"},
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=user("x")
        )
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": e.value.body["error"]["message"]},
    }
    r = httpx.post(url + "/v1/messages", content=b"{", headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # The bearer key works too (auth_token), as on the OpenAI routes.
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, api_key=None, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=20, messages=user("ok")).content[0].text == "Echo: ok"


READ = {"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}}
DEFERRED = {
    "name": "WebFetch",
    "description": "Fetch a page",
    "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}},
    "defer_loading": True,
}


def test_deferred_tools_stay_out_of_the_prompt_until_a_tool_reference_loads_them(client, engine):
    """As Anthropic's API (Claude Code's deferred tools): count_tokens and the prompt equal those of
    the request without the deferred tool, until a tool search's tool_reference names it."""
    base = dict(model=MODEL, max_tokens=20, messages=user("hello"))
    alone = client.messages.count_tokens(model=MODEL, messages=base["messages"], tools=[READ]).input_tokens
    both = client.messages.count_tokens(model=MODEL, messages=base["messages"], tools=[READ, DEFERRED]).input_tokens
    assert both == alone
    client.messages.create(**base, tools=[READ])
    without = engine.calls[-1].prompt
    client.messages.create(**base, tools=[READ, DEFERRED])
    assert engine.calls[-1].prompt == without and "WebFetch" not in engine.tokenizer.decode(without)

    search = [
        {"role": "user", "content": "find a fetch tool"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "fetch"}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "tool_reference", "tool_name": "WebFetch"}],
                }
            ],
        },
    ]
    search_tool = {"name": "ToolSearch", "input_schema": {"type": "object"}}
    client.messages.create(model=MODEL, max_tokens=20, messages=search, tools=[READ, search_tool, DEFERRED])
    rendered = engine.tokenizer.decode(engine.calls[-1].prompt)
    assert '"name": "WebFetch"' in rendered and "Tool loaded: WebFetch" in rendered
    with pytest.raises(anthropic.BadRequestError, match="tool_reference names the tool 'WebFetch'"):
        client.messages.create(model=MODEL, max_tokens=20, messages=search, tools=[READ, search_tool])
