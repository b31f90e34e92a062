"""One staged decode call from the inside: its hits' part comes before any read or bookkeeping,
its misses are read and planned by its deferred part (or it is planned at `done`), a failed read
leaves the cache as the slots are, its output starts computing at once, and no decode step
imports a module."""

import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import edge0
from edge0.backend import core as B
from edge0.streaming.exact import ExactExecutor
from tests.test_executors import run


def test_a_calls_hits_compute_while_its_misses_are_read_and_match_exact(store_for, monkeypatch):
    """A staged call (two slots) with cached and missing experts returns its hits' pairs as a part over the
    slots at once, before any read or bookkeeping (a token's plan waits too: the hits compute from
    the slots as they are), and the misses as a deferred part that plans the call, reads them once
    the hits part is launched and computes them from the slots they are written to; the two
    parts' pairs reassemble to exactly what one exact call computes, for one token and for a
    batch of rows (the rows' pairs split across the parts)."""
    engine = edge0.load(store_for("qwen3_moe"), expert_cache="40KB", decode_executor="staged")
    layer = sorted(engine.streaming.layers)[0]
    ex = engine.streaming.layers[layer].decode
    assert ex.slots.n_slots == 2
    exact = ExactExecutor(engine.store, layer, "float32", engine.streaming.stats)
    dim = engine.model.args.hidden_size
    rng = np.random.default_rng(1)
    real, started, intos = engine.store.read, threading.Event(), []

    def held_read(l, ids, into=None):
        started.set()
        intos.append(into)
        return real(l, ids, into)

    run(engine, layer, ex, mx.zeros((1, 1, dim)), mx.array([[[0, 1]]], dtype=mx.uint32))  # 0 and 1 cached
    monkeypatch.setattr(engine.store, "read", held_read)
    misses, step = ex.stats.misses, ex.step
    hits, deferred = ex(mx.array([[[1, 5]]], dtype=mx.uint32))
    assert callable(deferred) and not started.is_set() and 5 not in ex.slots.slot_of
    assert (ex.stats.misses, ex.step) == (misses, step)  # planned by the deferred part, after the hits launch
    mx.eval(hits[0], hits[1])  # computable before the read
    params, rows, pairs = deferred()
    assert started.is_set() and 5 in ex.slots.slot_of and (ex.stats.misses, ex.step) == (misses + 1, step + 1)
    assert hits[2].tolist() == [0] and pairs.tolist() == [1]
    # the miss took a slot: its pairs compute from there, not from a second copy of its bytes,
    # and it was read straight into that slot's rows (no block of fresh bytes to copy from)
    assert params is ex.slots.params and np.array(rows).tolist() == [ex.slots.slot_of[5]]
    assert len(intos) == 1 and intos[0] and all(len(r) == 1 for r in intos[0].values())
    assert int(ex.slots.table_host[5]) == ex.slots.slot_of[5]
    # 1 and 5 are cached, then 5 and 2; the batch's union of six outgrows the two slots
    for routes in ([[[5, 2]]], [[[5, 3]], [[6, 2]], [[4, 7]]]):
        inds = mx.array(np.array(routes, np.uint32))
        x = mx.array(rng.normal(size=(*inds.shape[:-1], dim)).astype(np.float32))
        before, intos[:] = ex.stats.overlapped, []
        got = run(engine, layer, ex, x, inds)
        # one token's miss is read into its slot; a batch's misses beyond the slots are read for
        # the call only, into a fresh block
        assert len(intos) == 1 and (not intos[0]) == (len(routes) > 1)
        assert ex.stats.overlapped == before + 1
        assert np.array_equal(got, run(engine, layer, exact, x, inds))
    # a resize makes new slot tensors and their host views at once (making one probes its
    # tensor: never while a part computes); rows written through them are what the slots hold
    old = ex.slots.views["gate_proj"]["weight"]
    ex.resize(2)
    view = ex.slots.views["gate_proj"]["weight"]
    assert view is not None and view is not old and len(ex.slots.slot_of) == 2
    x = mx.array(rng.normal(size=(1, 1, dim)).astype(np.float32))
    inds = mx.array([[[sorted(ex.slots.slot_of)[0], 7]]], dtype=mx.uint32)
    assert np.array_equal(run(engine, layer, ex, x, inds), run(engine, layer, exact, x, inds))


