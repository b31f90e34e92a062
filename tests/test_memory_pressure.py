"""Memory pressure: the expert cache shrinks to one route's worth of slots and grows back, between
generations only, with the same greedy tokens; the server's watcher does it from (injected)
memory readings and shows it in /v1/stats."""

from __future__ import annotations

import time

import httpx
import pytest

import edge0
from edge0.backend import core as B
from edge0.cache import ExpertCache, make_policy
from edge0.errors import Edge0Error
from edge0.server.config import ServerConfig
from edge0.server.memory import MemoryWatcher, default_memory_low
from tests.fake_server import running_server

PROMPT = "once upon a time there was a tiny model that read its experts from disk"


def test_cache_resize_evicts_through_the_policy():
    lru = ExpertCache(make_policy("lru", 4, 8))
    for step, route in enumerate([[0, 1], [2, 3], [1, 4]]):
        lru.access(step, route)
    assert lru.resize(2) == [2, 3] and lru.cached == {1, 4}  # least recently used first (0 went for 4)
    assert lru.access(3, [5])[2] == [1] and lru.resize(5) == [] and lru.policy.capacity == 5
    arc = ExpertCache(make_policy("arc", 6, 16))
    for step in range(40):
        arc.access(step, [step % 9, (step * 5) % 16])
    arc.resize(2)
    p = arc.policy
    assert len(arc.cached) == 2 and p.p <= 2 and len(p.t1) + len(p.b1) <= 2
    assert len(p.t1) + len(p.t2) + len(p.b1) + len(p.b2) <= 4
    for step in range(40, 60):  # still a working ARC at the new size
        arc.access(step, [step % 5])
        assert len(arc.cached) <= 2


@pytest.mark.parametrize("kw", [{}, {"cache_policy": "arc"}, {"decode_executor": "hot"}])
def test_resize_keeps_greedy_tokens_and_frees_the_slots(store_for, kw):
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False, **kw)
    info = engine.expert_cache()
    assert (info["slots_per_layer"], info["min_slots"], info["max_slots"]) == (8, 2, 8)
    want = engine.generate(PROMPT, max_tokens=24, ignore_eos=True).tokens
    engine.resize_expert_cache(7)  # the first resize in a process also allocates ~38 KB MLX keeps
    before = B.active_memory()
    engine.resize_expert_cache(2)  # the floor: one route (top-k) per layer
    freed = before - B.active_memory()
    assert freed >= 5 * info["slot_bytes"] * 0.9  # five slots per layer, as float32 scales widen a little
    assert engine.expert_cache()["budget_bytes"] == 2 * info["slot_bytes"]
    small = engine.generate(PROMPT, max_tokens=24, ignore_eos=True)
    assert small.tokens == want and small.stats["expert_bytes_read"] > 0
    for n in (5, 8, 3):
        engine.resize_expert_cache(n)
        assert engine.generate(PROMPT, max_tokens=24, ignore_eos=True).tokens == want, n
    assert engine.stats()["slots_per_layer"] == 3


def test_resize_bounds_and_never_during_a_generation(store_for):
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    for n in (1, 9):
        with pytest.raises(Edge0Error, match="from 2 .* to 8"):
            engine.resize_expert_cache(n)
    steps = engine.stream_generate(PROMPT, max_tokens=8)
    next(steps)
    with pytest.raises(Edge0Error, match="generation is in flight"):
        engine.resize_expert_cache(2)
    steps.close()
    engine.resize_expert_cache(2)
    exact = edge0.load(store_for("qwen3_moe"), decode_executor="exact")
    with pytest.raises(Edge0Error, match="no slots.*--decode-executor exact"):
        exact.resize_expert_cache(2)


class StubEngine:
    def __init__(self):
        self.info = {
            "slots_per_layer": 8,
            "configured_slots": 8,
            "min_slots": 2,
            "max_slots": 16,
            "slot_bytes": 10,
            "budget_bytes": 80,
        }

    def expert_cache(self):
        return dict(self.info)

    def resize_expert_cache(self, n):
        self.info.update(slots_per_layer=n, budget_bytes=10 * n)

    def free_prompt_caches(self, nbytes):
        return 0  # no other conversations' caches held

    def prompt_caches_held(self):
        return 0

    def restore_prompt_caches(self):
        pass


