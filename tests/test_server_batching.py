"""Continuous batching in the server (edge0/server/batching.py) on the real engine of a fixture
store: requests sent together decode together and each gets what it gets alone (greedy, seeded,
constrained by a grammar, with log-probs); a short request sent during a long prefill finishes
first; a client that leaves drops out without disturbing the others; an engine or setting that
cannot batch runs one generation at a time and says why."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

import edge0
from edge0.engine.hooks import StepHooks
from edge0.server.config import ServerConfig
from edge0.server.scheduler import Scheduler
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server
from tests.test_server import user

TOPICS = ["the sea", "a red fox", "disks and reads", "four small experts", "a long day", "routes"]


class SlowSteps(StepHooks):
    """Each decode step takes at least `delay_s`, so requests sent together overlap."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def before_forward(self, step):
        time.sleep(self.delay_s)


@pytest.fixture(scope="module")
def engine(store_for):
    return edge0.load(store_for("qwen3_moe"), prerouter=False)


def together(fn, args: list) -> list:
    """fn(arg) for every arg, each in its own thread, started at once; results in order."""
    out, gate = [None] * len(args), threading.Barrier(len(args))

    def one(i):
        gate.wait()
        out[i] = fn(args[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def stats(base: str) -> dict:
    return httpx.get(base + "/v1/stats").json()["server"]


@pytest.mark.parametrize("drafts", [False, True])
def test_requests_sent_together_decode_together_and_get_what_they_get_alone(engine, drafts):
    requests = [
        dict(messages=user(f"tell me about {t}"), max_tokens=6 + 2 * i, temperature=0) for i, t in enumerate(TOPICS)
    ]
    requests[1].update(temperature=1.0, seed=11)  # its own random stream: the same tokens in any batch
    requests[2].update(temperature=0.8, top_p=0.9, seed=5)
    requests[3].update(logprobs=True, top_logprobs=2)
    requests[4].update(stop=["e"])
    requests[5].update(response_format={"type": "json_object"}, max_tokens=24, logit_bias={"40": 5})  # a grammar
    if drafts:  # speculative decoding (--draft): the plain rows draft (the seeded sampled ones from
        # their own streams, as alone), the others ride along
        from edge0.engine.drafters import ModelDrafter
        from edge0.engine.speculative import Speculator
        from tests.fixtures.make import reference_dir

        drafter = ModelDrafter(reference_dir("qwen3_moe"), engine.tokenizer, "qwen3_moe")
        engine.use_speculation(Speculator(drafter, num_draft=3, adaptive=False))
    try:
        with running_server(engine, ServerConfig(max_batch=1)) as base:
            b = stats(base)["batching"]
            assert (b["max_batch"], b["why"], b["batches"]) == (1, "--max-batch", 0)
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            alone = [client.chat.completions.create(model="m", **r) for r in requests]
        engine.hooks = SlowSteps(0.02)
        with running_server(engine, ServerConfig(max_batch=4)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
            batched = together(lambda r: client.chat.completions.create(model="m", **r), requests)
            s = stats(base)
            # a request counts as completed once its handler returns, just after its response reached
            # the client: under load the last one may still be on its way
            deadline = time.monotonic() + 10
            while s["completed"] < len(requests) and time.monotonic() < deadline:
                time.sleep(0.05)
                s = stats(base)
            spec = engine.stats()["batch_speculation"] if drafts else None
    finally:
        engine.hooks = StepHooks()
        engine.use_speculation(None)
    if drafts:
        assert spec["verifies"] > 0 and spec["accepted"] > 0 and spec["unsupported_requests"] == 2
    for a, b in zip(alone, batched):
        assert b.choices[0].message.content == a.choices[0].message.content
        assert b.choices[0].finish_reason == a.choices[0].finish_reason
        assert b.usage.completion_tokens == a.usage.completion_tokens
    lp_alone, lp_batched = alone[3].choices[0].logprobs.content, batched[3].choices[0].logprobs.content
    assert [(t.token, t.top_logprobs[1].token) for t in lp_batched] == [
        (t.token, t.top_logprobs[1].token) for t in lp_alone
    ]
    assert [t.logprob for t in lp_batched] == pytest.approx([t.logprob for t in lp_alone], abs=1e-4)
    b = s["batching"]
    assert b["max_batch"] == 4 and b["most_rows"] == 4 and b["mean_rows"] > 1
    assert s["completed"] == len(requests) and s["requests_in_flight"] == 0


def test_a_short_request_sent_during_a_long_prefill_finishes_first(engine):
    span, engine.prefiller.span_tokens = engine.prefiller.span_tokens, 16
    long_text = " ".join(f"word{i % 97}" for i in range(400))
    try:
        with running_server(engine, ServerConfig(max_batch=4)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
            times = {}

            def long_one():
                stream = client.chat.completions.create(
                    model="m", messages=user(long_text), max_tokens=4, temperature=0, stream=True
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content and "long" not in times:
                        times["long"] = time.monotonic()

            spans0 = httpx.get(base + "/v1/stats").json()["engine"]["prefill_spans"]
            t = threading.Thread(target=long_one)
            t.start()
            deadline = time.monotonic() + 30
            # the long prompt is being prefilled (alone: whole, in the engine's working cache)
            while httpx.get(base + "/v1/stats").json()["engine"]["prefill_spans"] < spans0 + 2:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            short = client.chat.completions.create(model="m", messages=user("hi"), max_tokens=3, temperature=0)
            times["short"] = time.monotonic()
            t.join(120)
            spans = stats(base)["batching"]["spans"]
    finally:
        engine.prefiller.span_tokens = span
    assert short.usage.completion_tokens == 3
    assert times["short"] < times["long"]  # it did not wait for the long prefill
    assert spans > 30  # the long prompt went in 16-token spans between the short one's steps


def test_a_client_that_leaves_drops_out_and_the_others_finish(engine):
    engine.hooks = SlowSteps(0.02)
    try:
        with running_server(engine, ServerConfig(max_batch=4)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)

            def leaver(_):
                body = {"model": "m", "messages": user("go on"), "max_tokens": 200, "stream": True}
                with httpx.stream("POST", base + "/v1/chat/completions", json=body) as r:
                    for n, _ in enumerate(r.iter_lines()):
                        if n == 3:
                            return "left"

            def stayer(topic):
                return client.chat.completions.create(model="m", messages=user(topic), max_tokens=12, temperature=0)

            left, *stayed = together(lambda a: leaver(a) if a is None else stayer(a), [None, *TOPICS[:2]])
            deadline = time.monotonic() + 30
            while stats(base)["requests_in_flight"]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            s = stats(base)
            again = [stayer(t) for t in TOPICS[:2]]
    finally:
        engine.hooks = StepHooks()
    assert left == "left" and s["cancelled"] == 1 and s["completed"] == 2
    assert [r.choices[0].message.content for r in stayed] == [r.choices[0].message.content for r in again]


def test_what_cannot_batch_runs_one_at_a_time_and_says_why(engine):
    with running_server(FakeEngine(), ServerConfig()) as base:
        b = stats(base)["batching"]
        assert (b["max_batch"], b["why"]) == (1, "the fake engine decodes one sequence at a time")
    with running_server(engine, ServerConfig()) as base:  # the default, from memory
        b = stats(base)["batching"]
    kv = engine.kv
    assert b["max_batch"] == min(8, 1 + kv.pool.max_bytes // kv.context_bytes)
    assert "prompt caches' memory holds" in b["why"]
    engine.batch_problem = lambda: "the reason it cannot"  # e.g. a pipeline across ranks (mlx.launch)
    try:
        with running_server(engine, ServerConfig(max_batch=4)) as base:
            b = stats(base)["batching"]
    finally:
        del engine.batch_problem
    assert (b["max_batch"], b["why"]) == (1, "the reason it cannot")


def test_a_hostile_row_never_harms_the_stream_beside_it(engine, monkeypatch):
    """A denormal temperature under a grammar, and a request whose processor raises mid-decode,
    decode beside a long stream: the stream's text is what it is alone and holds nothing of theirs;
    the denormal one is greedy (200). The raising processor stands for an internal failure of one
    request that no client can cause (a 500 is its right answer): it ends alone with its own error."""
    import edge0.server.pipeline as pipeline
    from edge0.backend.logits import LogitBias

    class Raising(LogitBias):
        calls = 0

        def __call__(self, generated, logprobs):
            type(self).calls += 1
            if type(self).calls == 3:
                raise RuntimeError("a secret of the hostile client")
            return super().__call__(generated, logprobs)

    stream_body = dict(model="m", messages=user("tell me about the sea"), max_tokens=40, temperature=0)
    denormal = dict(
        model="m",
        messages=user("json please"),
        max_tokens=12,
        temperature=1e-300,
        response_format={"type": "json_object"},
    )
    with running_server(engine, ServerConfig(max_batch=1)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        alone = client.chat.completions.create(**stream_body).choices[0].message.content
        greedy = client.chat.completions.create(**{**denormal, "temperature": 0}).choices[0].message.content
    monkeypatch.setattr(pipeline, "LogitBias", Raising)
    engine.hooks = SlowSteps(0.02)
    try:
        with running_server(engine, ServerConfig(max_batch=4)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)

            def streamed(_):
                out = []
                for chunk in client.chat.completions.create(**stream_body, stream=True):
                    out += [chunk.choices[0].delta.content or ""] if chunk.choices else []
                return "".join(out)

            def raw(body):
                return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)

            text, denormal_r, raising_r = together(
                lambda a: streamed(a) if a is None else raw(a),
                [None, denormal, dict(model="m", messages=user("hi"), max_tokens=12, logit_bias={"40": 1})],
            )
            s = stats(base)
    finally:
        engine.hooks = StepHooks()
    assert text == alone and "secret" not in text
    assert denormal_r.status_code == 200 and denormal_r.json()["choices"][0]["message"]["content"] == greedy
    assert raising_r.status_code == 500 and "a secret of the hostile client" in raising_r.text
    assert s["batching"]["most_rows"] >= 2 and s["failed"] == 1 and s["completed"] == 2


def test_the_engine_thread_has_ended_when_the_scheduler_shuts_down():
    """shutdown() waits for the engine thread: a thread that ran compiled MLX code frees its
    thread-local compile cache as it exits, which takes the GIL, and one still exiting when the
    interpreter exits aborted the process (the agent harness's flaky SIGABRT)."""
    scheduler = Scheduler(max_queue=1)
    started, threads = threading.Event(), []

    def work():
        threads.append(threading.current_thread())
        started.set()
        time.sleep(0.3)

    scheduler._executor.submit(work)
    assert started.wait(10)
    scheduler.shutdown()
    assert threads and not threads[0].is_alive()
