"""Several sequences decoded together (edge0/engine/batch.py): each sequence of a batch gets the
greedy tokens it gets alone, in every family mlx-lm batches and with every executor; a batched
step reads each expert of its union once; sequences leave the batch as they end; what cannot
batch is refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest

import edge0
from edge0.backend import kvcache as bkv
from edge0.engine import StepHooks
from edge0.engine.drafters import Draft, Drafter
from edge0.engine.request import Request
from edge0.engine.sampler import RequestSampler
from edge0.engine.speculative import Speculator
from edge0.errors import Edge0Error
from tests.fixtures import ALL_FAMILIES
from tests.fixtures.families import SPECD

PROMPTS = [
    "once upon a time",
    "the quick brown fox jumps over the lazy dog and then",
    "a tiny model that reads its experts from disk, token by token, layer by layer",
]
# the first sequence leaves first (row 0 of 3), then the second (row 0 of 2, not its index 1)
LIMITS = [3, 6, 8]
# mlx-lm has no batched form of these caches (its BatchGenerator refuses them too)
NOT_BATCHED = {"deepseek_v41": "LayerCache", "llama4": "ChunkedKVCache"}
# mlx-lm's attention in these takes no QuantizedKVCache (latent attention, attention sinks, ...):
# --kv-bits is refused at load
NO_QUANTIZED_KV = {
    "bailing_hybrid",
    "bailing_moe_v3",
    "deepseek_v3",
    "glm4_moe_lite",
    "gpt_oss",
    "kimi_k25",
    "kimi_k3",
    "kimi_linear",
    "kimi_vl",
    "mistral3",
    "mistral4",
    "phixtral",
}
# mlx-lm's dbrx block runs its experts token by token: a batch's tokens reach the executor one at a time
PER_TOKEN_MOE = {"dbrx"}


class Oracle(Drafter):
    """Drafts each prompt's known greedy continuation, every third token wrong (so drafts are both
    kept and rejected); its forks share the continuations."""

    def __init__(self, continuations: dict):
        self.continuations, self.n0, self.ref = continuations, 0, []

    def start(self, prompt):
        self.n0, self.ref = len(prompt), self.continuations[tuple(prompt)]

    def draft(self, context, k, temp=0.0, top_p=1.0, key=None):
        i = len(context) - self.n0
        return Draft([t + (j % 3 == 2) for j, t in enumerate(self.ref[i : i + k])])

    def fork(self):
        return Oracle(self.continuations)


def alone_and_batched(engine, results=False):
    alone = [engine.generate(p, max_tokens=m, ignore_eos=True) for p, m in zip(PROMPTS, LIMITS)]
    batched = engine.generate_batch(PROMPTS, max_tokens=LIMITS, ignore_eos=True)
    return (alone if results else [r.tokens for r in alone]), batched


@pytest.mark.parametrize(
    "family",
    [f for f in SPECD]
    + [pytest.param(f, marks=pytest.mark.slow) for f in ALL_FAMILIES if f not in SPECD and f not in NOT_BATCHED],
)
def test_each_sequence_of_a_batch_gets_the_tokens_it_gets_alone(family, store_for):
    engine = edge0.load(store_for(family), prerouter=False)
    alone, batched = alone_and_batched(engine, results=True)
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert [r.text for r in batched] == [r.text for r in alone]  # control tokens hidden alike
    assert [r.finish_reason for r in batched] == ["length"] * 3
    b = batched[0].stats["batch"]
    assert (b["batch_size"], b["batch_steps"], b["generated_tokens"]) == (3, 8, 17)
    if family in PER_TOKEN_MOE:
        assert b["multi_routes"] == 0
    else:  # 3 steps of 3 rows, 3 of 2; the last 2 steps have one row (not a batched call)
        assert b["multi_routes"] > 0 and b["multi_routes"] % 15 == 0 and b["multi_union"] <= b["multi_routes"]
    # speculating: rows draft and one step verifies them all (where every layer's rows can drop tokens)
    oracle = Oracle({tuple(engine.encode(p)): r.tokens for p, r in zip(PROMPTS, alone)})
    engine.use_speculation(Speculator(oracle, num_draft=3, adaptive=False))
    drafted = engine.generate_batch(PROMPTS, max_tokens=LIMITS, ignore_eos=True)
    assert [r.tokens for r in drafted] == [r.tokens for r in alone]
    spec = engine.stats()["batch_speculation"]
    if bkv.rows_can_drop_tails(engine.kv.make()):
        assert spec["verifies"] > 0 and 0 < spec["accepted"] < spec["drafted"]
    else:
        assert spec["verifies"] == 0 and spec["unsupported_requests"] == 3
    # --kv-bits: the quantized layers' rows batch as our BatchQuantizedKVCache
    if family in NO_QUANTIZED_KV:
        with pytest.raises(Edge0Error, match=r"--kv-bits: \w+'s attention in mlx-lm does not take a quantized"):
            edge0.load(store_for(family), prerouter=False, kv_bits=8, kv_group_size=32)
        return
    quantized = edge0.load(store_for(family), prerouter=False, kv_bits=8, kv_group_size=32)
    alone_q, batched_q = alone_and_batched(quantized)
    assert [r.tokens for r in batched_q] == alone_q


@pytest.mark.parametrize("family,cache", sorted(NOT_BATCHED.items()))
def test_a_family_mlx_lm_cannot_batch_is_refused_with_the_reason(family, cache, store_for):
    engine = edge0.load(store_for(family), prerouter=False)
    with pytest.raises(Edge0Error, match=f"generate_batch: {family}.*{cache} layers have no batched form"):
        engine.generate_batch(PROMPTS, max_tokens=2)


@pytest.mark.parametrize("executors", ["exact", "hot", "staged-small"])
def test_every_executor_batches_token_identically(executors, store_for):
    store = store_for("qwen3_moe")
    kw = {"decode_executor": executors} if executors != "staged-small" else {}
    if executors == "staged-small":  # top-k + 1 slots: a batch's union overflows them
        probe = edge0.load(store, decode_executor="exact")
        per_slot = sum(probe.store.expert_nbytes(l) for l in probe.store.layers)
        kw = {"expert_cache": (probe.spec.top_k + 1) * per_slot}
        probe.close()
    engine = edge0.load(store, prerouter=False, **kw)
    alone, batched = alone_and_batched(engine)
    assert [r.tokens for r in batched] == alone
    if executors == "staged-small":
        assert engine.stats()["totals"]["fallbacks"] > 0


class BatchReads(StepHooks):
    """Per batched step: each layer's route (the observer's [B, K] indices) and the expert loads
    and bytes it read during the step."""

    def __init__(self, engine):
        self.steps, self.before, self.routes, self.layers = [], None, {}, engine.streaming.stats.layers

    def observe(self, layer, inds, _scores):
        if self.before is not None:
            self.routes[layer] = inds

    def rows(self, step, previous):
        self.before = {l: (s.loads, s.bytes_read) for l, s in self.layers.items()}

    def step_done(self, step):
        if self.before is not None:
            now = self.layers
            reads = {l: (now[l].loads - a, now[l].bytes_read - b) for l, (a, b) in self.before.items()}
            self.steps.append((self.routes, reads))
            self.before, self.routes = None, {}


def test_a_batched_step_reads_each_expert_of_its_union_once(store_for):
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False, decode_executor="exact", prefill_executor="exact")
    engine.hooks = hooks = BatchReads(engine)
    engine.observe_routes(hooks.observe)
    engine.generate_batch(PROMPTS, max_tokens=4, ignore_eos=True)
    assert len(hooks.steps) == 4
    shared = 0
    for routes, reads in hooks.steps:
        assert sorted(routes) == sorted(reads) == sorted(engine.store.layers)
        for layer, inds in routes.items():
            assert inds.shape == (3, engine.spec.top_k)  # one token of each sequence
            union = len(np.unique(inds))
            shared += union < inds.size
            assert reads[layer] == (union, union * engine.store.expert_nbytes(layer))
    assert shared > 0  # some step's sequences shared an expert, read once for all of them


def test_an_end_of_sequence_a_one_token_prompt_a_batch_of_one_and_sampling(store_for):
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    tok = engine.tokenizer
    free = engine.generate(PROMPTS[1], max_tokens=8, ignore_eos=True).tokens
    saved = tok.eos_token_ids
    tok.eos_token_ids = {free[2]}  # this prompt's third token ends it
    try:
        alone = [engine.generate(p, max_tokens=8) for p in (PROMPTS[0], PROMPTS[1], [free[0]])]
        batched = engine.generate_batch([PROMPTS[0], PROMPTS[1], [free[0]]], max_tokens=8)
    finally:
        tok.eos_token_ids = saved
    assert [(r.tokens, r.text, r.finish_reason) for r in batched] == [
        (r.tokens, r.text, r.finish_reason) for r in alone
    ]
    assert batched[1].finish_reason == "stop" and batched[1].tokens == free[:3]
    (one,) = engine.generate_batch([PROMPTS[2]], max_tokens=5, ignore_eos=True)
    assert one.tokens == engine.generate(PROMPTS[2], max_tokens=5, ignore_eos=True).tokens
    for seed in (7, 8):  # each row samples from its own stream: what it samples alone with that seed
        batched = engine.generate_batch(PROMPTS, max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
        alone = [engine.generate(p, max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True) for p in PROMPTS]
        assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert batched[0].tokens != engine.generate(PROMPTS[0], max_tokens=6, temperature=1.0, seed=7).tokens


def test_what_cannot_batch_is_refused_with_the_fix(store_for):
    store = store_for("qwen3_moe")
    engine = edge0.load(store, prerouter=False)
    for prompts, limits, match in [
        ([], 4, "no prompts"),
        ("one string", 4, "no prompts.*a list of strings"),
        (PROMPTS, [4, 4], "2 max_tokens for 3 prompts"),
        (PROMPTS, 0, "max_tokens must be integers >= 1"),
    ]:
        with pytest.raises(Edge0Error, match=match):
            engine.generate_batch(prompts, max_tokens=limits)


LONG = " ".join([PROMPTS[2]] * 2)  # 130 tokens: 16 spans of 8


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_over_quantized_kv_join_leave_and_resume_as_they_do_alone(bits, store_for):
    """--kv-bits: the rows' quantized caches batch (our BatchQuantizedKVCache; mlx-lm has none),
    each row holding exactly what its own cache would, so it decodes what it decodes alone."""
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False, kv_bits=bits, kv_group_size=32)
    alone, batched = alone_and_batched(engine)  # merged at once, rows leaving one by one
    assert [r.tokens for r in batched] == alone
    engine.prefiller.span_tokens = 8
    prompts, limits = [PROMPTS[0], LONG, PROMPTS[1]], [40, 6, 20]
    alone = [engine.generate(p, max_tokens=m, ignore_eos=True).tokens for p, m in zip(prompts, limits)]
    tok = [engine.encode(p) for p in prompts]
    with engine.batching() as batch:  # a lone sequence runs in its own cache; two share a batched one
        batch.join(Request(tok[0], 40, ignore_eos=True))
        batch.advance()
        assert batch.cache is None and len(batch.rows) == 1
        batch.join(Request(tok[2], 2, ignore_eos=True))
        while len(batch.rows) < 2:
            batch.advance()
        assert len(batch.rows) == 2 and {type(c).__name__ for c in batch.cache} == {"BatchQuantizedKVCache"}
    with engine.batching() as batch:  # rows of other lengths join between steps (extend)
        joins = {n: [Request(tok[i], limits[i], reuse=True, ignore_eos=True)] for i, n in enumerate([0, 2, 4])}
        seqs, _, _ = run(batch, joins)
        assert batch.counts["most_rows"] == 3
    assert [s.tokens for s in seqs.values()] == alone
    # each row went back to the prompt caches quantized (extract): a next turn resumes from it
    follow = tok[1] + seqs[1].tokens + engine.encode(" and then")
    with engine.batching() as batch:
        again = batch.join(Request(follow, 5, reuse=True, ignore_eos=True))
        while batch.busy:
            batch.advance()
    assert again.held == len(tok[1]) + len(seqs[1].tokens) - 1
    engine.kv.pool.clear()
    engine.reset_cache()
    assert again.tokens == engine.generate(follow, max_tokens=5, ignore_eos=True).tokens


@pytest.mark.parametrize("bits", [None, 8])
def test_rows_that_draft_get_the_tokens_they_get_alone(bits, store_for):
    """A speculating engine's batch: plain rows draft (each its own drafter), one step verifies
    every row's draft and each row drops its rejected tokens on its own; a row with a stop string
    rides along. Every greedy row gets what it gets alone, plain; the seeded sampled row (drafts
    sampled by the draft model) what it gets alone under the same speculator."""
    from edge0.engine.drafters import ModelDrafter
    from tests.fixtures.make import reference_dir

    kw = {"kv_bits": bits, "kv_group_size": 32} if bits else {}
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False, prompt_cache_memory=5 << 20, **kw)
    prompts = [engine.encode(p) for p in [LONG, PROMPTS[1], PROMPTS[2]]]
    stopped = engine.generate(prompts[0], max_tokens=14, stop=[" worl"], ignore_eos=True)
    assert stopped.finish_reason == "stop" and len(stopped.tokens) < 14  # a stop string mid-way
    plain_seeded = engine.generate(prompts[1], max_tokens=7, temperature=1.0, seed=3, ignore_eos=True).tokens
    greedy = engine.generate(prompts[2], max_tokens=10, ignore_eos=True).tokens
    drafter = ModelDrafter(reference_dir("qwen3_moe"), engine.tokenizer, "qwen3_moe")
    engine.use_speculation(Speculator(drafter, num_draft=3, adaptive=False))
    alone = engine.generate(prompts[1], max_tokens=7, temperature=1.0, seed=3, ignore_eos=True)
    seeded = alone.tokens
    assert alone.stats["speculation"]["verifies"] > 0 and seeded != plain_seeded  # it did sample through verifies
    engine.kv.pool.clear()
    with engine.batching() as batch:
        rows = [
            batch.join(Request(prompts[0], 14, stop=[" worl"], reuse=True, ignore_eos=True)),
            batch.join(Request(prompts[1], 7, 1.0, seed=3, ignore_eos=True)),
            batch.join(Request(prompts[2], 10, reuse=True, ignore_eos=True)),
        ]
        while batch.busy:
            batch.advance()
    assert [r.tokens for r in rows] == [stopped.tokens, seeded, greedy]
    assert rows[0].finish == "stop"
    sp = engine.stats()["batch_speculation"]
    assert sp["verifies"] > 0 and 0 < sp["accepted"] <= sp["drafted"] and sp["unsupported_requests"] == 0
    # the rows went back to the prompt caches as they fed them: the next turn resumes exactly
    follow = prompts[0] + stopped.tokens + engine.encode(" and then")
    engine.use_speculation(None)
    want = engine.generate(follow, max_tokens=4, ignore_eos=True, reuse_cache=False).tokens  # takes no cache
    with engine.batching() as batch:
        again = batch.join(Request(follow, 4, reuse=True, ignore_eos=True))
        while batch.busy:
            batch.advance()
    assert again.held == len(prompts[0]) + len(stopped.tokens) - 1 and again.tokens == want


def test_the_batched_quantized_cache_holds_exactly_what_each_rows_own_cache_holds():
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    from edge0.backend.quantized_batch import BatchQuantizedKVCache

    mx.random.seed(0)
    H, D = 2, 64
    own = [QuantizedKVCache(group_size=32, bits=4) for _ in range(3)]
    for c, n in zip(own, [5, 9, 2]):
        c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
    batch = BatchQuantizedKVCache.merge(
        own[:2],
    )
    batch.extend(BatchQuantizedKVCache.merge([own[2]]))  # a shorter row joins: padded on the left
    for _ in range(260):  # past one 256-slot step: the batch grows
        k, v = mx.random.normal((3, H, 1, D)), mx.random.normal((3, H, 1, D))
        batch.update_and_fetch(k, v)
        for i, c in enumerate(own):
            c.update_and_fetch(k[i : i + 1], v[i : i + 1])
        mx.eval(batch.keys, batch.values, [(c.keys, c.values) for c in own])
    assert batch.left_padding.tolist() == [4, 0, 7]
    batch.filter(mx.array([0, 2]))  # the longest row leaves: the padding both others have goes
    assert batch.left_padding.tolist() == [0, 3] and batch.size() == 265
    for row, c in [(0, own[0]), (1, own[2])]:
        got = batch.extract(row)
        want = [x[..., : c.offset, :] for x in c.keys + c.values]
        assert got.offset == c.offset and all(mx.array_equal(a, b).item() for a, b in zip(got.keys + got.values, want))


@pytest.mark.parametrize("bits", [None, 4])
def test_each_row_drops_its_own_tail_and_holds_what_its_trimmed_cache_holds(bits):
    """A batched verify's rejected drafts: row i drops its last drops[i] tokens (rolled into its
    left padding); each row then holds exactly what its own cache trimmed by as much holds, and
    the tokens fed next land after its kept ones."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    mx.random.seed(1)
    H, D = 2, 64

    def own_cache():
        return KVCache() if bits is None else KVCache().to_quantized(group_size=32, bits=bits)

    own = [own_cache() for _ in range(3)]
    for c, n in zip(own, [6, 3, 9]):
        c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
    merged = bkv.merge_caches([[c] for c in own])
    k, v = mx.random.normal((3, H, 4, D)), mx.random.normal((3, H, 4, D))  # a verify of 4 tokens a row
    merged[0].update_and_fetch(k, v)
    for i, c in enumerate(own):
        c.update_and_fetch(k[i : i + 1], v[i : i + 1])
    drops = [3, 0, 1]
    bkv.drop_row_tails(merged, drops)
    for c, d in zip(own, drops):
        c.trim(d)
    k, v = mx.random.normal((3, H, 1, D)), mx.random.normal((3, H, 1, D))  # the next step
    merged[0].update_and_fetch(k, v)
    for i, c in enumerate(own):
        c.update_and_fetch(k[i : i + 1], v[i : i + 1])
    assert merged[0].offset.tolist() == [c.offset for c in own] == [8, 8, 13]
    for i, c in enumerate(own):
        (row,) = bkv.extract_row(merged, i)
        got = row.keys + row.values if bits else (row.keys, row.values)
        want = c.keys + c.values if bits else (c.keys, c.values)
        assert row.offset == c.offset
        assert all(mx.array_equal(a, b[..., : c.offset, :]).item() for a, b in zip(got, want))


