"""Fuzzing the three APIs: 2,000 mutated requests (a fixed seed) against the real app and server on
the fake engine, streamed and not. Each valid seed body is mutated at a random place (a field's
value replaced by junk of another type or nested deep, a field deleted, an unknown field added, a
list item repeated or replaced, a string not UTF-8) or replaced whole (junk JSON, bytes that are
not JSON). No answer may be a
500, in the status or in a stream's error event, and every refusal is an error in its API's shape."""

from __future__ import annotations

import copy
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from edge0.server.config import ServerConfig
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server
from tests.fixtures.hostile import CHAT, COMPLETIONS, COUNT, MESSAGES, MODEL, RESPONSES

REQUESTS = 2000
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

SEEDS = [
    (
        CHAT,
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "call get_weather Paris"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "user", "content": "thanks"},
            ],
            "max_tokens": 16,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop": ["zz"],
            "logprobs": True,
            "top_logprobs": 2,
            "logit_bias": {"5": 1},
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
            "tool_choice": "auto",
            "response_format": {"type": "json_object"},
            "reasoning_effort": "low",
            "stream_options": {"include_usage": True},
            "cache_salt": "s",
        },
    ),
    (
        COMPLETIONS,
        {
            "model": MODEL,
            "prompt": "once",
            "max_tokens": 8,
            "logprobs": 1,
            "temperature": 0,
            "stop": "x",
            "seed": 1,
            "cache_salt": "s",
        },
    ),
    (
        RESPONSES,
        {
            "model": MODEL,
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
            ],
            "max_output_tokens": 16,
            "temperature": 0.7,
            "top_p": 0.5,
            "tools": [
                {"type": "function", "name": "get_weather", "parameters": WEATHER},
                {"type": "web_search"},
                {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f", "parameters": {}}]},
            ],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": WEATHER}},
            "reasoning": {"effort": "low"},
            "cache_salt": "s",
        },
    ),
    (
        MESSAGES,
        {
            "model": MODEL,
            "max_tokens": 16,
            "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "call get_weather Paris"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "x"},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
            ],
            "tools": [{"name": "get_weather", "input_schema": WEATHER}],
            "tool_choice": {"type": "auto"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "temperature": 0.5,
            "top_k": 5,
            "stop_sequences": ["zz"],
            "metadata": {"user_id": "u"},
            "cache_salt": "s",
        },
    ),
    (COUNT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "system": "s", "tools": []}),
]

JUNK = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    1e-300,
    -1e308,
    2**70,
    "",
    "x",
    "auto",
    "\u0000\ud7ff\U0001f600",
    [],
    [None],
    [1, "a"],
    [{}],
    {},
    {"type": "function"},
    {"type": 5},
    {"a": {"b": [1, {"c": None}]}},
    "9" * 400,
    "\ud800",  # a lone surrogate: an escape, or bytes that are not UTF-8 inside a string (surrogatepass)
    5e-324,
    [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
]


def _places(body, path=()):
    """Every (path, value) inside `body`: the body itself, then each field and list item."""
    yield path, body
    if isinstance(body, dict):
        for k, v in body.items():
            yield from _places(v, (*path, k))
    elif isinstance(body, list):
        for i, v in enumerate(body):
            yield from _places(v, (*path, i))


def _set(body, path, value):
    if not path:
        return value
    parent = body
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return body


def mutate(rng: random.Random, seed: dict) -> bytes:
    """One mutation of `seed` (module docstring), as the bytes of a request body."""
    kind = rng.random()
    if kind < 0.03:
        return rng.choice([b"", b"{", b"\xff\xfe\x00", b"[1, 2]", b'"x"', b"null", b"{" * 2000 + b"}" * 2000])
    body = copy.deepcopy(seed)
    body["stream"] = rng.random() < 0.4
    path, value = rng.choice([p for p in _places(body) if p[0]])
    if kind < 0.6:
        body = _set(body, path, copy.deepcopy(rng.choice(JUNK)))
    elif kind < 0.75:
        _set(body, path[:-1], _removed(_get(body, path[:-1]), path[-1]))
    elif kind < 0.85 and isinstance(value, list) and value:
        value.append(copy.deepcopy(rng.choice(value)))
    elif kind < 0.92 and isinstance(value, dict):
        value[rng.choice(["type", "role", "content", "name", "id", "x-unknown"])] = copy.deepcopy(rng.choice(JUNK))
    else:
        for _ in range(3):  # several changes at once
            path, _ = rng.choice([p for p in _places(body) if p[0]])
            body = _set(body, path, copy.deepcopy(rng.choice(JUNK)))
    text = json.dumps(body, ensure_ascii=rng.random() < 0.5, allow_nan=True)
    if rng.random() < 0.03:
        text = text.replace("0.5", rng.choice(["NaN", "Infinity", "-Infinity", "1e999"]), 1)
    return text.encode("utf-8", errors="surrogatepass")


