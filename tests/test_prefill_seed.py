"""A prefill that reads a layer whole leaves the experts its last call routed most in the decode
slots (StagedExecutor.fill, streaming/overflow.seed_order): the first decode steps find them
cached instead of reading them again. Nothing more is read, and tokens never change."""

import numpy as np
import pytest

import edge0
from edge0.backend import core as B
from edge0.engine.request import Request
from edge0.streaming.exact import to_device
from edge0.streaming.overflow import seed_order

TEXT = "the prompt is long enough for the whole-layer prefill to read each layer once, " * 2


def test_seed_order_takes_the_most_routed_then_the_latest_experts_best_last():
    routes = np.array([[1, 2], [3, 1], [4, 5]])  # 1 routed twice; then latest first: 4, 5, 3, 2
    assert seed_order(routes, 3, 8, {}) == [5, 4, 1]
    assert seed_order(routes, 3, 8, {4: 0}) == [5, 1]
    assert seed_order(routes[None], 6, 8, {}) == [2, 3, 5, 4, 1]  # fewer routed than slots
    assert seed_order(routes, 8, 8, {0: 0, 7: 1}) == list(range(1, 7))  # slots for every expert: all


@pytest.mark.parametrize("path", ["in place", "scatter"])
def test_a_whole_layer_prefill_leaves_its_most_routed_experts_in_the_decode_slots(path, store_for):
    """`scatter`: slot tensors without a host view (a bfloat16 compute dtype) take the seed by a
    device scatter."""
    store = store_for("qwen3_moe")
    ref = edge0.load(store, decode_executor="exact", prefill_executor="exact")
    prompt = ref.encode(TEXT)
    assert len(prompt) >= 32  # the whole-layer executor's shortest chunk
    want = ref.generate(prompt, max_tokens=12, ignore_eos=True).tokens
    per_slot = sum(ref.store.expert_nbytes(l) for l in ref.store.layers)
    stats = {}
    for seed in (True, False):
        e = edge0.load(store, decode_executor="staged", prefill_executor="whole", expert_cache=4 * per_slot)
        seeded = {}
        for layer, d in e.streaming.layers.items():
            ex = d.decode
            assert ex.slots.n_slots == 4 < ex.slots.num_experts
            if path == "scatter":
                ex.slots.views = {p: dict.fromkeys(parts) for p, parts in ex.slots.params.items()}
            if not seed:
                d.prefill["whole"].on_read = None
                continue

            def fill(params, routes, ex=ex, layer=layer):
                expect = seed_order(routes, 4, ex.slots.num_experts, ex.slots.slot_of)
                ex.fill(params, routes)
                seeded[layer] = expect
                assert set(expect) <= set(ex.slots.slot_of)
                for x in expect:  # each seeded slot holds that expert's stored tensors
                    got = to_device(e.store.read(layer, [x]), 1, ex.dtype)
                    for proj, parts in got.items():
                        for part, a in parts.items():
                            row = ex.slots.params[proj][part][ex.slots.slot_of[x]]
                            assert np.array_equal(B.to_numpy(row), B.to_numpy(a[0]))

            d.prefill["whole"].on_read = fill
        assert e.generate(prompt, max_tokens=12, ignore_eos=True).tokens == want
        stats[seed] = e.stats()["layers"]
        if seed:
            assert seeded and all(len(v) == 4 for v in seeded.values())
            for layer, v in seeded.items():
                assert stats[True][layer]["seeded"] == 4
    assert sum(s["seeded"] for s in stats[False].values()) == 0
    assert (sum(s["slot_scatters"] for s in stats[True].values()) > 0) == (path == "scatter")
    # the seeds were read by the prefill, not again: the decode reads no more with them
    assert sum(s["loads"] for s in stats[True].values()) <= sum(s["loads"] for s in stats[False].values())


def test_a_held_span_hands_on_only_a_computed_call(store_for):
    """A span's call that never reached `done` (an error, a cancel) hands nothing to the decode
    slots at `release`, and keeps nothing: the span's last computed call is handed on once."""
    e = edge0.load(store_for("qwen3_moe"), decode_executor="staged", prefill_executor="whole")
    whole = next(iter(e.streaming.layers.values())).prefill["whole"]
    got = []
    whole.on_read = lambda params, routes: got.append((params, routes))
    inds = B.array(np.array([[[0, 3], [5, 3]]], dtype=np.uint32))
    whole.hold()
    whole(inds)  # no done: the call failed
    whole.release()
    assert got == [] and whole._call is None and whole._last is None
    whole.hold()
    whole(inds)
    whole.done(B.array(np.zeros(1)))
    whole.release()
    assert len(got) == 1 and np.array_equal(got[0][1], [[[0, 3], [5, 3]]])
    assert set(got[0][0]) == {"gate_proj", "up_proj", "down_proj"} and whole._last is None
    e.close()


def test_a_prompt_joining_decoding_rows_leaves_their_slots_alone(store_for):
    """A prompt prefilled while other sequences decode does not seed the slots their experts are
    in (Streaming.seeding): a lone prompt does; a second one, joining a decoding row, reads its
    layers whole but seeds nothing. Tokens are each prompt's own either way."""
    store = store_for("qwen3_moe")
    probe = edge0.load(store, lora=False)
    per_slot = sum(probe.store.expert_nbytes(l) for l in probe.store.layers)
    first, second = probe.encode(TEXT), probe.encode("another prompt, " * 10)
    alone = [probe.generate(p, max_tokens=n, ignore_eos=True).tokens for p, n in ((first, 8), (second, 3))]
    engine = edge0.load(store, decode_executor="staged", prefill_executor="whole", expert_cache=4 * per_slot)

    def totals():
        t = engine.stats()["totals"]
        return t["seeded"], t["span_whole"]

    with engine.batching() as batch:
        rows = [batch.join(Request(first, 8, ignore_eos=True))]
        batch.advance()
        seeded, whole = totals()
        assert seeded > 0 and whole > 0 and len(batch.rows) == 1
        rows.append(batch.join(Request(second, 3, ignore_eos=True)))
        while batch.busy:
            batch.advance()
    assert totals()[0] == seeded and totals()[1] > whole
    assert [r.tokens for r in rows] == alone
    assert engine.streaming.seeding is True  # the batch is over: no row decodes
    engine.generate(first, max_tokens=2, ignore_eos=True)
    assert totals()[0] > seeded
