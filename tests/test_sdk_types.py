"""Every body and stream event of the three APIs against the official SDKs' own pydantic types,
strictly: validated in pydantic's strict mode (no coercion), and no field the type does not
declare, at any depth. The requests cover plain text, reasoning, tool calls, log-probs, usage in
streams, keep-alives and errors, streamed and not, on the fake engine (tests/fake_engine.py)."""

from __future__ import annotations

import functools
import json

import anthropic.types as at
import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from edge0.server.config import ServerConfig
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server

TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


CHAT = [
    {"messages": user("hello")},
    {"messages": user("think about it"), "reasoning_effort": "high"},
    {"messages": user("call get_weather Paris"), "tools": [TOOL]},
    {"messages": user("hello"), "logprobs": True, "top_logprobs": 2},
    {"messages": user("hello"), "stream_options": {"include_usage": True}},
    {"messages": user("count 40"), "max_tokens": 5},
    {"messages": user("hello"), "n": 2, "stream_options": {"include_usage": True}},
]
COMPLETIONS = [
    {"prompt": "Once upon"},
    {"prompt": "Once upon", "logprobs": 2, "max_tokens": 4},
    {"prompt": "x", "n": 2},
]
RESPONSES = [
    {"input": "hello"},
    {"input": "think about it", "reasoning": {"effort": "high"}},
    {"input": "call get_weather Paris", "tools": [RESPONSES_TOOL]},
    {"input": "hello", "include": ["message.output_text.logprobs"], "top_logprobs": 2},
    {"input": "count 40", "max_output_tokens": 5},
]
MESSAGES = [
    {"messages": user("hello")},
    {"messages": user("think about it"), "thinking": {"type": "enabled", "budget_tokens": 1024}},
    {"messages": user("call get_weather Paris"), "tools": [ANTHROPIC_TOOL]},
    {"messages": user("count 40"), "max_tokens": 5},
]
# route, the body type, the stream-event type, the requests
APIS = {
    "chat": ("/v1/chat/completions", ChatCompletion, ChatCompletionChunk, CHAT),
    "completions": ("/v1/completions", Completion, Completion, COMPLETIONS),
    "responses": ("/v1/responses", Response, ResponseStreamEvent, RESPONSES),
    "messages": ("/v1/messages", at.Message, at.RawMessageStreamEvent, MESSAGES),
}


# Fields the server adds on purpose where the SDKs have none: the reasoning text in Chat
# Completions (DeepSeek's and vLLM's name, which clients read), docs/server.md "Reasoning".
EXTENSIONS = {"reasoning_content"}


def undeclared(value, where: str = "") -> list[str]:
    """The fields of a validated SDK object (at any depth) that its type does not declare."""
    if isinstance(value, BaseModel):
        out = [f"{where}.{k}" for k in (value.model_extra or {}) if k not in EXTENSIONS]
        for name in type(value).model_fields:
            out += undeclared(getattr(value, name), f"{where}.{name}")
        return out
    if isinstance(value, (list, tuple)):
        return [x for i, v in enumerate(value) for x in undeclared(v, f"{where}.{i}")]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in undeclared(v, f"{where}.{k}")]
    return []


@functools.cache
def adapter(kind) -> TypeAdapter:
    return TypeAdapter(kind)  # built once: the stream-event unions take seconds


def check(kind, data: dict, what: str) -> None:
    try:
        parsed = adapter(kind).validate_python(data, strict=True)
    except Exception as e:
        pytest.fail(f"{what}: {e}\n{json.dumps(data)[:800]}")
    extra = undeclared(parsed)
    assert not extra, f"{what}: fields the SDK's type does not declare: {extra}"


def events(text: str) -> list[dict]:
    """The JSON data of each SSE event (not [DONE], not comments)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


@pytest.fixture(scope="module")
def base():
    engine = FakeEngine(prefill_delay=0.0005)  # slow enough for a keep-alive or two
    with running_server(engine, ServerConfig(keepalive_s=0.02)) as url:
        yield url


@pytest.mark.parametrize("api", sorted(APIS))
def test_every_body_and_event_fits_the_sdks_types_strictly(base, api):
    route, body_type, event_type, requests = APIS[api]
    headers = {"anthropic-version": "2023-06-01"} if api == "messages" else {}
    checked = 0
    for i, request in enumerate(requests):
        request = {"model": "m", "max_tokens": 64, **request, "temperature": 0}
        if api == "responses":
            request.setdefault("max_output_tokens", request.pop("max_tokens"))
            request.pop("max_tokens", None)
        whole = httpx.post(base + route, json=request, headers=headers, timeout=30)
        assert whole.status_code == 200, whole.text
        check(body_type, whole.json(), f"{api} request {i}")
        streamed = httpx.post(base + route, json={**request, "stream": True}, headers=headers, timeout=30)
        assert streamed.status_code == 200
        found = events(streamed.text)
        assert found
        for j, event in enumerate(found):
            if api == "completions" and event["choices"] and event["choices"][0]["finish_reason"] is None:
                # OpenAI's own streams send null here before the last chunk; the SDK's type (which
                # its stream parser does not validate against) declares no null
                event = {**event, "choices": [{**event["choices"][0], "finish_reason": "stop"}]}
            check(event_type, event, f"{api} request {i} event {j}")
        checked += 1 + len(found)
    assert checked > 4 * len(requests)


def test_model_lists_fit_both_sdks():
    from anthropic.types import ModelInfo
    from openai.types import Model

    with running_server(FakeEngine(), ServerConfig()) as url:
        for card in httpx.get(url + "/v1/models").json()["data"]:
            check(Model, card, "OpenAI model")
        cards = httpx.get(url + "/v1/models", headers={"anthropic-version": "2023-06-01"}).json()["data"]
        assert cards
        for card in cards:
            # created_at is an RFC 3339 string on the wire: the SDK parses it (lax for that field only)
            parsed = TypeAdapter(ModelInfo).validate_python(card)
            assert not undeclared(parsed)
