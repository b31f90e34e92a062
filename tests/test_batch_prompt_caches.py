"""A batch's sequences and the prompt caches (edge0/engine/batch.py, kv.py): a conversation
continues from its cached prefix in a batch, and a model whose cache cannot be cut back resumes
from the end of its prompt."""

from __future__ import annotations

import edge0
from edge0.backend.kvcache import prompt_cache_nbytes
from edge0.engine.request import Request
from tests.test_batch import LONG, PROMPTS


def test_a_conversation_continues_from_its_cached_prefix_in_a_batch(store_for):
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False, prompt_cache_memory=5 << 20)
    first = engine.encode(LONG)
    with engine.batching() as batch:
        a = batch.join(Request(first, 5, reuse=True, ignore_eos=True))
        b = batch.join(Request(engine.encode(PROMPTS[1]), 5, reuse=True, ignore_eos=True))
        # the budget counts one sequence's KV (here: none); the batch's comes out of the pool's share
        context, engine.kv.context_bytes = engine.kv.context_bytes, 0
        batch.advance()
        held = prompt_cache_nbytes(batch.cache) + sum(prompt_cache_nbytes(s.cache) for s in batch.waiting)
        assert held > 0 and engine.kv.pool.max_bytes == (5 << 20) - held
        while batch.busy:
            batch.advance()
        engine.kv.context_bytes = context
    assert engine.kv.pool.max_bytes == 5 << 20
    follow = first + a.tokens + engine.encode(" and then")
    expected = engine.generate(follow, max_tokens=5, ignore_eos=True, reuse_cache=False).tokens  # takes no cache
    with engine.batching() as batch:
        c = batch.join(Request(follow, 5, reuse=True, ignore_eos=True))
        while batch.busy:
            made = batch.advance()
    assert c.tokens == expected and b.tokens
    assert c.held == len(first) + len(a.tokens) - 1  # its prompt and reply but the last token
    assert made[-1][1].stats["prefill_tokens"] == len(follow) - c.held


def test_a_model_that_cannot_trim_its_cache_resumes_from_the_end_of_its_prompt_in_a_batch(store_for):
    store = store_for("qwen3_5_moe")  # gated-delta linear attention: recurrent state
    engine = edge0.load(store, dtype="float32", prerouter=False, prompt_cache_memory="64MB")
    conv, other = engine.encode(LONG), engine.encode(PROMPTS[1] * 3)

    def batch_of(*prompts):
        with engine.batching() as batch:
            seqs = [batch.join(Request(p, 4, reuse=True, ignore_eos=True)) for p in prompts]
            while batch.busy:
                batch.advance()
        return seqs

    first, _ = batch_of(conv, other)
    # the client sends the reply back rendered its own way (one token differs), then a turn
    follow = conv + [first.tokens[0] + 1] + first.tokens[1:] + engine.encode(" and then")
    (again,) = batch_of(follow)
    assert again.held == len(conv)  # from the copy made at the end of its prompt, not from zero
    engine.kv.pool.clear()
    engine.reset_cache()
    assert again.tokens == engine.generate(follow, max_tokens=4, ignore_eos=True).tokens
