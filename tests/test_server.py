"""The OpenAI-compatible server, driven by the official `openai` client against a real uvicorn server.

The engine is tests/fake_engine.py (a deterministic "model" on a byte-level tokenizer, so every
multi-byte character is split across tokens).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from edge0.errors import Edge0Error
from edge0.formats import detect
from edge0.formats.markup import ToolCallSplitter
from edge0.sampling import SEED_MAX, check_sampling
from edge0.server.config import ServerConfig
from edge0.textstream import StopMatcher
from tests.fake_engine import FakeEngine, FakeTokenizer
from tests.fake_server import running_server

KEY = "sk-test"
MODEL = FakeEngine.model_id
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
LIMITS = ServerConfig(
    api_key=KEY,
    max_queue=16,
    max_body_bytes=16_384,
    max_tokens=256,
    default_max_tokens=128,
    max_prompt_tokens=1000,
    max_messages=8,
)


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def url(engine):
    with running_server(engine, LIMITS) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=20)


def user(text):
    return [{"role": "user", "content": text}]


def assert_ok(client, text="still alive"):
    r = client.chat.completions.create(model=MODEL, messages=user(text))
    assert r.choices[0].message.content == f"Echo: {text}"


def post(url, body, headers=None, path="/v1/chat/completions"):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers=headers, timeout=20)


# -- incremental text helpers -----------------------------------------------------------------


def test_stop_matcher_across_deltas_and_multibyte():
    m = StopMatcher(["🙂 w", "zzz"])
    out = []
    for delta in ["Echo: h", "é", "llo ", "🙂", " ", "wor", "ld"]:
        text, hit = m.feed(delta)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "Echo: héllo " and hit
    m = StopMatcher(["abc"])
    assert m.feed("xab") == ("x", False)  # "ab" may start "abc": held back
    assert m.flush("d") == "abd"


def test_tool_call_splitter_markers_split_across_deltas():
    s = ToolCallSplitter(detect(FakeTokenizer()), WEATHER)
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> <tool_call>oops'
    out = [seg for i in range(0, len(text), 3) for seg in s.feed(text[i : i + 3])] + list(s.finish())
    content = "".join(x for x in out if isinstance(x, str))
    calls = [x for x in out if isinstance(x, dict)]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and s.calls == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert content == "Sure.  <tool_call>oops</tool_call>"  # an unparseable call stays text


# -- the endpoints ----------------------------------------------------------------------------


def test_chat_non_streaming_and_streaming_with_usage(client, engine):
    msgs = user("héllo 🙂 wörld")
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0)
    assert r.choices[0].message.content == "Echo: héllo 🙂 wörld"
    assert r.choices[0].finish_reason == "stop"
    n_prompt = len(engine.chat_prompt(msgs))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == engine.calls[-1].steps
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 5 and all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == r.choices[0].message.content  # temperature 0: streamed == non-streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # The identical prompt again: everything but the last prompt token comes from the KV cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == n_prompt - 1


def test_prompt_cache_reuses_the_previous_conversation(client, engine):
    first = user("remember me")
    a = client.chat.completions.create(model=MODEL, messages=first)
    follow = first + [{"role": "assistant", "content": a.choices[0].message.content}] + user("and now?")
    b = client.chat.completions.create(model=MODEL, messages=follow)
    assert engine.calls[-1].kwargs["reuse_cache"] is True
    assert b.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens
    assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens - engine.calls[-1].prefill_tokens


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=50)
    assert r.choices[0].text == "Echo: Once upon" and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len("Once upon")
    streamed = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=50, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    short = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
    assert short.choices[0].text == "Ech" and short.choices[0].finish_reason == "length"


def test_models_in_anthropics_shape_for_the_anthropic_sdk(url):
    """The anthropic SDK sends `anthropic-version`: the model list and card come in its Models API
    shape, which its pydantic types validate; without the header they stay OpenAI's."""
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    listed = client.models.list()
    assert [m.id for m in listed.data] == [MODEL] and listed.first_id == listed.last_id == MODEL
    raw = client.models.with_raw_response.retrieve(MODEL).http_response.json()
    card = anthropic.types.ModelInfo.model_validate(raw)
    assert card.type == "model" and card.display_name == MODEL and card.lifecycle == "active"
    assert card.max_input_tokens == LIMITS.max_prompt_tokens and card.max_tokens == LIMITS.max_tokens
    assert abs(card.created_at.timestamp() - time.time()) < 600
    plain = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert plain["object"] == "list" and set(plain["data"][0]) == {"id", "object", "created", "owned_by"}