def _get(body, path):
    for p in path:
        body = body[p]
    return body


def _removed(container, key):
    if isinstance(container, dict):
        container.pop(key, None)
    elif isinstance(container, list) and key < len(container):
        container.pop(key)
    return container


def _check(path: str, status: int, text: str) -> str | None:
    """What is wrong with the answer (None: nothing)."""
    if status >= 500:
        return f"status {status}"
    if status >= 400:
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            return f"status {status} with a body that is not JSON"
        if path.startswith("/v1/messages"):
            ok = body.get("type") == "error" and set(body.get("error", {})) == {"type", "message"}
        else:
            ok = set(body.get("error", {})) == {"message", "type", "param", "code"}
        return None if ok else f"status {status}: an error not in its API's shape"
    if "server_error" in text or '"api_error"' in text or "Internal error" in text or "Generation failed" in text:
        return "a stream's error event of a server error"
    return None


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(max_tokens=64, max_prompt_tokens=2048, max_queue=64)
    with running_server(FakeEngine(), config) as base:
        yield base


@pytest.mark.parametrize(
    "requests", [pytest.param(500, id="500"), pytest.param(REQUESTS, id="2000", marks=pytest.mark.slow)]
)
def test_mutated_requests_get_no_500(server, capsys, requests):
    rng = random.Random(46)
    cases = [(path, mutate(rng, seed)) for path, seed in (rng.choice(SEEDS) for _ in range(requests))]
    problems, statuses = [], {}

    def send(case):
        path, content = case
        with httpx.Client(base_url=server, timeout=30) as client:
            r = client.post(path, content=content, headers={"Content-Type": "application/json"})
            return path, content, r.status_code, r.text

    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        for path, content, status, text in pool.map(send, cases):
            statuses[status] = statuses.get(status, 0) + 1
            if (why := _check(path, status, text)) is not None:
                problems.append((why, path, content[:300], text[:300]))
    with capsys.disabled():
        print(f"\nfuzz: {requests} requests in {time.monotonic() - started:.1f} s, statuses {sorted(statuses.items())}")
    assert not problems, problems[:5]
    assert statuses.get(200, 0) > requests // 10 and statuses.get(400, 0) > requests // 10  # both kinds met


@pytest.mark.parametrize(
    "requests", [pytest.param(300, id="300"), pytest.param(2000, id="2000", marks=pytest.mark.slow)]
)
def test_mutated_requests_on_the_real_engine_batched_get_no_500(store_for, requests, capsys):
    """The same mutations against the real engine of a fixture store, decoding in batches of four:
    its own checks (sampling ranges, grammars, log-probs, a denormal temperature) meet them too."""
    import edge0

    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    rng = random.Random(47)
    cases = [(path, mutate(rng, seed)) for path, seed in (rng.choice(SEEDS) for _ in range(requests))]
    config = ServerConfig(max_tokens=6, max_prompt_tokens=2048, max_queue=64, max_batch=4)
    problems, statuses = [], {}
    with running_server(engine, config) as base:

        def send(case):
            path, content = case
            with httpx.Client(base_url=base, timeout=120) as client:
                r = client.post(path, content=content, headers={"Content-Type": "application/json"})
                return path, content, r.status_code, r.text

        with ThreadPoolExecutor(4) as pool:
            for path, content, status, text in pool.map(send, cases):
                statuses[status] = statuses.get(status, 0) + 1
                if (why := _check(path, status, text)) is not None:
                    problems.append((why, path, content[:300], text[:300]))
    with capsys.disabled():
        print(f"\nreal-engine fuzz: {requests} requests, statuses {sorted(statuses.items())}")
    assert not problems, problems[:5]
    assert statuses.get(200, 0) > 0
