"""What coding agents need from the server without configuration (issue 25), on the fake engine
through the official clients: any model name (or strict names), max_tokens clamped to the
server's limits, log-probs and logit_bias in their OpenAI shapes, reasoning split out on all
three APIs, Anthropic count_tokens and top_k, the unprefixed OpenAI routes, the setup lines."""

from __future__ import annotations

import json
import shlex

import anthropic
import httpx
import openai
import pytest

from edge0.formats import detect
from edge0.server.clients import setup_lines
from edge0.server.config import ServerConfig
from tests.fake_engine import EMPTY_THINK, FakeEngine, FakeTokenizer
from tests.fake_server import running_server

KEY = "sk-agents"
CONFIG = ServerConfig(api_key=KEY, context_length=400, max_prompt_tokens=300)  # no --max-tokens: the context decides


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def url(engine):
    with running_server(engine, CONFIG) as base:
        yield base


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=20)


def user(text):
    return [{"role": "user", "content": text}]


def test_any_model_name_is_answered_and_the_servers_id_reported(oai, claude):
    r = oai.chat.completions.create(model="gpt-4o", messages=user("hi"))
    assert r.model == FakeEngine.model_id and r.choices[0].message.content == "Echo: hi"
    m = claude.messages.create(model="claude-sonnet-4-5", max_tokens=50, messages=user("hi"))
    assert m.model == FakeEngine.model_id and m.content[0].text == "Echo: hi"
    assert oai.responses.create(model="o3", input="hi").model == FakeEngine.model_id
    assert [c.id for c in oai.models.list()] == [FakeEngine.model_id]
    assert oai.models.retrieve("anything").id == FakeEngine.model_id


def test_strict_and_served_model_names():
    names = ServerConfig(api_key=KEY, served_model_names=("qwen-local", "coder"), strict_model_name=True)
    with running_server(FakeEngine(), names) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=20)
        assert [c.id for c in client.models.list()] == ["qwen-local", "coder"]
        assert client.chat.completions.create(model="coder", messages=user("x")).model == "qwen-local"
        assert client.models.retrieve("coder").id == "coder"
        with pytest.raises(openai.NotFoundError, match="--strict-model-name"):
            client.chat.completions.create(model="fake-moe", messages=user("x"))
        with pytest.raises(anthropic.NotFoundError, match="'gpt-4' does not exist"):
            anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0).messages.create(
                model="gpt-4", max_tokens=5, messages=user("x")
            )
        assert httpx.get(base + "/health").json()["model"] == "qwen-local"


def test_max_tokens_is_clamped_to_what_the_context_leaves(oai, claude, engine):
    r = oai.chat.completions.create(model="m", messages=user("count 200"), max_tokens=100_000)
    left = 400 - len(engine.calls[-1].prompt)
    assert engine.calls[-1].kwargs["max_tokens"] == left
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == left
    m = claude.messages.create(model="m", max_tokens=32_000, messages=user("count 200"))
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 400 - len(engine.calls[-1].prompt)
    oai.chat.completions.create(model="m", messages=user("hi"))  # none asked: what the context leaves
    assert engine.calls[-1].kwargs["max_tokens"] == 400 - len(engine.calls[-1].prompt)
    r = oai.completions.create(model="m", prompt="y" * 300, max_tokens=2**40)
    assert engine.calls[-1].kwargs["max_tokens"] == 100 and r.choices[0].finish_reason == "length"
    assert oai.chat.completions.create(model="m", messages=user("hi"), max_tokens=3).usage.completion_tokens == 3
    for bad in (0, -1, 1.5, "9"):
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            oai.chat.completions.create(model="m", messages=user("x"), max_tokens=bad)


def test_max_tokens_flag_and_default_max_tokens(engine):
    with running_server(engine, ServerConfig(default_max_tokens=7, max_tokens=64)) as base:
        ask = lambda **kw: httpx.post(base + "/v1/chat/completions", json={"messages": user("count 50"), **kw}).json()  # noqa: E731
        assert ask()["usage"]["completion_tokens"] == 7  # --default-max-tokens
        r = ask(max_tokens=100_000)  # --max-tokens
        assert r["usage"]["completion_tokens"] == 64 and r["choices"][0]["finish_reason"] == "length"
        r = httpx.post(base + "/v1/messages", json={"model": "m", "max_tokens": 32000, "messages": user("count 50")})
        assert r.json()["stop_reason"] == "max_tokens" and r.json()["usage"]["output_tokens"] == 64


