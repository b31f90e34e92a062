"""Pre-router: predictions are routes, consumer layers never sync, reads for t+1 are issued before
step t finishes, an oracle reproduces the exact path, and heads files are checked."""

import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import edge0
from edge0.backend import assemble as bas
from edge0.errors import Edge0Error
from edge0.prerouter.attach import use_prerouting
from edge0.prerouter.routes import PreRouting
from edge0.prerouter.train import owner_layers

PROMPT = "hello world, once upon a time"


@pytest.fixture(scope="module")
def heads_file(store_for, tmp_path_factory):
    data = tmp_path_factory.mktemp("data") / "train.txt"
    data.write_text("Once upon a time there was a tiny model that read its experts from disk. " * 80)
    out = tmp_path_factory.mktemp("heads") / "heads.safetensors"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0",
            "train-prerouter",
            "--model",
            str(store_for("deepseek_v3")),
            "--data",
            str(data),
            "--out",
            str(out),
            "--steps",
            "60",
            "--window",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "recall@K" in p.stderr
    return out


def consumer_syncs(engine, consumers):
    return sum(engine.streaming.stats.layers[c].host_syncs for c in consumers)


def prompt_syncs(engine, consumers):
    """The syncs the prompt costs a consumer layer: one per prefill span that read the union of its
    routes (the exact path; a whole-layer read needs none), and the last prompt token's gate."""
    return sum(engine.streaming.stats.layers[c].span_union + 1 for c in consumers)


def test_trained_heads_route_with_no_consumer_syncs_and_no_drops(store_for, heads_file):
    e = edge0.load(store_for("deepseek_v3"), prerouter=heads_file, prerouter_diagnostics=True)
    consumers = set(e.prerouting.consumer.values())
    assert consumers
    res = e.generate(PROMPT, max_tokens=16, ignore_eos=True, temperature=0.0)
    st = e.stats()["prerouter"]
    assert all(st["routed_by_head"][c] == 15 for c in consumers)  # every step after the first
    assert res.stats["dropped_experts"] == 0
    # Consumer layers sync only for the prompt.
    assert consumer_syncs(e, consumers) == prompt_syncs(e, consumers)
    assert all(0 <= r <= 1 for r in st["recall"].values())


def test_reads_for_next_step_issued_before_step_finishes(store_for, heads_file):
    e = edge0.load(store_for("deepseek_v3"), prerouter=heads_file)
    ev, hooks = [], e.hooks  # the order of stage() calls and step ends, recorded from outside
    for layer, ex in hooks.staged.items():
        ex.stage = lambda *a, layer=layer, orig=ex.stage: (ev.append(("issue", layer)), orig(*a))[1]
    hooks.step_done = lambda step, orig=hooks.step_done: (ev.append(("done", step)), orig(step))[1]
    e.generate(PROMPT, max_tokens=8, ignore_eos=True)
    consumers = set(e.prerouting.consumer.values())
    start = 0
    for t in range(7):
        done = ev.index(("done", t))
        # the reads for step t + 1 are issued during step t, before it finishes, in every consumer layer
        assert {x[1] for x in ev[start:done] if x[0] == "issue"} == consumers, f"step {t}: {ev[start:done]}"
        start = done + 1
    assert not hasattr(hooks, "events")  # the stager keeps no per-step history


def test_the_last_step_reads_nothing_ahead(store_for, heads_file):
    """A step that makes every sequence's last token (their token limits) stages no next step:
    its reads would be wasted, and waited for at the end. A sequence that joins the same batch
    afterwards starts with nothing staged and gets its tokens as alone."""
    from edge0.engine.request import Request

    e = edge0.load(store_for("deepseek_v3"), prerouter=heads_file, expert_cache="64KB")
    staged = []
    for layer, ex in e.hooks.staged.items():
        ex.stage = lambda *a, layer=layer, orig=ex.stage: (staged.append(layer), orig(*a))[1]
    consumers = len(e.hooks.staged)
    alone = [e.generate(p, max_tokens=8, ignore_eos=True).tokens for p in (PROMPT, BATCH_PROMPTS[1])]
    assert len(staged) == 2 * 7 * consumers  # steps 0-6 stage the next; step 7 makes the eighth token
    staged.clear()
    assert [r.tokens for r in e.generate_batch([PROMPT, BATCH_PROMPTS[1]], max_tokens=8, ignore_eos=True)] == alone
    assert len(staged) == 7 * consumers
    with e.batching() as batch:  # the first sequence ends; the second joins the same batch after
        first = batch.join(Request(e.encode(PROMPT), 8, ignore_eos=True))
        while batch.busy:
            batch.advance()
        second = batch.join(Request(e.encode(BATCH_PROMPTS[1]), 8, ignore_eos=True))
        while batch.busy:
            batch.advance()
    assert [first.tokens, second.tokens] == alone
    assert e.stats()["totals"]["dropped"] == 0