def run(batch, joins: dict[int, list], max_steps=200):
    """Advance `batch`, joining joins[n] (lists of Requests) before advance n; returns the
    Steps per sequence in order and the order of the first Steps."""
    seqs, steps, firsts = {}, {}, []
    for n in range(max_steps):
        for request in joins.get(n, []):
            seq = batch.join(request)
            seqs[len(seqs)] = seq
            steps[id(seq)] = []
        if not batch.busy and n > max(joins):
            break
        for seq, step in batch.advance():
            if not steps[id(seq)]:
                firsts.append(seq)
            steps[id(seq)].append(step)
    return seqs, steps, firsts


def test_a_sequence_that_leaves_early_changes_nothing_for_the_others(store_for):
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    alone = [engine.generate(p, max_tokens=6, ignore_eos=True).tokens for p in PROMPTS]
    with engine.batching() as batch:
        seqs = [batch.join(Request(engine.encode(p), 6, ignore_eos=True)) for p in PROMPTS]
        batch.prefill_all()
        batch.advance()
        batch.advance()
        batch.leave(seqs[1])  # the middle row
        while batch.busy:
            batch.advance()
        waiting = batch.join(Request(engine.encode(PROMPTS[0]), 6, ignore_eos=True))
        batch.leave(waiting)  # before its prefill
        assert not batch.busy and batch.counts["left"] == 2
    assert [seqs[0].tokens, seqs[2].tokens] == [alone[0], alone[2]] and len(seqs[1].tokens) == 2


