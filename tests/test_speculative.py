"""Speculative decoding: greedy tokens identical to plain decoding for every family, executor and
drafter; a verify reads each expert of its union once; the sampling rule keeps the model's
distribution; the adaptive switch; draft-model and option errors."""

import itertools
import json
import shutil
import types

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

import edge0
from edge0.backend import core as B
from edge0.backend import forward as bfw
from edge0.backend import kvcache as bkv
from edge0.backend import speculative as bsp
from edge0.engine import StepHooks
from edge0.engine import speculative as esp
from edge0.engine.drafters import Draft, Drafter, ModelDrafter, PromptLookup
from edge0.engine.speculative import Speculator
from edge0.errors import Edge0Error
from tests.fixtures.families import SPECD, UNIVERSAL
from tests.fixtures.make import reference_dir

PROMPT = "hello world, once upon a time there was"


class Controlled(Drafter):
    """Drafts the true greedy continuation `ref`, each token right with probability `p`."""

    def __init__(self, ref: list[int], p: float, seed: int = 0):
        self.ref, self.p, self.rng = ref, p, np.random.default_rng(seed)

    def start(self, prompt):
        self.n0 = len(prompt)

    def draft(self, context, k, temp=0.0, top_p=1.0, key=None):
        i = len(context) - self.n0
        return Draft([t if self.rng.random() < self.p else (t + 1) % 200 for t in self.ref[i : i + k]])


@pytest.fixture(scope="module")
def draft_model():
    """A draft model with the fixtures' tokenizer: qwen3_moe's mlx-lm checkpoint."""
    return reference_dir("qwen3_moe")


@pytest.fixture(scope="module")
def model_drafter(store_for, draft_model):
    tokenizer = edge0.load(store_for("qwen3_moe")).tokenizer  # every fixture has this tokenizer
    return ModelDrafter(draft_model, tokenizer, "qwen3_moe")


def load_for(store, executors: str):
    """An engine decoding with `executors`: "exact", or "hot+staged" (the first MoE layer hot, the
    others staged with top-k + 1 slots, so a verify's union of experts overflows them)."""
    if executors == "exact":
        return edge0.load(store, decode_executor="exact")
    e = edge0.load(store, decode_executor="exact")
    layers = sorted(e.store.layers)
    per_slot = sum(e.store.expert_nbytes(l) for l in layers)
    k = e.spec.top_k if e.spec else 2
    return edge0.load(store, layer_executors={layers[0]: {"decode": "hot"}}, expert_cache=(k + 1) * per_slot)


