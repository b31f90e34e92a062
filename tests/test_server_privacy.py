"""Clients that must not learn each other's prompts (docs/server.md, "What clients sharing a prompt
cache can learn"): requests with different `cache_salt` values, or sent with different keys of a
server that has several, never share a cached prefix, on all three APIs, streamed and not; the
same salt or key reuses its own. The real engine of a fixture store, through the official SDKs."""

from __future__ import annotations

import anthropic
import openai
import pytest

import edge0
from edge0.server.config import ServerConfig
from tests.fake_server import running_server

SYSTEM = "You are a careful assistant. " * 24  # well over one 64-token block of the pool


@pytest.fixture(scope="module")
def engine(store_for):
    return edge0.load(store_for("qwen3_moe"), prerouter=False, prompt_cache_memory="32MB")


def chat(base, key, text, salt, stream):
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)
    body = dict(
        model="m",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        max_tokens=3,
        temperature=0,
        extra_body={"cache_salt": salt} if salt else None,
    )
    if not stream:
        return client.chat.completions.create(**body).usage.prompt_tokens_details.cached_tokens
    chunks = client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    return [c.usage for c in chunks if c.usage][-1].prompt_tokens_details.cached_tokens


def messages(base, key, text, salt, stream):
    client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=60)
    body = dict(
        model="m",
        system=SYSTEM,
        messages=[{"role": "user", "content": text}],
        max_tokens=3,
        extra_body={"cache_salt": salt} if salt else None,
    )
    if not stream:
        return client.messages.create(**body).usage.cache_read_input_tokens
    with client.messages.stream(**body) as s:
        return s.get_final_message().usage.cache_read_input_tokens


def responses(base, key, text, salt, stream):
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)
    body = dict(
        model="m",
        instructions=SYSTEM,
        input=text,
        max_output_tokens=3,
        temperature=0,
        extra_body={"cache_salt": salt} if salt else None,
    )
    if not stream:
        return client.responses.create(**body).usage.input_tokens_details.cached_tokens
    events = client.responses.create(**body, stream=True)
    done = [e for e in events if e.type in ("response.completed", "response.incomplete")]
    return done[0].response.usage.input_tokens_details.cached_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", [chat, messages, responses])
def test_requests_with_different_salts_never_share_a_cached_prefix(engine, api, stream):
    engine.reset_cache()
    engine.kv.pool.clear()
    with running_server(engine, ServerConfig()) as base:
        assert api(base, "x", "first question", "alice", stream) == 0
        assert api(base, "x", "second question", "bob", stream) == 0  # the same system prompt, another salt
        assert api(base, "x", "third question", None, stream) == 0  # nor the shared default namespace
        assert api(base, "x", "fourth question", "alice", stream) > 64  # its own salt's system prompt
        assert api(base, "x", "fifth question", None, stream) > 64


def test_each_key_of_a_server_with_several_reuses_only_its_own_caches(engine):
    engine.reset_cache()
    engine.kv.pool.clear()
    with running_server(engine, ServerConfig(api_key=("key-one", "key-two"))) as base:
        assert chat(base, "key-one", "first question", None, False) == 0
        assert chat(base, "key-two", "second question", None, False) == 0
        assert chat(base, "key-one", "third question", None, False) > 64
        assert chat(base, "key-two", "fourth question", None, False) > 64
        with pytest.raises(openai.AuthenticationError):
            chat(base, "key-three", "who", None, False)


def test_a_salt_is_checked(engine):
    with running_server(engine, ServerConfig()) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        for salt in [5, "", "x" * 1025]:  # a salt is 1 to 1,024 characters
            with pytest.raises(openai.BadRequestError, match="cache_salt"):
                client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=1,
                    extra_body={"cache_salt": salt},
                )
