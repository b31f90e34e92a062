"""Reading one MoE layer ahead (streaming/lookahead.py, backend/lookahead.py): the next layer's
route predicted from this layer's input starts its misses reading early; tokens never change,
and every byte read ahead is either taken by the route or counted as wasted."""

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import edge0
from edge0.backend.lookahead import predictor, router_of
from edge0.streaming import early
from edge0.streaming.dispatch import LayerDispatch
from edge0.streaming.exact import ExactExecutor
from edge0.streaming.lookahead import PROBE_EVERY, RECALL_FLOOR, Lookahead, updated_recall
from edge0.streaming.stats import LayerStats
from tests.fixtures import ALL_FAMILIES
from tests.test_executors import run

PROMPT = "the layer ahead reads while this one computes"
TOKENS = 24


class _Target:
    """A staged layer as the lookahead sees it."""

    def __init__(self):
        self.recall, self.scored, self.reads = 1.0, True, []

    def takes_predictions(self):
        return True

    def read_ahead(self, ids, read=True):
        self.reads.append(read)


def test_recall_is_a_decayed_average_and_auto_stops_reading_below_the_floor():
    assert updated_recall(1.0, np.array([1, 2]), np.array([2, 3])) == pytest.approx(0.8 * 1.0 + 0.2 * 0.5)
    assert updated_recall(0.5, np.array([4]), np.array([[4, 4]])) == pytest.approx(0.8 * 0.5 + 0.2)
    target = _Target()
    auto, on = Lookahead(target, "auto"), Lookahead(target, "on")
    auto.issue(np.array([0]))
    for _ in range(4):  # four steps whose predictions never agree: 1.0 * 0.8^4 = 0.41
        target.recall = updated_recall(target.recall, np.array([0]), np.array([1]))
    assert target.recall < RECALL_FLOOR
    auto.issue(np.array([0]))
    on.issue(np.array([0]))
    target.recall = RECALL_FLOOR  # agreeing again: auto reads ahead again
    auto.issue(np.array([0]))
    assert target.reads == [True, False, True, True]


def test_a_layers_first_prediction_is_only_scored_and_reads_ahead_once_it_agreed(store_for):
    """`auto` reads nothing ahead on faith: a layer's first prediction is scored, not read (`on`
    reads it). An agreeing first prediction starts the reads, a wrong one keeps them off."""
    target = _Target()
    target.scored, target.recall = False, RECALL_FLOOR
    auto, on = Lookahead(target, "auto"), Lookahead(target, "on")
    auto.issue(np.array([0]))
    on.issue(np.array([0]))
    assert target.reads == [False, True]
    engine = edge0.load(store_for("qwen3_moe"), decode_executor="staged", lora=False)
    ex = engine.streaming.layers[sorted(engine.streaming.layers)[1]].decode
    assert (ex.scored, ex.recall) == (False, RECALL_FLOOR)
    for route, scored_recall in (([2, 3], RECALL_FLOOR * 0.8 + 0.2), ([0, 1], 0.8 * (RECALL_FLOOR * 0.8 + 0.2))):
        ex.prediction.predict(np.array([[2, 3]]))
        ex.prediction.score(np.array([route]))
        assert ex.scored and ex.recall == pytest.approx(scored_recall)
    engine.close()


def test_below_the_floor_auto_predicts_one_call_in_probe_every():
    """A prediction costs each call a matmul and a host copy: below the floor `auto` predicts
    (and scores) only one call in PROBE_EVERY, `on` every call; back at the floor, every call."""
    target, host = _Target(), _Executor([])
    auto, on = Lookahead(target, "auto"), Lookahead(target, "on")
    assert [auto.wanted(host) for _ in range(3)] == [True] * 3
    target.recall = RECALL_FLOOR / 2
    calls = 3 * PROBE_EVERY
    assert [auto.wanted(host) for _ in range(calls)] == ([False] * (PROBE_EVERY - 1) + [True]) * 3
    assert all(on.wanted(host) for _ in range(calls))
    auto.wanted(host)  # one call skipped since the probe
    target.recall = RECALL_FLOOR
    assert all(auto.wanted(host) for _ in range(calls)) and auto.skipped == 0