def test_a_batch_step_reads_each_layers_next_experts_once_that_layer_has_routed(store_for, heads_file):
    """A batch's step copies every layer's route to the host; by then the prediction for that
    layer's next step is computed too (its owner runs earlier in the forward), so the layer's
    reads start there, while the later layers compute, not once the whole forward is built."""
    e = edge0.load(store_for("deepseek_v3"), prerouter=heads_file, expert_cache="64KB")
    ev = []
    for layer, ex in e.hooks.staged.items():
        ex.stage = lambda *a, layer=layer, orig=ex.stage: (ev.append(("stage", layer)), orig(*a))[1]
        ex.host_ids = lambda ind, layer=layer, orig=ex.host_ids: (ev.append(("route", layer)), orig(ind))[1]
    hooks = e.hooks
    hooks.after_forward = lambda *a, orig=hooks.after_forward: (ev.append(("built",)), orig(*a))[1]
    alone = [e.generate(p, max_tokens=8, ignore_eos=True).tokens for p in (PROMPT, BATCH_PROMPTS[1])]
    ev.clear()
    assert [r.tokens for r in e.generate_batch([PROMPT, BATCH_PROMPTS[1]], max_tokens=8, ignore_eos=True)] == alone
    stages = [i for i, x in enumerate(ev) if x[0] == "stage"]
    assert len(stages) == 7 * len(e.hooks.staged)  # every step but the last stages the next
    # right after the layer's own route, before the step's graph is built ("built" comes between otherwise)
    assert all(ev[i - 1] == ("route", ev[i][1]) for i in stages), ev
    assert ev.count(("built",)) == 8
    assert e.stats()["totals"]["dropped"] == 0


def test_a_row_that_ends_is_not_read_ahead_for(store_for, heads_file):
    """In a batch whose rows end at different steps, the step that makes one row's last token
    stages the next routes of the other rows only."""
    from edge0.engine.request import Request

    e = edge0.load(store_for("deepseek_v3"), prerouter=heads_file, expert_cache="64KB")
    rows_staged = []
    for layer, ex in e.hooks.staged.items():
        ex.stage = lambda ids, *a, orig=ex.stage: (rows_staged.append(np.shape(ids)), orig(ids, *a))[1]
    consumers = len(e.hooks.staged)
    alone = [e.generate(PROMPT, max_tokens=8, ignore_eos=True).tokens]
    alone.append(e.generate(BATCH_PROMPTS[1], max_tokens=4, ignore_eos=True).tokens)
    rows_staged.clear()
    with e.batching() as batch:
        seqs = [
            batch.join(Request(e.encode(PROMPT), 8, ignore_eos=True)),
            batch.join(Request(e.encode(BATCH_PROMPTS[1]), 4, ignore_eos=True)),
        ]
        while batch.busy:
            batch.advance()
    assert [s.tokens for s in seqs] == alone
    k = e.k
    # the step of the second row's fourth token stages the first row's next route alone, as a
    # batch's ([1, K]); the steps before staged both rows', the steps after one sequence's ([K])
    assert rows_staged.count((1, k)) == consumers
    assert rows_staged.count((2, k)) > 0 and rows_staged.count((k,)) > 0
    assert len(rows_staged) == 7 * consumers  # the first row's 8 tokens: every step but the last stages
    assert e.stats()["totals"]["dropped"] == 0


class OracleHead:
    """Returns the consumer gate's true logits for the next token (recorded from an exact run)."""

    def __init__(self, logits):
        self.logits, self.i = logits, 1

    def __call__(self, x):
        out = self.logits[min(self.i, len(self.logits) - 1)]  # the last prediction is never used
        self.i += 1
        return out