def test_a_prompt_that_fills_the_context_is_400():
    config = ServerConfig(context_length=50, max_prompt_tokens=50)
    with running_server(FakeEngine(), config) as base:
        r = httpx.post(base + "/v1/completions", json={"prompt": "z" * 50}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "leaves none to generate" in r.json()["error"]["message"]


def test_unprefixed_routes_answer_and_need_the_key(url):
    bare = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=20)
    assert bare.chat.completions.create(model="m", messages=user("a")).choices[0].message.content == "Echo: a"
    assert bare.completions.create(model="m", prompt="b").choices[0].text == "Echo: b"
    assert bare.responses.create(model="m", input="c").output_text == "Echo: c"
    assert [m.id for m in bare.models.list()] == [FakeEngine.model_id]
    for path in ("/chat/completions", "/completions", "/responses", "/models"):
        r = httpx.post(url + path, json={}) if path != "/models" else httpx.get(url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path


def _token(tok: int) -> str:
    return FakeTokenizer().token_bytes(tok).decode("latin-1")


def test_chat_logprobs_streamed_and_not(oai):
    kwargs = dict(model="m", messages=user("héllo"), logprobs=True, top_logprobs=3)
    r = oai.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert text == "Echo: héllo" and len(content) == len(text.encode())  # one byte per fake token, no EOS
    assert [c.logprob for c in content] == [-0.5 * (i + 1) for i in range(len(content))]
    assert b"".join(bytes(c.bytes) for c in content) == text.encode()
    for c in content:
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] == c.logprob
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    streamed = [
        c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content
    ]
    assert [(c.token, c.logprob, c.bytes) for c in streamed] == [(c.token, c.logprob, c.bytes) for c in content]
    assert oai.chat.completions.create(model="m", messages=user("x")).choices[0].logprobs is None
    only = oai.chat.completions.create(model="m", messages=user("x"), logprobs=True).choices[0].logprobs.content
    assert all(c.top_logprobs == [] for c in only)