class Refuses:
    """A logits processor that raises at its `at`-th call (a grammar refusing a token)."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, generated, logprobs):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("the grammar refused token 7: a secret grammar")
        return logprobs


class Nothing:
    """A logits processor that masks every token (or a model whose log-probs are NaN)."""

    def __call__(self, generated, logprobs):
        return logprobs * float("nan")


def test_a_rows_own_failure_ends_that_row_alone(store_for):
    """A row whose processor raises mid-decode, one whose row has no finite log-prob, and one whose
    prefill fails each end alone with their own error; the other rows get what they get alone."""
    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    alone = [engine.generate(p, max_tokens=6, ignore_eos=True).tokens for p in PROMPTS]
    failing_prefill = engine.encode(PROMPTS[1] + " again")
    real = engine.prefiller

    class BrokenPrefill:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, tokens, cache, stop=None, **kw):
            if len(tokens) == len(failing_prefill) - 1:
                raise OSError("reading the experts failed")
            return real(tokens, cache, stop, **kw)

    engine.prefiller = BrokenPrefill()
    try:
        with engine.batching() as batch:
            seqs = [batch.join(Request(engine.encode(p), 6, ignore_eos=True)) for p in PROMPTS]
            refuses = batch.join(Request(engine.encode(PROMPTS[1]), 6, processors=[Refuses(3)], ignore_eos=True))
            nan = batch.join(Request(engine.encode(PROMPTS[2]), 6, 1.0, 1.0, processors=[Nothing()], ignore_eos=True))
            broken = batch.join(Request(failing_prefill, 6, ignore_eos=True))
            failures = {}
            while batch.busy:
                for seq, step in batch.advance():
                    if isinstance(step, Exception):
                        failures[id(seq)] = step
            assert batch.counts["failed"] == 3
    finally:
        engine.prefiller = real
    assert [s.tokens for s in seqs] == alone
    assert "secret grammar" in str(failures[id(refuses)]) and len(refuses.tokens) == 2
    assert "not finite" in str(failures[id(nan)]) and nan.tokens == []
    assert isinstance(failures[id(broken)], OSError) and broken.tokens == []
    assert {s.finish for s in (refuses, nan, broken)} == {"error"}


def test_a_tiny_temperature_is_greedy_and_a_mask_always_holds(store_for):
    """1e-300 would scale log-probs to inf and NaN: below GREEDY_BELOW the sampler is greedy; a
    processed row is renormalized, so a masked token is never drawn at any temperature."""
    from edge0.backend import logits as blog

    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    greedy = engine.generate(PROMPTS[0], max_tokens=6, ignore_eos=True).tokens
    assert engine.generate(PROMPTS[0], max_tokens=6, ignore_eos=True, temperature=1e-300).tokens == greedy
    allowed = [11, 12, 13]
    mask = np.zeros(8, np.int32)  # llguidance's layout: bit i of word w is token 32 w + i
    for t in allowed:
        mask[t // 32] |= 1 << (t % 32)
    for temperature in (1e-300, 1e-5, 0.5, 2.0):
        out = engine.generate(
            PROMPTS[0],
            max_tokens=8,
            ignore_eos=True,
            temperature=temperature,
            seed=1,
            logits_processors=[lambda generated, row: blog.apply_token_mask(row, mask) - 50.0],
        ).tokens
        assert set(out) <= set(allowed), (temperature, out)


def test_a_small_temperature_on_float16_log_probs_draws_the_likely_tokens():
    """float16 overflows to -inf for every token once |logprob| / temperature passes 65504: the
    sampler scales in float32, so a temperature of 2e-5 is (nearly) greedy, not uniform."""
    import mlx.core as mx

    row = np.full(64, np.log(0.8 / 63), np.float32)
    row[5] = np.log(0.2)
    logprobs = mx.array(row[None]).astype(mx.float16)
    sampler = RequestSampler(2e-5, 1.0, seed=7)
    draws = {int(sampler(logprobs).item()) for _ in range(20)}
    assert draws == {5}