@pytest.mark.parametrize(
    "family,executors",
    [(f, "hot+staged") for f in SPECD + UNIVERSAL]
    + [pytest.param(f, "exact", marks=pytest.mark.slow) for f in SPECD + UNIVERSAL],
)
def test_greedy_tokens_identical_for_every_executor_and_drafter(family, executors, store_for, model_drafter):
    engine = load_for(store_for(family), executors)
    names = {d.decode.name for d in engine.streaming.layers.values()}
    assert names == set(executors.split("+"))
    ids = engine.encode(PROMPT)
    prompt = ids + engine.generate(ids, max_tokens=6, ignore_eos=True).tokens + ids  # a copy: prompt lookup drafts
    want = engine.generate(prompt, max_tokens=8, ignore_eos=True, reuse_cache=True).tokens
    assert len(set(want)) > 1
    for name, drafter in (("controlled", Controlled(want, 0.6)), ("ngram", PromptLookup(3)), ("model", model_drafter)):
        engine.use_speculation(Speculator(drafter, num_draft=4, adaptive=False))
        res = engine.generate(prompt, max_tokens=8, ignore_eos=True, reuse_cache=True)
        assert res.tokens == want, (family, name, executors)
        sp = res.stats["speculation"]
        if name != "ngram":  # prompt lookup drafts only where the context repeats itself
            assert sp["verifies"] > 0 and sp["drafted"] > 0, (family, name)
        if name == "controlled":
            assert 0 < sp["accepted"] < sp["drafted"]  # accepted and rejected drafts both happened
            assert sp["union_per_routed"] < 1  # the tokens of a verify shared experts
            if bkv.rewind_point(engine.kv.newest.cache) is not None:  # recurrent layers: rejected verifies fed again
                assert sp["replays"] > 0
    if executors != "exact":
        assert engine.stats()["totals"]["fallbacks"] > 0  # the staged layers met unions wider than their slots


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4_text"])
def test_a_full_sliding_window_goes_back_to_before_a_rejected_verify(family, store_for):
    """A sliding window past its size drops its oldest keys when a verify's tokens come in, which
    cutting back cannot restore: a rejection puts the window as it was and feeds the kept tokens
    again. Before, the window was cut back, its order broken, and greedy tokens differed from
    plain decoding's with no error (gpt_oss from the third token, window 8)."""
    engine = edge0.load(store_for(family))
    prompt = engine.encode(PROMPT * 3)  # longer than the fixtures' window of 8
    want = engine.generate(prompt, max_tokens=12, ignore_eos=True).tokens
    engine.use_speculation(Speculator(Controlled(want, 0.6), num_draft=4, adaptive=False))
    res = engine.generate(prompt, max_tokens=12, ignore_eos=True)
    assert res.tokens == want
    sp = res.stats["speculation"]
    assert 0 < sp["accepted"] < sp["drafted"] and sp["replays"] > 0


class VerifyReads(StepHooks):
    """Per multi-token step: expert loads and bytes read by each layer during it."""

    def __init__(self, engine):
        self.steps, self.layers = [], engine.streaming.stats.layers

    def multi_token(self, step, n):
        self.before = {l: (s.loads, s.bytes_read) for l, s in self.layers.items()}

    def kept(self, step, position):
        now = self.layers
        self.steps.append({l: (now[l].loads - a, now[l].bytes_read - b) for l, (a, b) in self.before.items()})


@pytest.mark.parametrize("executor", ["exact", "staged"])
def test_verify_reads_each_expert_of_its_union_once(executor, store_for):
    store = store_for("qwen3_moe")
    e = edge0.load(store, decode_executor=executor, prefill_executor="exact")
    prompt = e.encode(PROMPT)
    want = e.generate(prompt, max_tokens=12, ignore_eos=True).tokens
    routes = []  # every forward's route per layer; verifies are the 5-token ones
    e.observe_routes(lambda layer, inds, _: routes.append((layer, inds)))
    e.hooks = hooks = VerifyReads(e)
    e.use_speculation(sp := Speculator(Controlled(want, 1.0), num_draft=4, adaptive=False))
    assert e.generate(prompt, max_tokens=12, ignore_eos=True).tokens == want
    # handed the engine's stepper for each generation, the speculator keeps nothing of the engine
    assert not [v for v in vars(sp).values() if v is e or v is e.stepper]
    verifies = [(l, i) for l, i in routes if i.shape[0] == 5]
    n_layers = len(e.store.layers)
    assert len(hooks.steps) * n_layers == len(verifies) >= 2 * n_layers
    for j, reads in enumerate(hooks.steps):
        for layer, inds in verifies[j * n_layers : (j + 1) * n_layers]:
            union = len(np.unique(inds))
            assert union < inds.size  # 5 tokens x K=2 share experts
            loads, nbytes = reads[layer]
            if executor == "exact":
                assert loads == union and nbytes == union * e.store.expert_nbytes(layer)
            else:  # slot hits are not read again
                assert loads <= union and nbytes == loads * e.store.expert_nbytes(layer)
    t = e.stats()["totals"]
    assert t["multi_union"] == sum(len(np.unique(i)) for _, i in verifies)
    assert t["multi_routes"] == sum(i.size for _, i in verifies)