class _Executor:
    """A decode executor whose call returns `parts`."""

    def __init__(self, parts):
        self.parts, self.log = parts, []

    def routes_on_host(self):
        return True

    def __call__(self, indices, scores=None):
        return self.parts

    def done(self, y):
        self.log.append("done")


@pytest.mark.parametrize("deferred", [True, False])
def test_the_next_layer_is_read_ahead_once_this_layers_compute_started(deferred):
    """The next layer's prediction is issued after this call's first parts were launched: just
    before its deferred part runs, or at `done` when it has none; never between its route's sync
    and the launch, where the layer's compute waits for the host."""
    target, log = _Target(), []
    target.read_ahead = lambda ids, read=True: log.append(("read ahead", sorted(np.reshape(ids, -1).tolist())))
    parts = [("hits",), lambda: log.append("misses") or ("misses",)] if deferred else [("all",)]
    ex = _Executor(parts)
    dispatch = LayerDispatch({}, ex, 32, 2, 8, LayerStats())
    dispatch.lookahead = Lookahead(target, "on")
    got = dispatch(mx.array([[[0, 1]]], dtype=mx.uint32), ahead=lambda: mx.array([[3, 4]], dtype=mx.uint32))
    assert log == [] and got[0] == parts[0]
    if deferred:
        assert got[1]() == ("misses",)
    dispatch.done(mx.zeros(1))
    assert log == [("read ahead", [3, 4])] + (["misses"] if deferred else [])
    assert ex.log == ["done"]


class _Block(nn.Module):
    """An mlx-lm MoE block: a router, experts and a shared expert whose projection has E outputs too."""

    def __init__(self, hidden, experts, moe_gate=False):
        super().__init__()
        if moe_gate:  # DeepSeek's MoEGate: a bare [E, D] weight, not a Linear
            self.gate = nn.Module()
            self.gate.weight = mx.random.normal((experts, hidden))
        else:
            self.gate = nn.Linear(hidden, experts, bias=False)
        self.switch_mlp = nn.Linear(hidden, experts, bias=False)  # stands in for the experts
        self.shared_expert = nn.Module()
        self.shared_expert.gate_proj = nn.Linear(hidden, experts, bias=False)


@pytest.mark.parametrize("moe_gate", [False, True])
def test_the_router_of_an_mlx_lm_block_predicts_its_top_k(moe_gate):
    mx.random.seed(3)
    block = _Block(16, 8, moe_gate)
    path, router = router_of(block, "switch_mlp", 8)
    assert path == "gate" and router is block.gate
    x = mx.random.normal((1, 1, 16))
    got = predictor(block, "switch_mlp", 8, 3)(x)
    logits = np.array(x[0, 0]) @ np.array(block.gate.weight).T
    assert np.array(got).reshape(-1).tolist() == np.argsort(-logits)[:3].tolist()  # best score first
    assert predictor(block, "switch_mlp", 8, 3)(mx.zeros((1, 1, 12))) is None  # another width predicts nothing


