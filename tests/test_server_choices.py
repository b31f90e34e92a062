"""`n > 1` (edge0/server/choices.py): n choices of one prompt, indexes 0..n-1, streamed and not, on
Chat Completions and Completions; a seed gives the same choices again; the later choices reuse
choice 0's prefilled prompt; usage counts the prompt once."""

from __future__ import annotations

import openai
import pytest

from edge0.server.config import ServerConfig
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server

ASK = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()
    with running_server(engine, ServerConfig()) as base:
        yield engine, openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)


def streamed_texts(chunks) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            text = choice.delta.content if hasattr(choice, "delta") else choice.text
            out[choice.index] = out.get(choice.index, "") + (text or "")
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_share_one_prefill_and_count_the_prompt_once(fake, stream):
    engine, client = fake
    engine.reset_cache()
    before = len(engine.calls)
    kwargs = dict(model="m", messages=ASK, n=3, max_tokens=20)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        texts, usage = streamed_texts(chunks), chunks[-1].usage
        finishes = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
        assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    else:
        r = client.chat.completions.create(**kwargs)
        assert [c.index for c in r.choices] == [0, 1, 2]
        texts, usage = {c.index: c.message.content for c in r.choices}, r.usage
    assert texts == {i: "Echo: hello there" for i in range(3)}
    calls = engine.calls[before:]
    prompt = len(calls[0].prompt)
    # choice 0 prefills the prompt; the others reuse it (all but its last token, as any reuse)
    assert [c.prefill_tokens for c in calls] == [prompt, 1, 1]
    assert usage.prompt_tokens == prompt and usage.completion_tokens == sum(c.steps for c in calls)


def test_completions_take_n_too(fake):
    _, client = fake
    r = client.completions.create(model="m", prompt="Once upon", n=2, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text
    chunks = list(client.completions.create(model="m", prompt="Once upon", n=2, max_tokens=8, stream=True))
    assert streamed_texts(chunks) == {0: r.choices[0].text, 1: r.choices[1].text}


def test_a_seed_gives_the_same_choices_on_the_real_engine(store_for):
    import edge0

    engine = edge0.load(store_for("qwen3_moe"))
    with running_server(engine, ServerConfig()) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        kwargs = dict(model="m", messages=ASK, n=2, max_tokens=12, temperature=1.0, seed=7)
        first = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
        again = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
        streamed = streamed_texts(client.chat.completions.create(**kwargs, stream=True))
        other = [c.message.content for c in client.chat.completions.create(**{**kwargs, "seed": 8}).choices]
    assert first == again == [streamed[0], streamed[1]]
    assert first[0] != first[1] and other != first  # choice i samples with seed + i


def test_a_failing_first_choice_ends_the_request_instead_of_waiting_for_the_others(fake):
    engine, client = fake

    def fresh():  # a 500 closes its connection: each request on its own
        return openai.OpenAI(base_url=str(client.base_url), api_key="x", max_retries=0, timeout=10)

    kwargs = dict(model="m", messages=ASK, n=2, max_tokens=5)
    try:
        engine.fail_at = 0
        with pytest.raises(openai.InternalServerError, match="fake engine failed"):
            fresh().chat.completions.create(**kwargs)
        engine.fail_at = 0
        with pytest.raises(openai.APIError, match="fake engine failed"):
            list(fresh().chat.completions.create(**kwargs, stream=True))
    finally:
        engine.fail_at = None
    assert [c.index for c in fresh().chat.completions.create(**kwargs).choices] == [0, 1]
