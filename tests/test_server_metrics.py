"""`GET /metrics` (edge0/server/metrics.py), scraped with prometheus_client's own text parser: the
counters move with the requests, the latency histograms fill, the key guards it, and on the real
engine the expert cache and the reads are there."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge0.server.config import ServerConfig
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server

KEY = "sk-metrics"
AUTH = {"Authorization": f"Bearer {KEY}"}


def scrape(base: str, headers=AUTH) -> dict:
    """{(name, labels as a sorted tuple): value} of every sample."""
    r = httpx.get(base + "/metrics", headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine()
    with running_server(engine, ServerConfig(api_key=KEY)) as base:
        yield engine, base


def test_the_counters_move_with_requests(served):
    engine, base = served
    before = scrape(base)
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=5)
    list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[], max_tokens=5)
    httpx.get(base + "/no/such/path")
    after = scrape(base)
    route = "/v1/chat/completions"
    assert (
        value(after, "edge0_requests_total", route=route, status="200")
        - value(before, "edge0_requests_total", route=route, status="200")
        == 2
    )
    assert (
        value(after, "edge0_requests_total", route=route, status="400")
        == value(before, "edge0_requests_total", route=route, status="400") + 1
    )
    assert value(after, "edge0_requests_total", route="unmatched", status="404") >= 1
    prompt = value(after, "edge0_prompt_tokens_total") - value(before, "edge0_prompt_tokens_total")
    assert prompt == r.usage.prompt_tokens + len(engine.calls[-1].prompt)
    generated = value(after, "edge0_generation_tokens_total") - value(before, "edge0_generation_tokens_total")
    assert generated == r.usage.completion_tokens + engine.calls[-1].steps
    ttft = value(after, "edge0_time_to_first_token_seconds_count") - value(
        before, "edge0_time_to_first_token_seconds_count"
    )
    assert ttft == 2 and value(after, "edge0_time_to_first_token_seconds_sum") > 0
    assert value(after, "edge0_time_per_output_token_seconds_count") >= 2
    assert value(after, "edge0_generations_total", outcome="completed") >= 2
    assert value(after, "edge0_requests_running") == value(after, "edge0_requests_waiting") == 0


def test_the_key_guards_the_metrics(served):
    _, base = served
    assert httpx.get(base + "/metrics").status_code == 401
    assert httpx.get(base + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_the_real_engine_reports_its_caches_and_reads(store_for):
    import edge0

    engine = edge0.load(store_for("qwen3_moe"))
    with running_server(engine, ServerConfig()) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        kwargs = dict(
            model=engine.model_id, messages=[{"role": "user", "content": "hello world"}], max_tokens=4, temperature=0
        )
        client.chat.completions.create(**kwargs)
        samples = scrape(base, headers={})
    totals = engine.stats()["totals"]
    assert value(samples, "edge0_expert_cache_hits_total") == totals["hits"]
    assert value(samples, "edge0_expert_cache_misses_total") == totals["misses"] > 0
    assert value(samples, "edge0_expert_bytes_read_total") == totals["bytes_read"] > 0
    assert value(samples, "edge0_decode_steps_total") >= 3
    pool = engine.stats()["prompt_cache"]["memory"]
    assert value(samples, "edge0_prompt_cache_misses_total", tier="memory") == pool["misses"] >= 1