def test_watcher_targets_have_a_gap_and_stay_in_bounds():
    reading = [1000]
    w = MemoryWatcher(StubEngine(), low=100, poll_s=1, read=lambda: (reading[0], "stub"))
    assert w.high == 125
    assert (w.target(95), w.target(0), w.target(130), w.target(1000)) == (5, 2, 8, 8)
    reading[0] = 95
    w.apply()
    assert w.engine.info["slots_per_layer"] == 5 and w.shrinks == 1
    reading[0] = 130  # above low, but growing one slot would take it under high
    w.apply()
    assert w.engine.info["slots_per_layer"] == 5 and w.grows == 0
    reading[0] = 146
    w.apply()
    assert w.engine.info["slots_per_layer"] == 7 and w.grows == 1
    reading[0] = 0
    w.apply()
    w.apply()
    assert w.engine.info["slots_per_layer"] == 2 and w.low_at_floor == 1  # the second reading found it there
    assert default_memory_low(8 * 10**9) == 8 * 10**8 and default_memory_low(10**12) == 2 * 10**9


def test_server_shrinks_between_requests_and_grows_back(store_for):
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    resized_while_generating = []
    resize = engine.resize_expert_cache
    engine.resize_expert_cache = lambda n: resized_while_generating.append(engine.generating) or resize(n)
    memory = {"available": 10**12}
    config = ServerConfig(memory_low=10**6, memory_poll_s=0.02)
    with running_server(engine, config, read_memory=lambda: (memory["available"], "fake reader")) as base:

        def complete():
            r = httpx.post(
                base + "/v1/completions",
                timeout=60,
                json={"model": engine.model_id, "prompt": PROMPT, "max_tokens": 24, "temperature": 0},
            )
            return r.json()["choices"][0]["text"]

        def stats():
            return httpx.get(base + "/v1/stats").json()["memory"]

        def wait_for(predicate):
            deadline = time.monotonic() + 10
            while not predicate(stats()):
                assert time.monotonic() < deadline, stats()
                time.sleep(0.02)

        want = complete()
        assert stats()["shrinks"] == 0 and stats()["slots_per_layer"] == 8
        memory["available"] = 0
        wait_for(lambda s: s["shrinks"] == 1)
        s = stats()
        assert s["slots_per_layer"] == 2 and s["budget_bytes"] == 2 * engine.expert_cache()["slot_bytes"]
        assert s["last_reading"]["available_bytes"] == 0 and s["last_reading"]["source"] == "fake reader"
        assert complete() == want
        memory["available"] = 10**12
        wait_for(lambda s: s["grows"] == 1)
        assert stats()["slots_per_layer"] == 8 and complete() == want
        assert stats()["shrinks"] == 1 and httpx.get(base + "/v1/stats").json()["server"]["between_errors"] == 0
    assert resized_while_generating == [False, False]


def test_serve_memory_flags(monkeypatch, tmp_path, capsys):
    import json

    from edge0.cli import serve
    from edge0.server import app as server_app
    from tests.fake_engine import FakeEngine

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    monkeypatch.setattr(edge0, "load", lambda path=None, **options: FakeEngine(root=tmp_path))
    monkeypatch.setattr(serve, "memory_available", lambda: (30 * 10**9, "fake"))
    ran = {}
    monkeypatch.setattr(server_app, "run", lambda app, **kw: ran.update(app=app))
    for argv, low in [
        ([], 2 * 10**9),
        (["--memory-low", "512MB", "--memory-poll-s", "0.5"], 512 * 10**6),
        (["--memory-low", "0"], 0),
    ]:
        assert serve.main(argv) == 0
        config = ran["app"].state.config
        assert config.memory_low == low and config.memory_poll_s == (0.5 if "--memory-poll-s" in argv else 2.0)
        assert ran["app"].state.memory is None  # the fake engine has no expert slots to resize
    capsys.readouterr()
    for argv in (["--memory-low", "lots"], ["--memory-poll-s", "0"], ["--memory-poll-s", "nan"]):
        with pytest.raises(SystemExit) as e:
            serve.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.splitlines()) == 1 and argv[0] in err