def test_models_health_stats(client, url):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(url + "/health").json()["status"] == "ok"  # no auth needed
    stats = httpx.get(url + "/v1/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert stats["engine"]["generations"] >= 0 and "completed" in stats["server"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_chunks(client, stream):
    # One token per byte: "lo w" arrives over four chunks, "🙂" over four bytes.
    kwargs = dict(model=MODEL, messages=user("hello 🙂 world"), stop=["lo 🙂 w", "never"])
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.chat.completions.create(**kwargs)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert (text, finish) == ("Echo: hel", "stop")
    r = client.chat.completions.create(model=MODEL, messages=user("a b"), stop="b")
    assert r.choices[0].message.content == "Echo: a "


def test_tool_call_round_trip(client):
    msgs = user("call get_weather Paris")
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=WEATHER)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=WEATHER, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.index, tc.function.name) for tc in streamed] == [(0, "get_weather")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    msgs += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=WEATHER)
    assert r.choices[0].message.content == "The weather is sunny." and r.choices[0].finish_reason == "stop"


VALID = {"model": MODEL, "messages": user("x")}


@pytest.mark.parametrize(
    "body,headers,status,param,needle",
    [
        (b'{"model": "fake-moe", "messages": [', None, 400, None, "not valid JSON"),
        (b"[1, 2]", None, 400, None, "valid dictionary"),  # JSON, but not an object
        ({"model": MODEL, "messages": "hello"}, None, 400, "messages", "valid list"),
        ({**VALID, "max_tokens": "ten"}, None, 400, "max_tokens", "valid integer"),
        ({**VALID, "temperature": True}, None, 400, "temperature", "valid number"),
        ({**VALID, "max_tokens": -5}, None, 400, "max_tokens", "greater than or equal to 1"),
        ({"model": MODEL, "messages": []}, None, 400, "messages", "at least 1"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, None, 400, "messages.0.role", "'user'"),
        ({"model": MODEL, "messages": user("x") * 9}, None, 400, "messages", "limit of 8 (--max-messages)"),
        ({"model": MODEL, "messages": user("x" * 1500)}, None, 400, "messages", "limit of 1000 (--max-prompt-tokens)"),
        ({"model": MODEL, "messages": user("x" * 20_000)}, None, 413, None, "16384 bytes (--max-body-bytes)"),
        (VALID, {"Authorization": ""}, 401, None, "API key"),
        (VALID, {"Authorization": "Bearer wrong"}, 401, None, "API key"),
    ],
)
def test_bad_input_gets_openai_error_and_server_keeps_serving(url, client, body, headers, status, param, needle):
    r = post(url, body, headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and needle in error["message"]
    assert_ok(client)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "field,value",
    [
        ("seed", -1),
        ("seed", 2**70),
        ("seed", SEED_MAX + 1),
        ("temperature", -0.5),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_completion_tokens", 0),
        ("n", 9),
        ("n", 0),
        ("seed", 1.5),
        ("max_tokens", 1.0),
    ],
)
def test_out_of_range_numbers_are_400_before_any_stream(url, client, field, value, stream):
    r = post(url, {**VALID, field: value, "stream": stream})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["type"] == "invalid_request_error"
    assert_ok(client)


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_are_400(url, raw):
    body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "temperature": {raw}}}'
    r = post(url, body.encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


@pytest.mark.parametrize(
    "field,value",
    [
        ("seed", -1),
        ("seed", 0),
        ("seed", SEED_MAX),
        ("seed", SEED_MAX + 1),
        ("temperature", -1e-9),
        ("temperature", 0.0),
        ("temperature", 2.0),
        ("top_p", 0.0),
        ("top_p", 1e-9),
        ("top_p", 1.0),
        ("top_p", 1.0 + 1e-9),
    ],
)
def test_request_ranges_are_edge0_samplings(url, engine, field, value):
    """What the schema accepts is what edge0.sampling.check_sampling accepts (below OpenAI's 2 cap)."""
    sampling = {"temperature": 0.0, "top_p": 1.0, "seed": None, field: value}
    try:
        check_sampling(**sampling)
        valid = True
    except Edge0Error:
        valid = False
    r = post(url, {**VALID, field: value, "max_tokens": 2})
    assert r.status_code == (200 if valid else 400), r.text
    if valid:
        assert engine.calls[-1].kwargs[field] == value


def test_an_oversized_prompt_is_refused_before_tokenizing():
    engine = FakeEngine()  # tokens of at most 16 characters: 100 tokens hold at most 1600
    with running_server(engine, ServerConfig(max_prompt_tokens=100)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=20)
        for body, path in [
            ({"model": MODEL, "messages": user("x" * 3_000_000)}, "/v1/chat/completions"),
            ({"model": MODEL, "prompt": "y" * 1601}, "/v1/completions"),
        ]:
            before = engine.tokenizer.encoded_chars
            started = time.monotonic()
            r = post(base, body, path=path)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert (
                "characters" in r.json()["error"]["message"] and "--max-prompt-tokens" in r.json()["error"]["message"]
            )
            assert engine.tokenizer.encoded_chars == before  # never tokenized
            assert time.monotonic() - started < 2
        r = post(base, {"model": MODEL, "messages": user("z" * 150)})  # fits in characters, not in tokens
        assert r.status_code == 400 and "150" not in r.json()["error"]["message"]
        assert "tokens, above this server's limit of 100" in r.json()["error"]["message"]
        assert_ok(client)


def test_client_leaving_during_prefill_frees_the_engine():
    engine = FakeEngine(prefill_delay=0.002)  # a 3000-token prompt: 6 s of prefill, in 64-token chunks
    with running_server(engine, ServerConfig()) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=20)
        body = {"model": MODEL, "messages": user("p" * 3000), "stream": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=20) as r:
            next(r.iter_lines())  # the role chunk: the request is in, its prefill has started
            wait_for(lambda: engine.calls and engine.calls[-1].prefilled > 0)
        left = time.monotonic()
        call = engine.calls[-1]
        wait_for(lambda: call.closed_early, timeout=3)
        assert call.steps == 0 and call.prefilled < len(call.prompt)
        assert time.monotonic() - left < 2  # within a few 0.13 s chunks, not the 6 s of the whole prompt
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
            httpx.post(base + "/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
        call = engine.calls[-1]
        wait_for(lambda: call.closed_early, timeout=3)
        assert call.steps == 0 and call.prefilled < len(call.prompt)
        engine.prefill_delay = 0
        started = time.monotonic()
        assert_ok(client)
        assert time.monotonic() - started < 2


@pytest.mark.parametrize(
    "path,body,error_of",
    [
        ("/v1/chat/completions", {**VALID, "messages": user("count 50")}, lambda events: events[-1]["error"]["type"]),
        (
            "/v1/messages",
            {**VALID, "messages": user("count 50"), "max_tokens": 100},
            lambda events: events[-1]["error"]["type"],
        ),
        ("/v1/responses", {"model": MODEL, "input": "count 50"}, lambda events: events[-1]["type"]),
    ],
)
def test_a_generation_failing_mid_stream_ends_it_with_an_error_in_the_apis_shape(
    url, client, engine, path, body, error_of
):
    engine.fail_at = 10
    with httpx.stream(
        "POST", url + path, json={**body, "stream": True}, headers={"Authorization": f"Bearer {KEY}"}, timeout=20
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and "fake engine failed" in lines[-1]
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    assert error_of(events) in ("server_error", "api_error", "error")
    if path != "/v1/chat/completions":
        assert lines[-2] == "event: error"
    engine.fail_at = 10
    r = post(url, body, path=path)  # not streamed: a 500 in the API's shape
    assert r.status_code == 500 and "fake engine failed" in r.text
    assert_ok(client)


def test_oversized_chunked_body_is_refused(url, client):
    chunks = (b" " * 4096 for _ in range(8))  # no Content-Length: the size is counted as it arrives
    r = httpx.post(
        url + "/v1/chat/completions",
        content=chunks,
        timeout=20,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert_ok(client)


def test_errors_through_the_openai_client(url, client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=user("x"), max_tokens=0)
    anonymous = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    assert post(url, VALID, path="/v1/nothing-here").status_code == 404
    assert_ok(client)


def test_eight_concurrent_requests_all_answered(client, engine):
    engine.delay = 0.002
    try:
        with ThreadPoolExecutor(8) as pool:
            replies = list(
                pool.map(
                    lambda i: (
                        client.chat.completions.create(model=MODEL, messages=user(f"request {i}"))
                        .choices[0]
                        .message.content
                    ),
                    range(8),
                )
            )
    finally:
        engine.delay = 0.0
    assert replies == [f"Echo: request {i}" for i in range(8)]
    assert engine.max_active == 1  # one generation at a time


def test_full_queue_answers_429_and_server_stays_up():
    engine = FakeEngine(delay=0.008)  # ~0.5 s per reply: all 8 arrive while the first runs
    with running_server(engine, ServerConfig(max_queue=1)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=20)

        def ask(i):
            try:
                return client.chat.completions.create(model=MODEL, messages=user(f"count {20 + i}")).choices[0]
            except openai.RateLimitError as e:
                assert e.body["code"] == "queue_full"
                return None

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(ask, range(8)))
        done = [(i, r) for i, r in enumerate(results) if r is not None]
        assert 2 <= len(done) < 8  # one running + one waiting fit; the rest were refused
        for i, r in done:
            assert r.message.content == " ".join(str(k) for k in range(20 + i))
        engine.delay = 0
        assert_ok(client)
        assert engine.max_active == 1


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_client_disconnect_mid_stream_frees_the_engine(url, client, engine):
    engine.delay = 0.02  # 100 steps = 2 s for the server to notice, on a loaded machine too
    body = {"model": MODEL, "messages": user("count 1000"), "stream": True, "max_tokens": 256}
    try:
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body, timeout=20, headers={"Authorization": f"Bearer {KEY}"}
        ) as r:
            received = 0
            for line in r.iter_lines():
                received += line.startswith("data: ")
                if received == 5:
                    break  # leaving the block closes the connection mid-stream
        call = engine.calls[-1]
        wait_for(lambda: call.closed_early)
        assert call.finish_reason is None and call.steps < 100
    finally:
        engine.delay = 0.0
    started = time.monotonic()
    assert_ok(client)
    assert time.monotonic() - started < 2  # the engine was free, not finishing the abandoned reply


def test_client_timeout_cancels_a_non_streaming_request(url, client, engine):
    engine.delay = 0.02  # 256 tokens take 5 s: the 1 s timeout fires mid-generation
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                url + "/v1/chat/completions",
                json={**VALID, "messages": user("count 1000"), "max_tokens": 256},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=1.0,
            )
        call = engine.calls[-1]
        wait_for(lambda: call.closed_early)
    finally:
        engine.delay = 0.0
    assert_ok(client)