def test_completions_logprobs_legacy_shape(oai):
    r = oai.completions.create(model="m", prompt="ab", logprobs=2, max_tokens=5)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == "Echo:"
    assert lp.token_logprobs == [-0.5, -1.0, -1.5, -2.0, -2.5] and lp.text_offset == [0, 1, 2, 3, 4]
    assert all(len(t) == 2 and max(t.values()) == v for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    streamed = [
        c.choices[0].logprobs
        for c in oai.completions.create(model="m", prompt="ab", logprobs=2, max_tokens=5, stream=True)
    ]
    assert sum((s.token_logprobs for s in streamed if s), []) == lp.token_logprobs


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"top_logprobs": 2}, "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"logit_bias": {"abc": 1}}, "not a token id"),
        ({"logit_bias": {"999999": 1}}, "not a token id"),
        ({"logit_bias": {"65": 101}}, "from -100 to 100"),
        ({"logit_bias": {"65": "1"}}, "from -100 to 100"),
        ({"logit_bias": [1]}, "logit_bias"),
    ],
)
def test_bad_logprobs_and_logit_bias_are_400(url, extra, needle):
    r = httpx.post(
        url + "/v1/chat/completions", json={"messages": user("x"), **extra}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_logit_bias_reaches_the_engine_as_a_processor(oai, engine):
    oai.chat.completions.create(model="m", messages=user("x"), logit_bias={"65": -100, "66": 5})
    (processor,) = engine.calls[-1].kwargs["logits_processors"]
    assert processor.bias == {65: -100.0, 66: 5.0}


def test_reasoning_split_out_on_every_api(oai, claude):
    r = oai.chat.completions.create(model="m", messages=user("think hard"))
    assert r.choices[0].message.content == "hard"
    assert r.choices[0].message.model_extra["reasoning_content"] == "About hard."
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    chunks = list(oai.chat.completions.create(model="m", messages=user("think hard"), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "About hard."
    assert "".join(d.content or "" for d in deltas) == "hard"
    off = oai.chat.completions.create(model="m", messages=user("think hard"), reasoning_effort="none")
    assert off.choices[0].message.content == "Echo: think hard"

    resp = oai.responses.create(model="m", input="think deep")
    assert [o.type for o in resp.output] == ["reasoning", "message"] and resp.output_text == "deep"
    assert resp.output[0].content[0].text == "About deep."
    events = list(oai.responses.create(model="m", input="think deep", stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "About deep."

    m = claude.messages.create(
        model="m", max_tokens=100, messages=user("think well"), thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == "About well."
    assert m.content[1].text == "well" and m.content[0].signature
    with claude.messages.stream(
        model="m", max_tokens=100, messages=user("think well"), thinking={"type": "adaptive"}
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].thinking == "About well." and "thinking" in kinds and "signature" in kinds
    plain = claude.messages.create(model="m", max_tokens=100, messages=user("think well"))  # Anthropic: off by default
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == "Echo: think well"


def test_reasoning_sent_back_reaches_the_template(oai, claude, engine):
    oai.chat.completions.create(
        model="m",
        messages=user("a") + [{"role": "assistant", "content": "b", "reasoning_content": "why"}] + user("c"),
    )
    claude.messages.create(
        model="m",
        max_tokens=20,
        messages=user("a")
        + [
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "why", "signature": "s"}, {"type": "text", "text": "b"}],
            }
        ]
        + user("c"),
    )
    oai.responses.create(
        model="m",
        input=[
            {"role": "user", "content": "a"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "why"}]},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
    )
    history = user("a") + [{"role": "assistant", "content": "b", "reasoning_content": "why"}] + user("c")
    prompts = [c.prompt for c in engine.calls[-3:]]
    assert prompts[0] == prompts[2] == engine.chat_prompt(history)
    assert prompts[1] == engine.chat_prompt(history, enable_thinking=False)  # Anthropic: off unless asked
    assert "<think>\nwhy\n</think>" in engine.tokenizer.decode(prompts[0])


def test_thinking_on_a_model_without_a_reasoning_format_is_answered_without_reasoning_and_counted():
    class PlainTokenizer(FakeTokenizer):
        has_thinking = False

    engine = FakeEngine()
    engine.tokenizer = PlainTokenizer()
    engine.chat_format = detect(engine.tokenizer)
    with running_server(engine, ServerConfig()) as base:
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
        # Claude Code with a Claude model name sends thinking enabled with budget_tokens 31999.
        for thinking in ({"type": "enabled", "budget_tokens": 31999}, {"type": "adaptive"}):
            reply = client.messages.create(model="m", max_tokens=20, messages=user("x"), thinking=thinking)
            assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == "Echo: x"
        # The prompt asked the template for no thinking (Qwen3's empty <think></think>).
        assert all(engine.tokenizer.decode(c.prompt).endswith(EMPTY_THINK) for c in engine.calls)
        r = httpx.post(base + "/v1/chat/completions", json={"messages": user("x"), "reasoning_effort": "high"})
        assert r.status_code == 200
        assert httpx.get(base + "/v1/stats").json()["server"]["adapted"] == {"thinking_without_reasoning_format": 2}


def test_count_tokens_equals_the_messages_input_tokens(claude, engine):
    request = dict(
        model="claude-haiku",
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=user("call get_weather Paris"),
        tools=[
            {
                "name": "get_weather",
                "description": "Weather",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ],
    )
    counted = claude.messages.count_tokens(**request).input_tokens
    engine.reset_cache()  # no prefix reused: every prompt token is an input token
    m = claude.messages.create(max_tokens=100, **request)
    # nothing read: every prompt token prefilled, and written to the prompt cache
    assert counted == m.usage.cache_creation_input_tokens == len(engine.calls[-1].prompt)
    assert m.usage.cache_read_input_tokens == m.usage.input_tokens == 0
    again = claude.messages.create(max_tokens=100, **request)  # reused now: cache read + what was written
    u = again.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted
    assert u.cache_read_input_tokens > 0 and u.input_tokens == 0
    thinking = claude.messages.count_tokens(**request, thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens
    assert counted - thinking == len(engine.tokenizer.encode("<think>\n\n</think>\n\n"))  # no empty block


def test_anthropic_top_k_reaches_the_engine(claude, engine):
    claude.messages.create(model="m", max_tokens=5, messages=user("x"), extra_body={"top_k": 40})
    assert engine.calls[-1].kwargs["top_k"] == 40


def test_setup_lines_name_each_client():
    lines = setup_lines("http://127.0.0.1:8080", "my-store", keyed=False)
    assert lines[0].startswith("Claude Code: ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ")
    assert "ANTHROPIC_MODEL=my-store" in lines[0] and "ANTHROPIC_SMALL_FAST_MODEL=my-store" in lines[0]
    assert 'base_url="http://127.0.0.1:8080/v1", wire_api="responses"' in lines[1] and "env_key" not in lines[1]
    assert lines[2].startswith("opencode: OPENCODE_CONFIG_CONTENT=") and lines[2].endswith(" opencode")
    config = json.loads(shlex.split(lines[2].removeprefix("opencode: "))[0].partition("=")[2])
    assert config["model"] == "edge0/my-store"
    assert config["provider"]["edge0"]["options"] == {"baseURL": "http://127.0.0.1:8080/v1", "apiKey": "edge0"}
    assert 'OpenAI(base_url="http://127.0.0.1:8080/v1"' in lines[3]
    keyed = setup_lines("http://h:1", "m", keyed=True)
    assert "ANTHROPIC_AUTH_TOKEN=$EDGE0_API_KEY" in keyed[0] and 'env_key="EDGE0_API_KEY"' in keyed[1]
    assert '"apiKey":"{env:EDGE0_API_KEY}"' in keyed[2]
    assert json.dumps(keyed).count("EDGE0_API_KEY") == 4


@pytest.mark.parametrize(
    "chunks,inside,expected",
    [
        (list("<think>\nAbout x.\n</think>\n\nhello"), False, ("About x.", "hello")),
        (["<think>\nAb", "out x.\n</th", "ink>\n\n", "hel", "lo"], False, ("About x.", "hello")),
        ([" hello <think> no"], False, ("", " hello <think> no")),  # not at the start: answer text
        (list("reasoning\n</think>\n\nanswer"), True, ("reasoning", "answer")),  # the prompt opened the block
        (["<thi"], False, ("", "<thi")),
        (["<think>unfinished  "], False, ("unfinished", "")),
        (["  ", "x"], False, ("", "  x")),
    ],
)
def test_reasoning_splitter(chunks, inside, expected):
    from edge0.formats.markup import Reasoning, ReasoningSplitter

    splitter = ReasoningSplitter("<think>", "</think>", inside)
    pieces = [p for chunk in chunks for p in splitter.feed(chunk)] + list(splitter.finish())
    thought = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    assert (thought, "".join(p for p in pieces if isinstance(p, str))) == expected
