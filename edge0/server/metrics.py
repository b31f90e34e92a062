"""`GET /metrics`: the server in Prometheus' text format (prometheus_client), for a server watched
as a service. Each app has its own registry: requests by route and status (counted by the ASGI
middleware here), tokens and latencies (observed as a job's events reach its client, `observe`),
and, read at each scrape, the queue, the running rows and the engine's caches and reads."""

from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from edge0.server.generation import Finish

router = APIRouter()
# seconds: a first token after a long streamed prefill takes minutes
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """One app's registry and the metrics the request path moves."""

    def __init__(self, app_state):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "edge0_requests", "HTTP requests answered, by route and status", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter("edge0_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.cached_tokens = Counter(
            "edge0_prompt_cached_tokens", "Prompt tokens reused from a prompt cache", registry=r
        )
        self.generation_tokens = Counter("edge0_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "edge0_time_to_first_token_seconds",
            "From the request's admission to its first event with content",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "edge0_time_per_output_token_seconds",
            "Per request: seconds between its first event and its end, per later generated token",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        r.register(_Engine(app_state))


class _Engine:
    """What is read at scrape time: the scheduler's queue and rows, the prompt-cache tiers, the
    expert cache and the store's reads (the engine's and scheduler's own cumulative statistics)."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        sched, engine = self.state.scheduler, self.state.engine
        running = min(sched.admitted, sched.slots)
        yield GaugeMetricFamily("edge0_requests_running", "Requests generating now (rows)", value=running)
        yield GaugeMetricFamily("edge0_requests_waiting", "Requests queued behind them", value=sched.admitted - running)
        done = CounterMetricFamily("edge0_generations", "Generations ended, by outcome", labels=["outcome"])
        for outcome, n in sched.counters.items():
            done.add_metric([outcome], n)
        yield done
        stats = engine.stats()
        totals = stats.get("totals")
        if totals is not None:  # a streaming engine (the tests' fake engines have none)
            yield _counter("edge0_expert_cache_hits", "Expert lookups served from the cache", totals["hits"])
            yield _counter("edge0_expert_cache_misses", "Expert lookups read from the store", totals["misses"])
            yield _counter("edge0_expert_bytes_read", "Expert bytes read from the store", totals["bytes_read"])
            yield _counter("edge0_stall_seconds", "Time compute waited for expert reads", totals["stall_ms"] / 1000)
            yield _counter("edge0_decode_steps", "Decode steps", stats["decode_steps"])
        caches = stats.get("prompt_cache")
        if caches is not None:
            yield from _prompt_caches(caches)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _prompt_caches(caches: dict):
    """Hits, misses and bytes of each prompt-cache tier: memory (the pool) and disk (--prompt-cache-dir)."""
    hits = CounterMetricFamily("edge0_prompt_cache_hits", "Prompt-cache lookups that reused a prefix", labels=["tier"])
    misses = CounterMetricFamily("edge0_prompt_cache_misses", "Prompt-cache lookups that found none", labels=["tier"])
    size = GaugeMetricFamily("edge0_prompt_cache_bytes", "Bytes a prompt-cache tier holds", labels=["tier"])
    if (pool := caches.get("memory")) is not None:
        hits.add_metric(["memory"], pool["hits"])
        misses.add_metric(["memory"], pool["misses"])
        size.add_metric(["memory"], pool["bytes"])
    disk = caches.get("dir") is not None
    if disk:  # the disk tier counts what it restored and saved; a lookup it did not answer is the pool's miss
        hits.add_metric(["disk"], caches["restored"])
        size.add_metric(["disk"], caches["bytes"])
    yield from (hits, misses, size)
    if disk:
        yield _counter("edge0_prompt_cache_disk_saved", "Prompt caches saved to --prompt-cache-dir", caches["saved"])
        yield _counter("edge0_prompt_cache_disk_damaged", "Saved prompt caches found damaged", caches["damaged"])
    yield GaugeMetricFamily(
        "edge0_prompt_cache_working_tokens",
        "Tokens the newest prompt cache (the last request's) holds",
        value=caches["tokens"],
    )


async def observe(metrics: Metrics, events: AsyncIterator, admitted: float) -> AsyncIterator:
    """`events` (a job's) as they are, observing the time to the first one, the time per later
    token and the token counts at the Finish."""
    first = None
    async for event in events:
        now = time.monotonic()
        if isinstance(event, Finish):
            u = event.usage
            metrics.prompt_tokens.inc(u.prompt_tokens)
            metrics.cached_tokens.inc(u.cached_tokens)
            metrics.generation_tokens.inc(u.completion_tokens)
            if first is None and u.completion_tokens:  # everything came at the end (a held tool call)
                first = now
                metrics.ttft.observe(now - admitted)
            if first is not None and u.completion_tokens > 1:
                metrics.tpot.observe((now - first) / (u.completion_tokens - 1))
        elif first is None:
            first = now
            metrics.ttft.observe(now - admitted)
        yield event


class CountRequests:
    """ASGI middleware: each HTTP response counted by its route's path template (`unmatched` for
    none, so a scan of random paths cannot grow the label set) and status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def sent(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route, str(status[0]) if status else "none").inc()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus' text format (docs/server.md, "Metrics")."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