@pytest.mark.parametrize("policy, alpha", [("lru", 0.0), ("smoe", 0.0), ("smoe", 1.0)])
def test_oracle_heads_reproduce_the_exact_path(store_for, policy, alpha):
    """Also with smoe (the heads' scores reach the cache with their routes) and substitution:
    neither adds a consumer sync, and substituted experts are mapped to their slots (no drops)."""
    store = store_for("deepseek_v3")
    ref = edge0.load(store, prerouter=False, decode_executor="exact")
    blocks = dict(bas.moe_blocks(ref.model))
    recorded = {l: [] for l in blocks}
    for layer, block in blocks.items():
        orig = block.router_logits

        def rec(x, orig=orig, layer=layer):
            out = orig(x)
            if x.shape[-2] == 1:
                recorded[layer].append(out)
            return out

        object.__setattr__(block, "router_logits", rec)
    want = ref.generate(PROMPT, max_tokens=12, ignore_eos=True)
    mx.eval([v for l in recorded.values() for v in l])

    e = edge0.load(store, prerouter=False, expert_cache="64KB", cache_policy=policy, substitute_alpha=alpha)
    eb = dict(bas.moe_blocks(e.model))
    owners = owner_layers(e)
    heads = {o: OracleHead(recorded[c]) for o, c in owners.items()}
    pr = PreRouting(heads, owners, {c: eb[c].router_bias() for c in owners.values()}, e.spec, e.k)
    use_prerouting(e, pr)
    got = e.generate(PROMPT, max_tokens=12, ignore_eos=True)
    assert (got.tokens == want.tokens) == (alpha == 0)
    assert (sum(e.streaming.stats.layers[c].substitutions for c in owners.values()) > 0) == (alpha > 0)
    assert got.stats["dropped_experts"] == 0
    assert all(pr.routed_by_head[c] == 11 for c in owners.values())
    assert consumer_syncs(e, owners.values()) == prompt_syncs(e, owners.values())


