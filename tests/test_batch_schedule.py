"""When sequences of a batch get their turn (edge0/engine/batch.py): each step's token budget
goes to the rows' decode tokens, then to the waiting prompts, shortest first; a sequence alone
takes its whole span and gives way to a newcomer; the tokens stay those each gets alone."""

from __future__ import annotations

import edge0
from edge0.engine.request import Request
from tests.test_batch import LONG, PROMPTS, run


def test_sequences_that_join_between_steps_get_the_tokens_they_get_alone(store_for):
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    engine.prefiller.span_tokens = 8
    prompts, limits = [PROMPTS[0], LONG, PROMPTS[1]], [40, 6, 20]
    alone = [engine.generate(p, max_tokens=m, ignore_eos=True).tokens for p, m in zip(prompts, limits)]
    tok = [engine.encode(p) for p in prompts]
    with engine.batching() as batch:  # the first decodes while the others prefill, the short one first
        joins = {n: [Request(tok[i], limits[i], ignore_eos=True)] for i, n in enumerate([0, 2, 4])}
        seqs, steps, firsts = run(batch, joins)
        assert batch.counts["most_rows"] == 3 and batch.counts["spans"] > len(tok[1]) // 8
    assert [s.tokens for s in seqs.values()] == alone
    # the short third prompt joined during the long one's prefill and started before it
    assert firsts == [seqs[0], seqs[2], seqs[1]]
    last = steps[id(seqs[1])][-1]
    assert last.finish_reason == "length" and last.stats["prefill_tokens"] == len(tok[1])


def test_a_long_span_alone_gives_way_to_a_newcomer_and_the_tokens_stay_the_same(store_for, monkeypatch):
    from edge0.engine import batch as batch_module

    monkeypatch.setattr(batch_module, "STEP_TOKENS", 16)  # a step's budget with others in the batch
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    engine.prefiller.span_tokens = 1000  # alone: the whole prompt in one span
    prompts = [LONG, PROMPTS[0]]
    alone = [engine.generate(p, max_tokens=5, ignore_eos=True).tokens for p in prompts]
    checks = []
    with engine.batching() as batch:
        batch.interrupt = lambda: checks.append(1) or len(checks) == 3  # a newcomer, during the span
        long = batch.join(Request(engine.encode(LONG), 5, ignore_eos=True))
        assert batch.advance() == [] and long.fed == 0  # the span was dropped
        # alone, it ran in its own cache (engine/solo.py): cut back to where it began
        assert batch.counts["spans_dropped"] == 1 and not bkv_offset(long.cache)
        short = batch.join(Request(engine.encode(PROMPTS[0]), 5, ignore_eos=True))
        firsts = []
        while batch.busy:
            firsts += [s for s, _ in batch.advance() if s not in firsts]
        assert firsts == [short, long]  # the newcomer went first
        assert batch.counts["spans"] > 2  # the long one in 16-token spans while the short one ran
    assert [long.tokens, short.tokens] == alone


def bkv_offset(cache) -> int:
    return max(c.offset for c in cache)


def test_a_step_spends_its_token_budget_over_every_waiting_sequence(store_for, monkeypatch):
    """One step's budget (STEP_TOKENS) goes to the rows' decode tokens and then to the waiting
    prompts, fewest tokens left first, several in one step; a smaller budget spreads them over
    more steps, with the same tokens."""
    from edge0.engine import batch as batch_module

    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    tok = [engine.encode(p) for p in PROMPTS]
    alone = [engine.generate(t, max_tokens=6, ignore_eos=True).tokens for t in tok]
    with engine.batching() as batch:
        seqs = [batch.join(Request(t, 6, ignore_eos=True)) for t in tok]
        made = batch.advance()  # every prompt in one step, then the first decode step of all three
        assert len(batch.rows) == 3 and batch.counts["spans"] == 3 and [s for s, _ in made] == seqs
        while batch.busy:
            batch.advance()
    assert [s.tokens for s in seqs] == alone
    monkeypatch.setattr(batch_module, "STEP_TOKENS", 12)
    with engine.batching() as batch:
        seqs = [batch.join(Request(t, 6, ignore_eos=True)) for t in tok]
        made = batch.advance()
        # the shortest prompt whole (all but its last token) and its first token; the next one
        # does not fit the rest of the budget, so it waits for the next step
        assert [s.fed for s in seqs] == [len(tok[0]) - 1, 0, 0] and [s for s, _ in made] == seqs[:1]
        batch.advance()  # one decode token, then 11 prompt tokens of the next one
        assert [s.fed for s in seqs] == [len(tok[0]) - 1, min(11, len(tok[1]) - 1), 0]
        while batch.busy:
            batch.advance()
    assert [s.tokens for s in seqs] == alone


def test_a_newcomer_arriving_as_the_lone_prompt_completes_waits_for_its_first_token(store_for):
    """The lone prompt's last token goes in its span (engine/solo.py): a request that arrives just
    as that span completes joins after the lone sequence's first token, so the prompt's last
    token is never fed twice."""
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    prompts = [LONG, PROMPTS[0]]
    alone = [engine.generate(p, max_tokens=5, ignore_eos=True).tokens for p in prompts]
    with engine.batching() as batch:
        long = batch.join(Request(engine.encode(LONG), 5, ignore_eos=True))
        batch.interrupt = lambda: long.first is not None  # true from the moment its whole prompt is in
        assert [s for s, _ in batch.advance()] == [long] and long.fed == len(long.prompt)
        short = batch.join(Request(engine.encode(PROMPTS[0]), 5, ignore_eos=True))
        batch.interrupt = None
        while batch.busy:
            batch.advance()
    assert [long.tokens, short.tokens] == alone
