"""Prompt-cache reuse on every kind of layer cache: a request that branches off inside the last
reply reuses the shared prefix (fewer tokens prefilled) and gives the tokens of a cold run. A
CacheList (deepseek_v32's attention and indexer caches in one layer) was not cut back before,
so a reused prefix carried the old reply's tokens: other tokens, no error."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import CacheList, KVCache

import edge0
from edge0.backend import kvcache as bkv
from tests.fixtures import ALL_FAMILIES

PROMPT = "once upon a time, a tiny model " * 10
# KV caches, a CacheList per layer, linear attention beside KV caches
SAMPLE = ("qwen3_moe", "deepseek_v32", "qwen3_next")


def test_trim_to_cuts_every_cache_of_a_cache_list_back():
    cache = [CacheList(KVCache(), KVCache()), KVCache()]
    for c in (cache[0][0], cache[0][1], cache[1]):
        z = mx.zeros((1, 2, 10, 4))
        c.update_and_fetch(z, z)
    assert bkv.trim_to(cache, 6)
    assert [c.offset for c in (cache[0][0], cache[0][1], cache[1])] == [6, 6, 6]
    assert bkv.cache_offset(cache) == 6


@pytest.mark.parametrize(
    "family", SAMPLE + tuple(pytest.param(f, marks=pytest.mark.slow) for f in ALL_FAMILIES if f not in SAMPLE)
)
def test_a_request_branching_inside_the_last_reply_reuses_the_prefix_and_gives_the_cold_tokens(family, store_for):
    store = store_for(family)
    engine = edge0.load(store, prerouter=False)
    first = engine.generate(PROMPT, max_tokens=8, ignore_eos=True, reuse_cache=True)
    shared = len(engine.encode(PROMPT)) + 3
    branch = engine.encode(PROMPT) + first.tokens[:3] + [11, 12, 13]
    floor = engine.kv.pool.newest.floor  # a chunked attention cache holds only its last chunk's worth
    got = engine.generate(branch, max_tokens=8, ignore_eos=True, reuse_cache=True)
    want = edge0.load(store, prerouter=False).generate(branch, max_tokens=8, ignore_eos=True)
    assert got.tokens == want.tokens
    # recurrent state starts again from the prompt's end (nothing to cut back); a chunked attention cache
    # is cut back only down to its floor, which the branch may be below (llama4: then nothing is reused)
    if bkv.can_trim_prompt_cache(engine.kv.make()) and shared >= floor:
        assert got.stats["prefill_tokens"] < len(branch) - 8
    elif shared < floor:
        assert got.stats["prefill_tokens"] == len(branch)


def test_a_chunked_attention_cache_is_not_cut_back_below_its_kept_chunk(store_for):
    """llama4's local layers keep only their current chunk (mlx-lm's ChunkedKVCache drops the tokens
    before it): a request sharing a prefix that ends before that chunk used to reuse the cache cut
    back there anyway, and got other tokens, no error. Now it is not reused below the first chunk
    boundary of the tokens it holds."""
    store = store_for("llama4")  # attention_chunk_size 8
    engine = edge0.load(store, prerouter=False)
    first = engine.encode("hello world the answer is 42 and then some more words")
    branch = first[:14] + engine.encode(" or so, said the tiny model")
    engine.generate(first, max_tokens=8, ignore_eos=True, reuse_cache=True)
    got = engine.generate(branch, max_tokens=8, ignore_eos=True, reuse_cache=True)
    want = edge0.load(store, prerouter=False).generate(branch, max_tokens=8, ignore_eos=True)
    assert got.tokens == want.tokens
    assert got.stats["prefill_tokens"] == len(branch)  # the kept chunk starts after the shared prefix
    cache = engine.kv.make()
    z = mx.zeros((1, 1, 20, 32))
    for c in cache:
        c.update_and_fetch(z, z)
        if hasattr(c, "maybe_trim_front"):
            c.maybe_trim_front()
    # 20 tokens, chunks of 8: the last 8 kept (12-19); a token at 12-15 would need 8-11 of its chunk
    assert bkv.trim_floor(cache) == 16 and not bkv.trim_to(cache, 15) and bkv.trim_to(cache, 16)