def _run(store, mode, cache, **kw):
    e = edge0.load(store, prerouter=False, lora=False, lookahead=mode, expert_cache=cache, **kw)
    out = e.generate(e.encode(PROMPT), max_tokens=TOKENS, ignore_eos=True)
    return e, out


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])  # a spec'd family's routing; an mlx-lm block's router
def test_tokens_do_not_change_and_every_byte_read_ahead_is_used_or_counted(family, store_for):
    store = store_for(family)
    probe = edge0.load(store, prerouter=False, lora=False)
    per_slot = sum(probe.store.expert_nbytes(l) for l in probe.store.layers)
    k = next(iter(probe.streaming.layers.values())).k
    cache = (k + 1) * per_slot  # few slots: most routes miss, so there is something to read ahead
    off, want = _run(store, "off", cache)
    on, got = _run(store, "on", cache)
    assert got.tokens == want.tokens
    assert off.streaming.lookahead_layers() == 0 and off.stats()["totals"]["lookahead_predicted"] == 0
    assert on.streaming.lookahead_layers() == len(on.streaming.layers) - 1  # every MoE layer but the last
    t, base = on.stats()["totals"], off.stats()["totals"]
    assert t["lookahead_reads"] > 0 and 0 < t["lookahead_used"] <= t["lookahead_reads"]
    wasted = sum(
        (s["lookahead_reads"] - s["lookahead_used"]) * on.store.expert_nbytes(l)
        for l, s in on.stats()["layers"].items()
    )
    assert t["lookahead_wasted_bytes"] == wasted
    # every routed expert is counted once either way, one read ahead as a miss (its bytes were
    # read); every byte read beyond the misses' (and the prefill's, as without) was wasted
    assert t["hits"] + t["misses"] == base["hits"] + base["misses"]
    for l, s in on.stats()["layers"].items():
        b, nbytes = off.stats()["layers"][l], on.store.expert_nbytes(l)
        assert (
            s["bytes_read"] - s["misses"] * nbytes - s["lookahead_wasted_bytes"]
            == b["bytes_read"] - b["misses"] * nbytes
        )
    # a prediction for every layer but the first in each decode step but the first (the prompt's
    # last token went in its prefill span), each scored over the K experts its layer routes
    assert t["lookahead_predicted"] == (TOKENS - 1) * k * (len(on.streaming.layers) - 1)
    assert 0 <= t["lookahead_agreed"] <= t["lookahead_predicted"]
    assert got.stats["lookahead_recall"] == pytest.approx(t["lookahead_agreed"] / t["lookahead_predicted"])
    assert got.stats["lookahead_wasted_bytes"] == wasted
    assert "reading one layer ahead (on," in on.describe()


# Families whose routed experts are a list of modules (StreamingExpertList), called one expert
# at a time by the family's own loop: no route reaches a dispatch to be read ahead.
NO_LOOKAHEAD = {"dbrx": "its experts are a list of modules the block calls one by one"}


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_predicts_each_next_layer_and_keeps_its_tokens(family, store_for):
    store = store_for(family)
    kw = {"trust_remote_code": True} if family.startswith("kimi") else {}
    off, want = _run(store, "off", "1GB", **kw)
    on, got = _run(store, "on", "1GB", **kw)
    assert got.tokens == want.tokens
    layers = len(on.streaming.layers)
    assert on.streaming.lookahead_layers() == (0 if family in NO_LOOKAHEAD else layers - 1)


def test_a_prediction_is_written_into_the_slots_on_a_reader_and_its_call_finds_it_cached(store_for, monkeypatch):
    """read_ahead admits the predicted misses and a reader thread, not the caller, writes their
    rows into the slots; the call that routes one of them finds it cached, counts it as a miss
    read ahead and computes what exact computes; the other counts as wasted and leaves the cache. A read ahead whose
    read fails is forgotten by the cache and its error reaches that call."""
    engine = edge0.load(store_for("qwen3_moe"), expert_cache="40KB", decode_executor="staged", lora=False)
    layer = sorted(engine.streaming.layers)[0]
    ex = engine.streaming.layers[layer].decode
    assert ex.slots.n_slots == 2
    exact = ExactExecutor(engine.store, layer, "float32", engine.streaming.stats)
    x = mx.array(np.random.default_rng(4).normal(size=(1, 1, engine.model.args.hidden_size)).astype(np.float32))
    run(engine, layer, ex, x, mx.array([[[0, 1]]], dtype=mx.uint32))  # 0 and 1 cached
    writers, write = [], ex.slots.write
    monkeypatch.setattr(
        ex.slots, "write", lambda *a: writers.append((threading.current_thread().name, sorted(a[1]))) or write(*a)
    )
    s, nbytes = ex.stats, engine.store.expert_nbytes(layer)
    before = (s.lookahead_reads, s.lookahead_used, s.lookahead_wasted_bytes, s.hits, s.misses, s.loads)
    ex.read_ahead(np.array([[5, 6]]))
    assert sorted(ex.slots.slot_of) == [5, 6]  # admitted at once: they took the slots of 0 and 1
    inds = mx.array([[[5, 1]]], dtype=mx.uint32)  # 5 read ahead; 1 was evicted for it
    got = run(engine, layer, ex, x, inds)
    thread, widened = writers[0]
    assert thread.startswith("edge0-read_")  # the read-ahead pool, not the caller
    # the packed weights were read straight into their slot rows; only float16 scales are widened
    dtypes = {n: t["dtype"] for n, t in engine.store.layers[layer]["tensors"].items()}
    assert widened == sorted(n for n, d in dtypes.items() if d != "F32" and not n.endswith(".weight"))
    assert any(n.endswith(".weight") for n in dtypes) and not any(n.endswith(".weight") for n in widened)
    after = (s.lookahead_reads, s.lookahead_used, s.lookahead_wasted_bytes, s.hits, s.misses, s.loads)
    assert [a - b for a, b in zip(after, before)] == [2, 1, nbytes, 0, 2, 3]  # 5 and 6 read ahead, 1 now
    assert sorted(ex.slots.slot_of) == [1, 5]  # 6, never routed, left before the call planned: 1 took its slot
    assert np.array_equal(got, run(engine, layer, exact, x, inds))

    def broken(l, ids, into=None):
        raise OSError("the disk went away")

    monkeypatch.setattr(engine.store, "read", broken)
    ex.read_ahead(np.array([[2, 3]]))
    with pytest.raises(OSError, match="went away"):
        run(engine, layer, ex, x, mx.array([[[2, 3]]], dtype=mx.uint32))
    monkeypatch.undo()
    assert not {2, 3} & set(ex.slots.slot_of)
    inds = mx.array([[[2, 5]]], dtype=mx.uint32)
    assert np.array_equal(run(engine, layer, ex, x, inds), run(engine, layer, exact, x, inds))


