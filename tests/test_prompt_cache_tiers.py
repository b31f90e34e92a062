"""The prompt caches' two verbs (engine/kv.py `checkout` / `checkin`) on hand-made one-layer KV
caches, no model: the newest entry sits outside the pool's bound and is found at any shared
length; older ones are found by 64-token blocks, evicted least recently used first, and a memory
watcher's `evict` and a batch's `lend` lower the bound."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from edge0.backend.kvcache import cache_offset, prompt_cache_nbytes
from edge0.engine.kv import PromptCache

HEADS, DIM = 2, 8  # one layer: keys and values [1, 2, T, 8] float32, allocated 256 tokens at a time


class _Caches(PromptCache):
    """PromptCache over one-layer caches (the model is only asked for new caches)."""

    def __init__(self, max_bytes: int):
        super().__init__(model=None)
        self.use_pool(max_bytes, "test")

    def make(self) -> list:
        return [KVCache()]


def _filled(tokens: list[int]) -> list:
    """A cache holding `tokens`, each position's keys set to its token id (to check what a trim kept)."""
    c = KVCache()
    t = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1)
    kv = mx.broadcast_to(t, (1, HEADS, len(tokens), DIM))
    c.update_and_fetch(kv, kv)
    mx.eval(c.state)
    return [c]


def _ids(cache) -> list[int]:
    c = cache[0]
    return [int(v) for v in c.keys[0, 0, : c.offset, 0].tolist()]


def conv(seed: int, n: int) -> list[int]:
    return [(seed * 97 + 13 * i) % 1000 + 1 for i in range(n)]


def test_the_newest_is_found_at_any_shared_length_and_continues_in_place():
    kv = _Caches(0)  # no memory beside the newest: "the last only"
    a = conv(1, 40)
    kv.checkin(a, _filled(a), prompt_end=30)
    cache, held, receipt = kv.checkout(a[:20] + [7, 8, 9])  # shares 20 tokens, under one block
    assert (held, receipt) == (20, None) and _ids(cache) == a[:20] and cache_offset(cache) == 20
    assert kv.newest is None  # taken itself: a bound of 0 could not keep it beside the request
    cache, held, _ = kv.checkout(a + [1])
    assert held == 0 and cache_offset(cache) == 0  # nothing left to reuse
    assert kv.pool.stats()["misses"] == 1 and kv.pool.stats()["hits"] == 1


def test_a_branch_inside_another_conversation_gets_a_copy_and_older_ones_leave_first():
    a, b, c = conv(1, 200), conv(2, 200), conv(3, 200)
    one = prompt_cache_nbytes(_filled(a))
    kv = _Caches(int(1.5 * one))  # room for one conversation beside the newest
    for tokens in (a, b, c):
        kv.checkin(tokens, _filled(tokens), prompt_end=len(tokens))
    # c is the newest (outside the bound), b under it, a evicted (no disk tier: dropped)
    s = kv.pool.stats()
    assert s["entries"] == 1 and s["bytes"] == one and s["evicted"] == 1
    assert kv.newest.tokens == c
    cache, held, _ = kv.checkout(b[:130] + [5])  # a subagent sharing b's first 130 tokens
    assert held == 130 and _ids(cache) == b[:130] and kv.pool.stats()["copies"] == 1
    again, held, _ = kv.checkout(b + [6])  # b itself was not written: its next turn has all of it
    assert held == 200 and _ids(again) == b and kv.pool.stats()["entries"] == 0
    assert kv.checkout(a + [1])[1] == 0  # a was evicted


def test_evict_and_lend_lower_the_bound_and_give_it_back():
    a, b, c = conv(1, 100), conv(2, 100), conv(3, 100)
    one = prompt_cache_nbytes(_filled(a))
    kv = _Caches(10 * one)
    for tokens in (a, b, c):
        kv.checkin(tokens, _filled(tokens), prompt_end=len(tokens))
    assert kv.pool.stats()["entries"] == 2
    freed = kv.evict(one + 1)  # memory pressure: the least recently used first, until it is freed
    assert freed == 2 * one and kv.pool.stats()["entries"] == 0 and kv.newest.tokens == c
    kv.restore_bound()
    assert kv.pool.max_bytes == 10 * one
    kv.lend(9 * one)  # a batch holds nine contexts' worth: one conversation fits beside it
    for tokens in (a, b, c):
        kv.checkin(tokens, _filled(tokens), prompt_end=len(tokens))
    assert kv.pool.max_bytes == one and kv.pool.stats()["entries"] == 1
    kv.lend(0)
    assert kv.pool.max_bytes == 10 * one


def test_namespaces_never_meet_and_a_reuse_free_checkout_takes_nothing():
    a = conv(1, 100)
    kv = _Caches(1 << 20)
    kv.checkin(a, _filled(a), prompt_end=100, namespace="salt-a")
    assert kv.checkout(a + [1], namespace="salt-b")[1] == 0
    assert kv.checkout(a + [1], reuse=False)[1] == 0 and kv.newest.tokens == a
    cache, held, _ = kv.checkout(a + [1], namespace="salt-a")
    assert held == 100 and _ids(cache) == a
    kv.drop_newest()
    assert kv.newest is None
