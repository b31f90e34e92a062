"""OpenAI's Responses API (/v1/responses), driven by the official `openai` client against the real
server (tests/fake_server.py) around the fake engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from edge0.server.config import ServerConfig
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server

KEY = "sk-responses-test"
MODEL = FakeEngine.model_id
WEATHER = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def client(engine):
    with running_server(
        engine, ServerConfig(api_key=KEY, max_tokens=256, default_max_tokens=128, max_prompt_tokens=1000)
    ) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=20)


def test_text_response_with_instructions_and_usage(client, engine):
    r = client.responses.create(model=MODEL, input="héllo 🙂", instructions="Be brief.")
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == "Echo: héllo 🙂" and [i.type for i in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text" and r.instructions == "Be brief."
    prompt = engine.calls[-1].prompt
    assert prompt == engine.chat_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂"}]
    )
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(prompt), engine.calls[-1].steps)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    items = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "héllo 🙂"}]}],
    )
    assert engine.calls[-1].prompt == prompt and items.output_text == r.output_text
    assert items.usage.input_tokens_details.cached_tokens == len(prompt) - 1
    # the prefilled token was written to the prompt cache (Anthropic's cache_creation_input_tokens)
    assert items.usage.input_tokens_details.cache_write_tokens == 1
    assert r.usage.input_tokens_details.cache_write_tokens == len(prompt) - r.usage.input_tokens_details.cached_tokens


def test_streaming_events_and_final_response(client):
    kwargs = dict(model=MODEL, input="streamed 🙂 text", temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert (
        events[-1].response.output_text == whole.output_text
        and events[-1].response.usage.output_tokens == whole.usage.output_tokens
    )
    with client.responses.stream(**kwargs) as stream:  # the client's own event checks and accumulation
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == whole.output_text


def test_max_output_tokens_gives_an_incomplete_response(client):
    r = client.responses.create(model=MODEL, input="hello", max_output_tokens=3)
    assert (r.status, r.incomplete_details.reason, r.output_text) == ("incomplete", "max_output_tokens", "Ech")
    events = list(client.responses.create(model=MODEL, input="hello", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_sampling_fields_reach_the_engine(client, engine):
    client.responses.create(model=MODEL, input="x", temperature=0.3, top_p=0.5, max_output_tokens=5)
    assert [engine.calls[-1].kwargs[k] for k in ("temperature", "top_p", "max_tokens")] == [0.3, 0.5, 5]


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(client, engine, stream):
    kwargs = dict(model=MODEL, tools=WEATHER, input=[{"role": "user", "content": "call get_weather Paris"}])
    if stream:
        with client.responses.stream(**kwargs) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kwargs)
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert "<tools>" in engine.tokenizer.decode(engine.calls[-1].prompt)
    follow = (
        kwargs["input"]
        + [i.model_dump(exclude_none=True) for i in r.output]
        + [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    )
    reply = client.responses.create(**{**kwargs, "input": follow})
    assert reply.output_text == "The weather is sunny."
    rendered = engine.tokenizer.decode(engine.calls[-1].prompt)
    assert '"arguments": {"city": "Paris"}' in rendered and "<tool_response>\nsunny\n</tool_response>" in rendered


def test_errors_have_openais_shape(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", max_output_tokens=0)
    assert e.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[{"type": "input_image", "image_url": "x"}])
    assert e.value.body["param"].startswith("input") and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
    with pytest.raises(openai.BadRequestError, match="names the tool 'nope'"):
        client.responses.create(model=MODEL, input="x", tools=WEATHER, tool_choice={"type": "function", "name": "nope"})
    with pytest.raises(openai.BadRequestError, match="text.format|json_schema"):
        client.responses.create(
            model=MODEL, input="x", text={"format": {"type": "json_schema", "name": "x", "schema": 5}}
        )
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI requires the schema here (not in Chat Completions)
        client.responses.create(model=MODEL, input="x", text={"format": {"type": "json_schema", "name": "x"}})
    assert e.value.body["param"] == "text.format.schema"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0).responses.create(
            model=MODEL, input="x"
        )


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"input": [3.5]}, "input.0", "an input item must be an object"),
        ({"input": ["x"]}, "input.0", "an input item must be an object"),
        ({"input": [[]]}, "input.0", "an input item must be an object"),
        ({"input": [True]}, "input.0", "an input item must be an object"),
        ({"input": [{"role": "user", "content": "a"}, None]}, "input.1", "an input item must be an object"),
        ({"input": "x", "tool_choice": 5}, "tool_choice", "tool_choice must be"),
        ({"input": "x", "tools": [7]}, "tools.0", "a tool must be an object"),
        # a tagged union's tag ("type=function_call") is not a field of the request
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id", "Field required"),
        ({"input": "x", "tools": [{"type": "function", "name": 5}]}, "tools.0.name", "valid string"),
    ],
)
def test_items_that_are_not_objects_are_a_400_naming_the_field(client, fields, param, words):
    r = httpx.post(
        f"{client.base_url}responses", json={"model": MODEL, **fields}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