def test_a_tokens_best_predicted_experts_compute_before_its_route_reaches_the_host(store_for):
    """A token's call computes the best-scored experts of its prediction that are in its slots
    (an Early part) before its route's sync; the route's pairs to them take those outputs, the
    other hits and the misses compute as usual, and the output is exact's. An early expert the
    route did not take is counted as unused and keeps its slot through the call's plan (its
    compute may still read it), even as the least recently used. A layer whose predictions
    disagree computes nothing early."""
    store = store_for("qwen3_moe")
    probe = edge0.load(store, lora=False)
    per_slot = sum(probe.store.expert_nbytes(l) for l in probe.store.layers)
    engine = edge0.load(store, expert_cache=4 * per_slot, decode_executor="staged", lora=False)
    layer = sorted(engine.streaming.layers)[0]
    ex = engine.streaming.layers[layer].decode
    assert ex.slots.n_slots == 2 * engine.streaming.layers[layer].k == 4
    exact = ExactExecutor(engine.store, layer, "float32", engine.streaming.stats)
    x = mx.array(np.random.default_rng(5).normal(size=(1, 1, engine.model.args.hidden_size)).astype(np.float32))
    for route in ([0, 1], [2, 3]):  # least recently used first: 0, 1, 2, 3
        run(engine, layer, ex, x, mx.array([[route]], dtype=mx.uint32))
    s = ex.stats
    cases = [  # prediction (best first), route, experts computed early, of them unused, cached after
        ([0, 3], [3, 5], 2, 1, {0, 2, 3, 5}),  # 3 early, 5 a miss that evicts 1, not the unused 0
        ([2, 0], [0, 1], 2, 1, {0, 1, 2, 5}),  # 0 early, 1 a miss that evicts 3, not the unused 2
        ([5, 0], [0, 5], 2, 0, {0, 1, 2, 5}),  # every pair early
    ]
    for predicted, route, computed, unused, cached in cases:
        ex.recall = 1.0
        ex.read_ahead(np.array([predicted]), read=False)
        before = (s.early_experts, s.early_unused, s.host_syncs)
        inds = mx.array([[route]], dtype=mx.uint32)
        got = run(engine, layer, ex, x, inds)
        assert [a - b for a, b in zip((s.early_experts, s.early_unused, s.host_syncs), before)] == [computed, unused, 1]
        assert set(ex.slots.slot_of) == cached
        assert np.array_equal(got, run(engine, layer, exact, x, inds))
    # read ahead (landed in the slots before the call): 4 takes the least recently used slot, 2's;
    # the call routes 5 (early) and 1 (a hit), so 4, computed early for nothing, stays cached too
    ex.recall = 1.0
    ex.read_ahead(np.array([[5, 4]]), read=True)
    assert ex.prediction.ids.tolist() == [5, 4] and set(ex.slots.slot_of) == {0, 1, 4, 5}  # best first
    before = (s.early_experts, s.early_unused, s.lookahead_used)
    inds = mx.array([[[5, 1]]], dtype=mx.uint32)
    got = run(engine, layer, ex, x, inds)
    assert [a - b for a, b in zip((s.early_experts, s.early_unused, s.lookahead_used), before)] == [2, 1, 0]
    assert set(ex.slots.slot_of) == {0, 1, 4, 5}
    assert np.array_equal(got, run(engine, layer, exact, x, inds))
    # only the best-scored: with one early expert, the prediction's first (5), not 1
    ex.early, ex.recall = 1, 1.0
    ex.read_ahead(np.array([[5, 1]]), read=False)
    before = (s.early_experts, s.early_unused)
    inds = mx.array([[[0, 5]]], dtype=mx.uint32)
    assert np.array_equal(run(engine, layer, ex, x, inds), run(engine, layer, exact, x, inds))
    assert (s.early_experts - before[0], s.early_unused - before[1]) == (1, 0)
    ex.recall = 1.0
    ex.read_ahead(np.array([[4, 0]]), read=False)  # the route takes none of what computed early
    before = (s.early_experts, s.early_unused)
    inds = mx.array([[[0, 1]]], dtype=mx.uint32)
    assert np.array_equal(run(engine, layer, ex, x, inds), run(engine, layer, exact, x, inds))
    assert (s.early_experts - before[0], s.early_unused - before[1]) == (1, 1)
    ex.early = 4
    ex.recall = 0.5  # below EARLY_RECALL
    ex.read_ahead(np.array([[3, 5]]), read=False)
    before = s.early_experts
    inds = mx.array([[[3, 5]]], dtype=mx.uint32)
    assert np.array_equal(run(engine, layer, ex, x, inds), run(engine, layer, exact, x, inds))
    assert s.early_experts == before


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=[] if f == "qwen3_moe" else pytest.mark.slow) for f in ALL_FAMILIES]
)
def test_every_family_keeps_its_tokens_with_experts_computed_before_their_route(family, store_for, monkeypatch):
    """Each family's decode with early experts on every call (EARLY_RECALL 0, a cache of 2 x K
    slots) gives the tokens of a decode without reading ahead."""
    monkeypatch.setattr(early, "EARLY_RECALL", 0.0)
    store = store_for(family)
    kw = {"trust_remote_code": True} if family.startswith("kimi") else {}
    probe = edge0.load(store, prerouter=False, lora=False, **kw)
    per_slot = sum(probe.store.expert_nbytes(l) for l in probe.store.layers)
    num_experts = min(int(v["num_experts"]) for v in probe.store.layers.values())
    k = max(d.k for d in probe.streaming.layers.values())
    cache = 2 * k * per_slot
    off, want = _run(store, "off", cache, **kw)
    on, got = _run(store, "on", cache, **kw)
    assert got.tokens == want.tokens
    computed = on.stats()["totals"]["early_experts"]
    assert computed > 0 if family not in NO_LOOKAHEAD and num_experts > 2 * k else computed == 0


def test_only_the_best_scored_cached_predictions_compute_early():
    cached = {1: 0, 3: 1, 7: 2}
    best_first = np.array([3, 5, 1, 2, 7])
    assert early.early_experts(best_first, cached, 1.0, n_slots=8, k=4, n=4) == [3, 1]  # 7 is 5th
    assert early.early_experts(best_first, cached, 1.0, n_slots=4, k=2, n=4) == [3]  # at most k: 3, 5
    assert early.early_experts(best_first, cached, 1.0, n_slots=7, k=4, n=4) == []  # no room beside a route
    assert early.early_experts(best_first, cached, early.EARLY_RECALL - 0.01, n_slots=8, k=4, n=4) == []
    assert early.early_experts(None, cached, 1.0, n_slots=4, k=2) == []
    # route 3, 4, 1, 3 against early [3, 1]: pairs 0, 2, 3 served by rows 0, 1, 0; 4 a miss
    assert early.after_route([3, 4, 1, 3], [3, 1], cached) == ([0, 2, 3], [0, 1, 0], [], [4])
    assert early.after_route([7, 1], [3], cached) == ([], [], [0, 1], [])
