"""Sampled verification for a batch's rows (edge0/engine/batch.py, speculative.accept): a row that
samples plainly (temperature and top-p) drafts and is decided by the lone sequence's rule; a seeded
row's drafts and verify draws come from its own stream in the lone sequence's order, so it gets the
tokens it gets alone under the same speculator, whatever rides beside it; the rule, on a row's
padded log-probs with a seeded sampler's keys, keeps the target's distribution."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

import edge0
from edge0.engine.drafters import Draft, ModelDrafter
from edge0.engine.request import Request
from edge0.engine.sampler import RequestSampler
from edge0.engine.speculative import Speculator, accept
from tests.fixtures.make import reference_dir
from tests.test_batch import PROMPTS, Oracle


class Greedy(Oracle):
    """Drafts each prompt's plain greedy continuation (deterministic: no draft distribution); a
    sampled row leaves it, so its drafts are both kept and rejected. Its forks share the table."""

    def draft(self, context, k, temp=0.0, top_p=1.0, key=None):
        i = len(context) - self.n0
        return Draft(self.ref[i : i + k])

    def fork(self):
        return Greedy(self.continuations)


def run_batch(engine, requests: list[Request]) -> list[list[int]]:
    with engine.batching() as batch:
        seqs = [batch.join(r) for r in requests]
        while batch.busy:
            batch.advance()
    return [s.tokens for s in seqs]


@pytest.mark.parametrize("drafter", ["model", "greedy"])
def test_a_seeded_sampled_row_drafts_and_gets_what_it_gets_alone_beside_any_row(drafter, store_for):
    """A draft model samples its drafts (their distributions go to the rule, its draws to the row's
    stream); the greedy continuation is a deterministic drafter (q one-hot)."""
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    prompts = [engine.encode(p) for p in PROMPTS]
    greedy = [engine.generate(p, max_tokens=12, ignore_eos=True).tokens for p in prompts]
    if drafter == "model":  # the fixture's own mlx-lm checkpoint: its drafts are often kept
        d = ModelDrafter(reference_dir("qwen3_moe"), engine.tokenizer, "qwen3_moe")
    else:
        d = Greedy({tuple(p): g for p, g in zip(prompts, greedy)})
    engine.use_speculation(Speculator(d, num_draft=3, adaptive=False))
    sampled = Request(prompts[1], 12, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True)
    alone = engine.generate(prompts[1], max_tokens=12, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True)
    sp = alone.stats["speculation"]
    assert sp["verifies"] > 0
    # the draft model's drafts are kept (near the model itself), the greedy ones rejected too
    assert 0 < sp["accepted"] if drafter == "model" else sp["accepted"] < sp["drafted"]
    assert alone.tokens != greedy[1]  # it sampled
    # beside an unseeded sampled row with log-probs (which cannot draft and draws from the global
    # stream at every step): the drafts counted are the seeded row's alone
    noisy = Request(prompts[0], 12, temperature=1.0, logprobs=1, ignore_eos=True)
    counts = engine.batch_speculation.counts
    before = dict(counts)
    got, _ = run_batch(engine, [sampled, noisy])
    assert got == alone.tokens
    assert counts["drafted"] > before["drafted"] and counts["verifies"] > before["verifies"]
    assert counts["unsupported_requests"] == before["unsupported_requests"] + 1  # the log-probs row only
    # beside a greedy row that drafts too (rows of other widths in each verify): the same tokens,
    # and the greedy row its plain greedy tokens
    got, other = run_batch(engine, [Request(prompts[2], 8, ignore_eos=True), sampled])[::-1]
    assert got == alone.tokens and other == greedy[2][:8]
    assert counts["unsupported_requests"] == before["unsupported_requests"] + 1


def test_the_rule_on_a_rows_padded_log_probs_keeps_the_target_distribution():
    """A batch row's verify log-probs run past its draft (padding, here rows that would draw token
    0): with a seeded sampler's keys, the first token emitted follows p_0 (temperature 0.5, top-p
    0.9), through accepted and rejected drafts alike, and the draws repeat for the seed."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (2, 8)).astype(np.float32)
    pad = np.full((2, 8), -30.0, np.float32)
    pad[:, 0] = 0.0
    logprobs = mx.array(np.concatenate([logits, pad]))  # [k + 1 + 2 padding, V], k = 1
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    p1 = np.exp(logits[0].astype(np.float64) - logits[0].max())
    order = np.argsort(-p1)
    nucleus = order[
        : np.searchsorted(np.cumsum(p1[order] / p1.sum()), 0.9) + 1
    ]  # mlx-lm's top-p 0.9, before the temperature
    want = np.zeros(8)
    want[nucleus] = p1[nucleus] ** 2 / (p1[nucleus] ** 2).sum()  # temperature 0.5
    draft = Draft([int(order[1])])  # the second likeliest token: accepted sometimes, not always

    def firsts(seed: int, n: int) -> list[tuple[int, int]]:
        sampler = RequestSampler(0.5, 0.9, seed=seed)
        return [accept(sampler, draft, logprobs) for _ in range(n)]

    runs = firsts(1, 1500)
    assert runs[:50] == firsts(1, 50) and runs[:50] != firsts(2, 50)  # its own stream, by seed
    got = np.array([draft.tokens[0] if n == 1 else t for n, t in runs])
    assert 0.05 < np.mean([n for n, _ in runs]) < 0.95  # both paths of the rule ran
    counts = np.bincount(got, minlength=8)
    assert counts[want == 0].sum() == 0  # never a token outside the nucleus, never the padding's
    assert chisquare(counts[want > 0], want[want > 0] * len(got)).pvalue > 1e-3, (counts, want)