def test_accept_reject_keeps_the_model_distribution(store_for):
    """The rule on real distributions of a fixture (temperature 0.3, nucleus 0.9): the first emitted
    token follows p_0, and after an accepted first draft the second follows p_1; with a
    deterministic draft and with a sampled draft distribution q."""
    e = edge0.load(store_for("qwen3_moe"))
    logits = mx.array(bfw.full_logits(e.model, e.encode(PROMPT)[:12])[-3:])  # three positions: p_0, p_1, p_2
    p = bsp.sampling_probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), 0.3, 0.9)
    pn = np.array(p, np.float64)
    draft = [int(np.argmax(pn[0])), int(np.argsort(-pn[1])[1])]  # the likeliest token, then the second likeliest
    q = mx.softmax(logits[:2] * 2, axis=-1)  # another drafter (temperature 0.5)
    B.seed(0)
    rng = np.random.default_rng(0)
    qn = np.array(q, np.float64)
    n_runs = 1000
    for dq in (None, q):
        firsts, seconds = [], []
        for _ in range(n_runs):
            if dq is not None:  # the rule assumes drafts drawn from q
                draft = [int(rng.choice(len(r), p=r / r.sum())) for r in qn]
            n, nxt = bsp.accept_reject(p, draft, dq)
            firsts.append(draft[0] if n >= 1 else nxt)
            if n >= 1:
                seconds.append(draft[1] if n == 2 else nxt)
        for got, row in ((firsts, pn[0]), (seconds, pn[1])):
            top = np.argsort(-row)[:6]  # the likeliest tokens one by one, the rest pooled
            counts = np.array([got.count(int(t)) for t in top] + [len(got) - sum(got.count(int(t)) for t in top)])
            expect = np.append(row[top], 1 - row[top].sum()) * len(got)
            assert chisquare(counts, expect).pvalue > 1e-3, (dq is None, counts, expect.round(1))
        assert 0.1 < len(seconds) / n_runs < 0.9  # both the accept and the reject path ran often
    # the test has teeth: the drafter's own samples (q) are not distributed as p
    bad = np.array(mx.random.categorical(mx.log(q[0]), shape=(n_runs,)))
    top = np.argsort(-pn[0])[:6]
    counts = np.array([(bad == t).sum() for t in top] + [(~np.isin(bad, top)).sum()])
    assert chisquare(counts, np.append(pn[0][top], 1 - pn[0][top].sum()) * n_runs).pvalue < 1e-6


