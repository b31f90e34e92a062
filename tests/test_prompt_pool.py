"""The KV caches of many conversations in memory (engine/kvpool.py, engine/kv.py): an agent
session's interleaved conversations each reuse their own prefix, with the same next-token
log-probs as a cold run; the pool is bounded in bytes (least recently used out first); a request
never writes into a cache another conversation keeps; a model whose cache cannot be trimmed (linear
attention) resumes the next turn from its end-of-prompt snapshot."""

from __future__ import annotations

import numpy as np
import pytest

import edge0
from edge0.backend import kvcache as bkv


def _tokens(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 250, n)]


def _run(engine, prompt, n=4):
    """Greedy tokens, the top log-probs of each step, and how many prompt tokens were prefilled."""
    steps = list(engine.stream_generate(prompt, max_tokens=n, reuse_cache=True, logprobs=5, ignore_eos=True))
    return [s.token for s in steps], [s.top_logprobs for s in steps], steps[-1].stats["prefill_tokens"]


def _same(a, b):
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        assert [t for t, _ in x] == [t for t, _ in y]
        assert np.allclose([v for _, v in x], [v for _, v in y], atol=1e-4)


@pytest.fixture(scope="module")
def engines(store_for):
    store = store_for("qwen3_moe")
    pooled = edge0.load(store, dtype="float32", prerouter=False, prompt_cache_memory="64MB")
    cold = edge0.load(store, dtype="float32", prerouter=False, prompt_cache_memory=0)
    return pooled, cold


def _cold(cold, prompt, n=4):
    cold.reset_cache()
    return _run(cold, prompt, n)


def test_interleaved_conversations_each_reuse_their_prefix_and_match_a_cold_run(engines):
    pooled, cold = engines
    pooled.reset_cache()
    main, side, sub = _tokens(1, 400), _tokens(2, 90), _tokens(3, 300)
    turns = []
    for turn in range(3):  # a main thread growing turn by turn, a side request and a subagent beside it
        for name, conv in (("main", main), ("side", side), ("sub", sub)):
            got = _run(pooled, conv)
            _same(got, _cold(cold, conv))
            turns.append((name, turn, got[2], len(conv)))
            conv += got[0] + _tokens(10 * turn + len(name), 30)  # the reply, then the next user turn
    first = {name: prefilled for name, turn, prefilled, _ in turns if turn == 0}
    later = [(name, prefilled) for name, turn, prefilled, _ in turns if turn > 0]
    assert first == {"main": 400, "side": 90, "sub": 300}  # nothing shared yet
    # later turns prefill the reply's last token (generated, never fed) and the new turn only
    assert all(prefilled == 31 for _, prefilled in later), later
    stats = pooled.kv.stats()["memory"]
    assert stats["entries"] == 2 and stats["evicted"] == 0 and stats["hits"] >= 6


def test_a_branch_gets_a_copy_and_the_conversation_it_left_keeps_its_cache(engines):
    pooled, cold = engines
    pooled.reset_cache()
    main = _tokens(4, 300)
    first = _run(pooled, main)
    pooled_entry_tokens = list(pooled.kv.newest.tokens)
    branch = main[:200] + _tokens(5, 20)  # a subagent sharing the first 200 tokens
    got = _run(pooled, branch)
    assert got[2] == 20 and pooled.kv.stats()["memory"]["copies"] >= 1
    _same(got, _cold(cold, branch))
    # the main thread's cache was not written by the branch: its next turn reuses all of it
    follow = main + first[0] + _tokens(6, 10)
    again = _run(pooled, follow)
    assert again[2] == len(follow) - (len(pooled_entry_tokens))
    _same(again, _cold(cold, follow))


def test_the_pool_is_bounded_in_bytes_and_drops_the_least_recently_used(store_for):
    store = store_for("qwen3_moe")
    probe = edge0.load(store, dtype="float32", prerouter=False)
    _run(probe, _tokens(7, 300))
    one = bkv.prompt_cache_nbytes(probe.kv.newest.cache)
    engine = edge0.load(store, dtype="float32", prerouter=False, prompt_cache_memory=int(2.5 * one))
    a, b, c = _tokens(7, 300), _tokens(8, 300), _tokens(9, 300)
    for conv in (a, b, c, _tokens(10, 300)):  # the fourth parks c; a goes (b and c fit)
        _run(engine, conv)
    stats = engine.kv.stats()["memory"]
    assert stats["entries"] == 2 and stats["evicted"] == 1 and stats["bytes"] <= int(2.5 * one)
    assert _run(engine, b + [5])[2] == 1  # b is still there (its reply's tail trimmed off)
    assert _run(engine, a)[2] == 300  # a was evicted: prefilled again