def test_a_tokens_call_that_hits_every_expert_is_planned_once_its_compute_started(store_for):
    """One token whose experts are all cached gets its part at once; its bookkeeping (the plan,
    hits, the step) runs at `done`, after the layer's output was launched, or, if `done` never
    came (an error while building the layer), before anything else touches the slots."""
    engine = edge0.load(store_for("qwen3_moe"), expert_cache="40KB", decode_executor="staged")
    layer = sorted(engine.streaming.layers)[0]
    ex = engine.streaming.layers[layer].decode
    dim = engine.model.args.hidden_size
    run(engine, layer, ex, mx.zeros((1, 1, dim)), mx.array([[[0, 1]]], dtype=mx.uint32))  # 0 and 1 cached
    hits, step = ex.stats.hits, ex.step
    (part,) = ex(mx.array([[[1, 0]]], dtype=mx.uint32))
    assert (ex.stats.hits, ex.step) == (hits, step)
    y = mx.zeros((1, dim))
    ex.done(y)
    assert (ex.stats.hits, ex.step) == (hits + 2, step + 1)
    ex(mx.array([[[0, 1]]], dtype=mx.uint32))  # its `done` never comes
    x = mx.array(np.random.default_rng(2).normal(size=(1, 1, dim)).astype(np.float32))
    inds = mx.array([[[5, 0]]], dtype=mx.uint32)
    got = run(engine, layer, ex, x, inds)
    assert (ex.stats.hits, ex.step) == (hits + 5, step + 3) and sorted(ex.slots.slot_of) == [0, 5]
    exact = ExactExecutor(engine.store, layer, "float32", engine.streaming.stats)
    assert np.array_equal(got, run(engine, layer, exact, x, inds))


FIRST_STEPS = """
import sys, edge0
e = edge0.load(sys.argv[1], expert_cache="40KB", decode_executor=sys.argv[2])
steps = e.stream_generate(e.encode("the first decode steps"), max_tokens=4, ignore_eos=True)
next(steps)
before = set(sys.modules)
for _ in steps:
    pass
print(sorted(set(sys.modules) - before))
"""


@pytest.mark.parametrize("executor", ["staged", "exact"])
def test_decode_steps_import_nothing(store_for, executor):
    """A module imported in a decode step costs that step tens of milliseconds once (numpy.ma,
    which np.unique imports at its first call, cost the first step 50 ms): the load imports them.
    In a fresh process, since this one has imported everything already."""
    out = subprocess.run(
        [sys.executable, "-c", FIRST_STEPS, str(store_for("qwen3_moe")), executor],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_failed_read_leaves_the_cache_as_the_slots_are(store_for, monkeypatch):
    """A call's misses whose read fails: the cache forgets the misses it admitted (and the experts
    it evicted for them read as zeros), so the next call reads them again instead of taking
    slots that were never written for hits."""
    engine = edge0.load(store_for("qwen3_moe"), expert_cache="40KB", decode_executor="staged")
    layer = sorted(engine.streaming.layers)[0]
    ex = engine.streaming.layers[layer].decode
    exact = ExactExecutor(engine.store, layer, "float32", engine.streaming.stats)
    x = mx.array(np.random.default_rng(2).normal(size=(1, 1, engine.model.args.hidden_size)).astype(np.float32))
    run(engine, layer, ex, x, mx.array([[[0, 1]]], dtype=mx.uint32))

    def broken(l, ids, into=None):
        raise OSError("the disk went away")

    for route in ([[[1, 5]]], [[[6, 7]]]):  # hits and a miss (the split), then misses only
        monkeypatch.setattr(engine.store, "read", broken)
        with pytest.raises(OSError):
            run(engine, layer, ex, x, mx.array(route, dtype=mx.uint32))
        monkeypatch.undo()
        assert not set(np.reshape(route, -1)) - {1} & set(ex.slots.slot_of)
        inds = mx.array([[[5, 0]]], dtype=mx.uint32)
        assert np.array_equal(run(engine, layer, ex, x, inds), run(engine, layer, exact, x, inds))


def test_a_host_routed_token_starts_its_experts_before_the_next_layer_is_built(store_for, monkeypatch):
    """After one token's host-routed call (staged or exact) the layer's output is handed to
    async_eval at once, so the experts compute while the host builds the next layer up to its
    route; a call whose route was staged ahead (no sync) and a several-token call are left lazy."""
    engine = edge0.load(store_for("qwen3_moe"), expert_cache="40KB", decode_executor="staged", lora=False)
    layer = sorted(engine.streaming.layers)[0]
    ex = engine.streaming.layers[layer].decode
    exact = ExactExecutor(engine.store, layer, "float32", engine.streaming.stats)
    started = []
    monkeypatch.setattr(B, "async_eval", lambda *a: started.append(a))
    x = mx.array(np.random.default_rng(5).normal(size=(1, 1, engine.model.args.hidden_size)).astype(np.float32))
    one, two = mx.array([[[0, 1]]], dtype=mx.uint32), mx.array([[[0, 1], [2, 3]]], dtype=mx.uint32)
    for executor in (ex, exact):
        started.clear()
        run(engine, layer, executor, x, one)
        assert len(started) == 1
        started.clear()
        run(engine, layer, executor, mx.concatenate([x, x], axis=1), two)
        assert started == []
    ex.stage(np.array([0, 1]))
    ex.swap()  # the next call trusts the staged route: no sync
    started.clear()
    syncs = ex.stats.host_syncs
    run(engine, layer, ex, x, one)
    assert started == [] and ex.stats.host_syncs == syncs