def test_sampled_speculation_runs_and_is_seeded(store_for, draft_model):
    e = edge0.load(store_for("qwen3_moe"), draft=str(draft_model), num_draft=3, draft_adaptive=False)
    a = e.generate(PROMPT, max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    b = e.generate(PROMPT, max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    assert a.tokens == b.tokens and len(a.tokens) == 12
    assert a.stats["speculation"]["verifies"] > 0 and a.stats["speculation"]["accepted"] > 0


def test_requests_a_verify_cannot_sample_decode_plainly_and_are_counted(store_for):
    """Log-probs, top-k and logits processors (grammars) are applied by plain steps only: such a
    request gets the same tokens and log-probs as without a drafter, and is counted."""
    e = edge0.load(store_for("qwen3_moe"))
    prompt = e.encode(PROMPT)
    want = e.generate(prompt, max_tokens=8, ignore_eos=True, logprobs=2)
    want_lp = [s.logprob for s in e.stream_generate(prompt, max_tokens=8, ignore_eos=True, logprobs=2)]
    e.use_speculation(Speculator(Controlled(want.tokens, 1.0), num_draft=4, adaptive=False))
    steps = list(e.stream_generate(prompt, max_tokens=8, ignore_eos=True, logprobs=2))
    assert [s.token for s in steps] == want.tokens
    assert [s.logprob for s in steps] == pytest.approx(want_lp)
    sp = steps[-1].stats["speculation"]
    assert sp["unsupported_requests"] == 1 and sp["verifies"] == 0 and sp["drafted"] == 0
    res = e.generate(prompt, max_tokens=8, ignore_eos=True)  # a plain request still speculates
    assert res.tokens == want.tokens and res.stats["speculation"]["verifies"] > 0


def test_adaptive_switch_turns_off_and_on_from_the_estimates():
    sp = Speculator(PromptLookup(), num_draft=4)
    est = sp.estimates
    assert not sp.on  # adaptive: off until the estimates say a verify pays
    est.observe_plain(0.10)
    est.observe_acceptance(4, 4)
    assert est.cycle_cost(5) == pytest.approx(0.10 * 3)  # no verify timed yet: the prior slope 0.5
    sp.decide(4)
    assert sp.on and sp.counts["switched_on"] == 1
    est.observe_cycle(5, 0.30)  # a 5-token verify costs 3 plain steps
    for _ in range(30):
        est.observe_acceptance(1, 4)  # acceptance 0.5: 1 + .5 + .25 + .125 + .0625 = 1.94 tokens per verify
    assert est.gain(4) == pytest.approx(1.9375 / 3, rel=0.02)  # the first observation has decayed away, nearly
    sp.decide(4)
    assert not sp.on and sp.counts["switched_off"] == 1
    for _ in range(30):  # shadow drafts all accepted while off
        est.observe_acceptance(4, 4)
    assert est.gain(4) > 1.05
    sp.decide(4)
    assert sp.on and sp.counts["switched_on"] == 2
    assert est.cycle_cost(3) == pytest.approx(0.10 + 2 * (0.30 - 0.10) / 4)  # on the line through the measured ones


@pytest.fixture
def ticking_clock(monkeypatch):
    """The switch's clock ticks 1 ms per reading: a plain step measures 1 ms and a verify cycle 2 ms
    on any machine (real timings under a loaded CI can switch it off and on at random)."""
    ticks = itertools.count(0.0, 0.001)
    monkeypatch.setattr(esp, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))


def test_a_stale_slow_verify_timing_is_timed_again_while_it_could_pay():
    sp = Speculator(PromptLookup(), num_draft=4)
    est = sp.estimates
    est.observe_plain(0.10)
    for _ in range(30):
        est.observe_acceptance(4, 4)  # every draft kept: 5 tokens per verify
    est.observe_cycle(5, 0.60)  # one slow verify (a cold cache): 6 plain steps, gain 5/6
    sp.decide(4)
    assert not sp.on
    sp.off_steps = esp.EXPLORE_EVERY - 1
    assert not sp.should_explore()
    sp.off_steps = esp.EXPLORE_EVERY
    assert sp.should_explore()  # gain 0.83 >= RETIME_GAIN
    sp.explored()
    assert sp.retime_every == 2 * esp.EXPLORE_EVERY and not sp.should_explore()  # stayed off: waits twice as long
    est.observe_cycle(5, 0.20)  # timed again: 2 plain steps
    assert est.cycle_cost(5) == pytest.approx(0.40)  # the mean of both timings, not 0.9 x the stale one
    sp.decide(4)
    assert sp.on and sp.retime_every == esp.EXPLORE_EVERY  # gain 5 x 0.1 / 0.4 = 1.25
    far = Speculator(PromptLookup(), num_draft=4)  # far from paying: never timed again
    far.estimates.observe_plain(0.10)
    far.estimates.observe_cycle(5, 0.60)
    far.estimates.observe_acceptance(0, 4)
    far.off_steps = 10**6
    assert not far.should_explore()


def test_adaptive_speculation_retimes_a_stale_verify_and_switches_on(store_for, ticking_clock):
    e = edge0.load(store_for("qwen3_moe"))
    prompt = e.encode(PROMPT)
    n = esp.EXPLORE_EVERY + 24
    want = e.generate(prompt, max_tokens=n + 4, ignore_eos=True).tokens
    sp = Speculator(Controlled(want, 1.0), num_draft=4)
    sp.estimates.observe_plain(0.001)
    sp.estimates.observe_cycle(5, 0.006)  # a stale timing: a verify looked like 6 plain steps (gain 5/6)
    e.use_speculation(sp)
    res = e.generate(prompt, max_tokens=n, ignore_eos=True)
    s = res.stats["speculation"]
    assert res.tokens == want[:n]
    assert s["plain_steps"] >= esp.EXPLORE_EVERY and s["switched_on"] == 1 and s["verifies"] > 1
    assert s["verify_cost_ratio"] == pytest.approx(3.0, rel=0.2)  # mean of 6 and 2 ms, then decayed toward 2


def test_adaptive_speculation_measures_shadow_drafts_then_switches(store_for, ticking_clock):
    e = edge0.load(store_for("qwen3_moe"))
    prompt = e.encode(PROMPT)
    want = e.generate(prompt, max_tokens=16, ignore_eos=True).tokens
    slow = Speculator(Controlled(want, 1.0), num_draft=4)
    slow.estimates.observe_plain(0.001)
    slow.estimates.observe_cycle(5, 1.0)  # a verify looks 1000x a plain step: it never pays
    fresh = Speculator(Controlled(want, 1.0), num_draft=4)  # no estimates: the prior, then measured
    for sp in (slow, fresh):
        e.use_speculation(sp)
        res = e.generate(prompt, max_tokens=16, ignore_eos=True)
        assert res.tokens == want
        s = res.stats["speculation"]
        assert s["shadow_drafted"] > 0 and s["shadow_accepted"] == s["shadow_drafted"]  # every draft was right
        if sp is slow:
            assert s["verifies"] == 0 and s["plain_steps"] == 15 and not s["on"]
        else:
            assert s["switched_on"] == 1 and s["verifies"] > 0 and s["verify_cost_ratio"] > 0


def test_prompt_lookup_drafts_what_followed_the_latest_match():
    d = PromptLookup(3)
    d.start([])
    ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert d.draft(ctx, 3).tokens == [5, 6, 7]  # the latest earlier "1 2 3" was followed by 5 6 7
    assert d.draft(ctx + [5, 8], 2).tokens == []  # "3 5 8", "5 8", "8": never seen before
    assert d.draft(ctx + [5, 8, 6], 4).tokens == [7, 1, 2, 3]  # only "6" matches: n falls back to 1


def test_draft_model_with_another_tokenizer_is_a_clear_error(store_for, draft_model, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(draft_model, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(Edge0Error, match=r"--draft .*other: its tokenizer differs .*token .* is id"):
        edge0.load(store_for("qwen3_moe"), draft=str(other))
    with pytest.raises(Edge0Error, match="not an mlx-lm model directory"):
        edge0.load(store_for("qwen3_moe"), draft=str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "options,match",
    [
        ({"num_draft": 3}, "--num-draft is read only with --draft"),
        ({"draft": "ngram", "num_draft": 0}, "--num-draft 0: must be from 1"),
        ({"draft": "model-dir", "draft_ngram": 2}, "--draft-ngram is read only with --draft ngram"),
        ({"draft": "ngram", "substitute_alpha": 0.1}, "drop --draft or --substitute-alpha"),
    ],
)
def test_bad_draft_options_name_the_flag(options, match):
    with pytest.raises(Edge0Error, match=match):
        edge0.load(None, **options)


def test_quantized_kv_cache_is_rewound_too(store_for):
    e = edge0.load(store_for("qwen3_moe"), kv_bits=8, kv_group_size=32)
    prompt = e.encode(PROMPT)
    want = e.generate(prompt, max_tokens=12, ignore_eos=True).tokens
    e.use_speculation(Speculator(Controlled(want, 0.6), num_draft=4, adaptive=False))
    res = e.generate(prompt, max_tokens=12, ignore_eos=True)
    assert res.tokens == want and 0 < res.stats["speculation"]["accepted"] < res.stats["speculation"]["drafted"]


def test_generate_cli_speculates_and_reports_it(store_for, capsys):
    from edge0.cli.generate import main

    args = ["--model", str(store_for("qwen3_moe")), "--prompt", PROMPT + PROMPT, "--no-chat-template"]
    assert main([*args, "--max-tokens", "12", "--draft", "ngram", "--num-draft", "3", "--no-draft-adaptive"]) == 0
    err = capsys.readouterr().err
    assert "speculative decoding: prompt lookup (n-gram <= 3), 3 draft tokens, always on" in err  # describe()
    assert "speculation (ngram, on):" in err and " verifies" in err
    with pytest.raises(SystemExit) as e:  # a usage error: one line, exit 2
        main([*args, "--draft", "ngram", "--num-draft", "x"])
    assert e.value.code == 2 and "--num-draft" in capsys.readouterr().err


def test_serve_wires_the_draft_flags(monkeypatch, tmp_path):
    from tests.test_server_engine import _serve_main

    ran = _serve_main(monkeypatch, tmp_path, ["--draft", "ngram", "--num-draft", "6", "--draft-ngram", "2"])
    assert (ran["options"]["draft"], ran["options"]["num_draft"], ran["options"]["draft_ngram"]) == ("ngram", 6, 2)
    assert ran["options"]["draft_adaptive"] is True


def test_server_streams_the_same_text_with_speculation(store_for):
    import openai

    from edge0.server.config import ServerConfig
    from tests.fake_server import running_server
    from tests.test_server import user

    plain = edge0.load(store_for("qwen3_moe"))
    spec = edge0.load(store_for("qwen3_moe"), draft="ngram", draft_adaptive=False)
    texts = []
    for engine in (plain, spec):
        with running_server(engine, ServerConfig()) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
            kwargs = dict(model=engine.model_id, messages=user(PROMPT + PROMPT), max_tokens=16, temperature=0)
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            assert client.chat.completions.create(**kwargs).choices[0].message.content == texts[-1]
    assert texts[0] == texts[1] and texts[0]
    # a lone request is a batch of one: it drafts through the engine's speculator, as one sequence
    assert spec.stats()["speculation"]["verifies"] > 0


@pytest.mark.parametrize("width", [6, 10])
def test_accept_reject_takes_a_draft_model_of_another_output_width(width):
    """A draft model's rows can be narrower or wider than the target's (Qwen3's 151,936 output
    rows against its tokenizer's 151,669): a rejection must still draw from max(p - q, 0)."""
    p = mx.array([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0], [0.25] * 4 + [0.0] * 4])  # [k + 1, 8]
    q = mx.zeros((1, width)).at[0, 0].add(1.0)  # the drafter is sure of token 0, which p gives 0
    for seed in range(5):
        mx.random.seed(seed)
        n, token = bsp.accept_reject(p, [0], q)
        assert n == 0 and token in (1, 2)


def test_drafts_are_cut_at_the_end_of_sequence(store_for):
    """A draft is verified only up to an end-of-sequence token it contains: the verify's own next
    token is the end, and the KV cache holds what plain decoding's would (nothing fed after it)."""
    e = edge0.load(store_for("qwen3_moe"))
    prompt = e.encode(PROMPT)
    want = e.generate(prompt, max_tokens=8, ignore_eos=True).tokens
    stop = want[3]
    assert stop not in want[:3]
    e.tokenizer.eos_token_ids = {stop}
    e.use_speculation(Speculator(Controlled(want, 1.0), num_draft=6, adaptive=False))
    res = e.generate(prompt, max_tokens=8, reuse_cache=True)
    assert res.tokens == want[:4] and res.finish_reason == "stop"
    assert res.stats["speculation"]["drafted"] == 2  # one verify: want[1:3], not 6 tokens
    assert e.kv.newest.tokens == prompt + want[:3]  # the end was never fed, as in plain decoding
    assert Draft([5, 7, 9, 7], "pq").until({7}) == Draft([5], "p")