def test_a_model_that_cannot_trim_its_cache_resumes_from_the_end_of_its_prompt(store_for):
    store = store_for("qwen3_5_moe")  # gated-delta linear attention: recurrent state
    engine = edge0.load(store, dtype="float32", prerouter=False, prompt_cache_memory="64MB")
    cold = edge0.load(store, dtype="float32", prerouter=False, prompt_cache_memory=0)
    conv = _tokens(11, 200)
    first = _run(engine, conv)
    other = _run(engine, _tokens(12, 150))  # another conversation in between
    assert other[2] == 150
    # the client sends the reply back rendered its own way (here: one token differs), then a turn
    follow = conv + [first[0][0] + 1] + first[0][1:] + _tokens(13, 20)
    got = _run(engine, follow)
    assert got[2] == len(follow) - len(conv)  # from the end-of-prompt snapshot, not from zero
    _same(got, _cold(cold, follow))


def test_memory_pressure_moves_other_conversations_out_before_the_expert_cache_shrinks(engines):
    from edge0.server.memory import MemoryWatcher

    pooled, _ = engines
    pooled.reset_cache()
    pooled.kv.pool.clear()
    for seed in (20, 21, 22):
        _run(pooled, _tokens(seed, 200))
    held = pooled.kv.pool.bytes
    assert held > 0 and len(pooled.kv.pool) == 2
    slots = pooled.expert_cache()["slots_per_layer"]
    readings = iter([(1 << 20, "test: low"), (1 << 40, "test: freed")])  # low, then enough once freed
    watcher = MemoryWatcher(pooled, low=64 << 20, read=lambda: next(readings))
    evicted = pooled.kv.stats()["memory"]["evicted"]
    watcher.apply()
    # out of memory (with a disk tier they would wait there for it): the newest stays, outside the bound
    assert pooled.kv.pool.bytes == 0 and pooled.kv.stats()["memory"]["evicted"] == evicted + 2 and pooled.kv.newest
    assert pooled.expert_cache()["slots_per_layer"] == slots  # the expert cache did not need to shrink
    assert watcher.stats()["prompt_cache_frees"] == 1 and pooled.kv.pool.max_bytes < pooled.kv.pool.configured_bytes
    pooled.restore_prompt_caches()
    assert pooled.kv.pool.max_bytes == pooled.kv.pool.configured_bytes


def test_a_restarted_engine_resumes_every_conversation_from_disk_after_a_flush(store_for, tmp_path):
    store = store_for("qwen3_moe")
    first = edge0.load(store, dtype="float32", prerouter=False, prompt_cache_dir=tmp_path, prompt_cache_memory="64MB")
    convs = [_tokens(30 + i, 150 + 40 * i) for i in range(3)]
    for conv in convs:  # as the server runs them: closed at the last step, nothing saved yet
        steps = first.stream_generate(conv, max_tokens=4, reuse_cache=True, ignore_eos=True)
        while next(steps).finish_reason is None:
            pass
        steps.close()
    assert first.kv.stats()["saved"] == 0
    assert first.flush_prompt_caches() == 3  # the working cache and the two in the pool
    restarted = edge0.load(store, dtype="float32", prerouter=False, prompt_cache_dir=tmp_path)
    for conv in convs:
        follow = conv + [7, 8, 9]
        assert _run(restarted, follow)[2] <= 4  # restored from disk: the new tokens and the reply's last


def _prefilled(engine, prompt, namespace="", batch=False):
    """Prompt tokens prefilled for `prompt` in `namespace`, alone or as a batch of one."""
    if not batch:
        steps = list(
            engine.stream_generate(prompt, max_tokens=2, reuse_cache=True, cache_namespace=namespace, ignore_eos=True)
        )
        return steps[-1].stats["prefill_tokens"]
    from edge0.engine.request import Request

    with engine.batching() as b:
        seq = b.join(Request(prompt, 2, reuse=True, namespace=namespace, ignore_eos=True))
        while b.busy:
            b.advance()
    return len(prompt) - seq.held


@pytest.mark.parametrize("batch", [False, True])
def test_namespaces_never_share_a_cached_prefix(engines, batch):
    """Two clients with different cache salts share a system prompt: the second prefills all of it
    (in the working cache, the pool and a batch alike); the same namespace again reuses it."""
    pooled, _ = engines
    pooled.reset_cache()
    pooled.kv.pool.clear()
    system = _tokens(7, 200)
    a, b = system + _tokens(8, 20), system + _tokens(9, 20)
    assert _prefilled(pooled, a, "salt-a", batch) == len(a)
    assert _prefilled(pooled, b, "salt-b", batch) == len(b)  # not the working cache of salt-a
    assert _prefilled(pooled, b + [5], "", batch) == len(b) + 1  # nor salt-b's, for the default namespace
    assert _prefilled(pooled, a + [5], "salt-a", batch) == 1  # its own, from the pool
    assert _prefilled(pooled, b + [5, 6], "salt-b", batch) == 2