def test_heads_in_store_are_used_by_default_and_can_be_disabled(store_for, heads_file, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(store_for("deepseek_v3"), store)
    shutil.copy(heads_file, store / "prerouter.safetensors")
    assert (engine := edge0.load(store)).prerouting is not None
    assert edge0.load(store, prerouter=False).prerouting is None
    assert engine.batch_problem() is None  # a batch routes each row with its own predictions


def test_heads_for_another_model_are_rejected(store_for, heads_file):
    with pytest.raises(Edge0Error, match="another model.*train-prerouter"):
        edge0.load(store_for("qwen3_moe"), prerouter=heads_file)


def test_corrupted_heads_file_is_rejected(store_for, heads_file, tmp_path):
    bad = tmp_path / "bad.safetensors"
    raw = bytearray(heads_file.read_bytes())
    bad.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(Edge0Error, match="not a readable pre-router heads file"):
        edge0.load(store_for("deepseek_v3"), prerouter=bad)
    raw[10:20] = b"\x00" * 10  # damage the header
    bad.write_bytes(bytes(raw))
    with pytest.raises(Edge0Error, match=str(bad.name)):
        edge0.load(store_for("deepseek_v3"), prerouter=bad)


def test_prerouter_rejected_for_universal_family(store_for, heads_file):
    with pytest.raises(Edge0Error, match="universal"):
        edge0.load(store_for("olmoe"), prerouter=heads_file)


def test_decode_logits_equal_parallel_logits_without_prerouter(store_for):
    e = edge0.load(store_for("qwen3_moe"), prerouter=False)
    ids = e.encode(PROMPT)
    par = e.logits(ids)
    seq = e.decode_logits(ids)
    lp = par - np.log(np.exp(par - par.max(-1, keepdims=True)).sum(-1, keepdims=True)) - par.max(-1, keepdims=True)
    np.testing.assert_allclose(seq, lp, atol=1e-4)


def test_parallel_prerouted_logits_equal_stepwise_decoding(store_for, heads_file):
    e = edge0.load(store_for("deepseek_v3"), prerouter=heads_file)
    ids = e.encode(PROMPT + " and then the model read more experts")
    par = e.prerouted_logits(ids)
    lp = par - par.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    np.testing.assert_allclose(e.decode_logits(ids), lp, atol=1e-4)
    gate = edge0.load(store_for("deepseek_v3"), prerouter=False).logits(ids)
    assert np.abs(par - gate).max() > 1e-3  # the predicted routes really differ from the gate's


def test_speculation_with_heads_gives_the_plain_prerouted_tokens(store_for, heads_file):
    """A verify routes each position as plain decoding with the heads would: position 0 with the
    previous step's prediction, position t with the prediction this verify made at t - 1."""
    from edge0.engine.drafters import Draft, Drafter
    from edge0.engine.speculative import Speculator

    e = edge0.load(store_for("deepseek_v3"), prerouter=heads_file, expert_cache="64KB")
    want = e.generate(PROMPT, max_tokens=16, ignore_eos=True).tokens
    gate = edge0.load(store_for("deepseek_v3"), prerouter=False).generate(PROMPT, max_tokens=16, ignore_eos=True)
    assert gate.tokens != want  # the heads' routes change the output, so gate routing in a verify would show

    class Controlled(Drafter):  # the true continuation, every third token wrong
        def start(self, prompt):
            self.n0, self.calls = len(prompt), 0

        def draft(self, context, k, temp=0.0, top_p=1.0, key=None):
            self.calls += 1
            i = len(context) - self.n0
            return Draft([t if (i + j) % 3 else (t + 1) % 200 for j, t in enumerate(want[i : i + k])])

    e.use_speculation(Speculator(Controlled(), num_draft=4, adaptive=False))
    res = e.generate(PROMPT, max_tokens=16, ignore_eos=True)
    assert res.tokens == want
    sp = res.stats["speculation"]
    assert sp["verifies"] >= 3 and 0 < sp["accepted"] < sp["drafted"]
    assert res.stats["dropped_experts"] == 0  # the kept position's prediction was staged for the next step


BATCH_PROMPTS = [PROMPT, "the quick brown fox jumps over the lazy dog", "a tiny model that reads experts"]


@pytest.mark.parametrize("executor", ["staged", pytest.param("hot", marks=pytest.mark.slow)])  # suite time
def test_a_batch_with_heads_gives_each_sequence_its_prerouted_tokens(store_for, heads_file, executor):
    """Each row of a batch routes with its own predictions (its first step, the prompt's last
    token, with the gate, as alone): rows starting together, the last or the first one left alone
    at the end (it routes on the host: the staged union was every row's), and one joining
    mid-batch with a two-token prompt (its one-token prefill predicts nothing, and with chunk-by-
    chunk prefill it reaches the decode executors between a stage and its swap). Nothing routed
    goes unread."""
    from edge0.engine.request import Request

    e = edge0.load(store_for("deepseek_v3"), prerouter=heads_file, expert_cache="64KB", decode_executor=executor)
    prompts = [e.encode(p) for p in BATCH_PROMPTS]
    prompts[2] = prompts[2][:2]

    def alone(limits):
        return [e.generate(p, max_tokens=m, ignore_eos=True).tokens for p, m in zip(prompts, limits)]

    gate = edge0.load(store_for("deepseek_v3"), prerouter=False)
    assert [gate.generate(p, max_tokens=12, ignore_eos=True).tokens for p in prompts] != alone([12] * 3)
    by_head = sum(e.stats()["prerouter"]["routed_by_head"].values())
    for limits in ([6, 9, 12], [12, 9, 6]):
        batched = e.generate_batch(prompts, max_tokens=limits, ignore_eos=True)
        assert [r.tokens for r in batched] == alone(limits)
    assert sum(e.stats()["prerouter"]["routed_by_head"].values()) > by_head
    totals = e.stats()["totals"]
    if executor == "staged":  # three rows' union outgrew the slots: what did not fit was read ahead too
        assert 0 < totals["beyond_ahead_used"] <= totals["beyond_ahead"]

    limits = [6, 9, 12]
    for layerwise in (True, False):
        e.prefiller.layerwise = layerwise
        want = alone(limits)
        with e.batching() as batch:  # the third sequence joins after five steps of the first two
            seqs = [batch.join(Request(prompts[i], limits[i], ignore_eos=True)) for i in range(2)]
            for _ in range(5):
                batch.advance()
            seqs.append(batch.join(Request(prompts[2], limits[2], ignore_eos=True)))
            while batch.busy:
                batch.advance()
        assert [s.tokens for s in seqs] == want
    assert e.stats()["totals"]["dropped"] == 0
