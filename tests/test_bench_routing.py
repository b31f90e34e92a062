"""Synthetic routing in a live engine (`edge0 bench --routing qwen3-like`): every MoE layer
computes with the generator's routes, and the pre-router arms' stager reads them one step ahead."""

from __future__ import annotations

import numpy as np
import pytest

import edge0
from edge0.bench.routing import use_synthetic_routing
from edge0.cache.synthetic import generate


def load(store, **kw):
    return edge0.load(store, prerouter=False, lora=False, prefill_executor="exact", **kw)


def test_layers_compute_with_the_generated_routes(store_for):
    e = load(store_for("qwen3_moe"), decode_executor="exact")
    use_synthetic_routing(e, seed=3)
    seen = {}
    e.observe_routes(lambda layer, inds, scores: seen.setdefault(layer, []).append(inds))
    prompt = e.encode("hello world, once upon a time")
    e.generate(prompt, max_tokens=6, ignore_eos=True)
    layers = sorted(seen)
    used = np.stack([np.concatenate(seen[l]) for l in layers])  # [L, T, K]
    want, _ = generate(e.spec.num_experts, e.k, len(layers), used.shape[1], seed=3)
    assert used.shape[1] == len(prompt) + 5
    np.testing.assert_array_equal(used, want)


def test_lookahead_staging_reads_ahead_with_no_drops_or_syncs(store_for):
    store = store_for("qwen3_moe")
    ref = load(store, decode_executor="exact")
    use_synthetic_routing(ref, seed=1)
    prompt = ref.encode("hello world, once upon a time")
    want = ref.generate(prompt, max_tokens=16, ignore_eos=True)
    per_slot = sum(ref.store.expert_nbytes(l) for l in ref.store.layers)
    e = load(store, decode_executor="staged", expert_cache=(ref.k + 1) * per_slot)
    use_synthetic_routing(e, seed=1, lookahead=True)
    got = e.generate(prompt, max_tokens=16, ignore_eos=True)
    assert got.tokens == want.tokens  # the same routes, computed from the slots
    n_layers = len(e.store.layers)
    assert got.stats["dropped_experts"] == 0
    # the exact prefill (the last layer computes only its cache there) and the first step only
    assert got.stats["host_syncs"] == 2 * n_layers - 1
    t = e.stats()["totals"]
    assert t["slot_rewrites"] > 0 and t["hits"] > 0


def test_speculation_keeps_each_token_position_on_its_route(store_for):
    """A rejected draft gives its routes back: speculative tokens equal plain ones under synthetic routes."""
    from edge0.bench.speculative import controlled

    e = load(store_for("qwen3_moe"), decode_executor="staged")
    use_synthetic_routing(e, seed=2)
    prompt = e.encode("hello world, once upon a time")
    want = e.generate(prompt, max_tokens=14, ignore_eos=True).tokens
    assert e.generate(prompt, max_tokens=14, ignore_eos=True).tokens == want  # every generation restarts the routes
    e.use_speculation(controlled(e, want, 0.6, 4, adaptive=False))
    res = e.generate(prompt, max_tokens=14, ignore_eos=True)
    assert res.tokens == want
    assert 0 < res.stats["speculation"]["accepted"] < res.stats["speculation"]["drafted"]


def test_verify_cost_walks_the_true_continuation_and_leaves_generation_unchanged(store_for):
    from edge0.bench.speculative import forward_cost

    e = load(store_for("qwen3_moe"), decode_executor="staged")
    use_synthetic_routing(e, seed=2)
    prompt = e.encode("hello world, once upon a time")
    want = e.generate(prompt, max_tokens=9, ignore_eos=True).tokens
    before = e.stats()["totals"]["calls"]
    assert forward_cost(e, prompt, want, 3, repeats=5) > 0
    moe_layers = len(e.store.layers)
    assert e.stats()["totals"]["calls"] - before == moe_layers * (1 + 3)  # the prefill, then 9 // 3 steps of 3
    assert e.generate(prompt, max_tokens=9, ignore_eos=True).tokens == want
    with pytest.raises(ValueError, match="no timed step of 10"):
        forward_cost(e, prompt, want, 10, repeats=1)


def test_each_row_of_a_batch_routes_as_its_own_text(store_for):
    """--routing qwen3-like under --concurrency: row r of a batch takes text r's routes (the same
    popular experts, its own token-by-token process), the routes one-after-another runs give
    generation r with first_text = r."""
    e = load(store_for("qwen3_moe"), decode_executor="exact")
    routes = use_synthetic_routing(e, seed=4)
    seen = []
    e.observe_routes(lambda layer, inds, scores: layer == routes.layers[0] and seen.append(inds))
    prompts = [e.encode("hello world"), e.encode("once upon a time there was")]
    e.generate_batch(prompts, max_tokens=4, ignore_eos=True)
    steps = np.stack(seen[-4:])  # the batch's 4 decode steps (2 rows each), after the prompts' prefills: [4, 2, K]

    def first_layer(text, n):  # the first MoE layer's routes of `n` tokens of text `text`
        return generate(e.spec.num_experts, e.k, len(routes.layers), n, seed=4, text_seed=text)[0][0]

    prefilled = sum(len(p) - 1 for p in prompts)  # both prompts prefilled alone, on row 0's stream
    np.testing.assert_array_equal(steps[:, 0], first_layer(None, prefilled + 4)[prefilled:])
    np.testing.assert_array_equal(steps[:, 1], first_layer(1, 4))
    assert not np.array_equal(steps[:, 0], steps[:, 1])
    routes.first_text = 1  # generation by generation, as one after another: text 1 alone
    seen.clear()
    e.generate(prompts[1], max_tokens=4, ignore_eos=True)
    np.testing.assert_array_equal(np.concatenate(seen), first_layer(1, len(prompts[1]) + 3))


def test_a_step_of_tokens_as_rows_routes_each_token_as_its_own_text(store_for):
    """The concurrency bench's B-token step (`route_tokens_as_rows`): token j of one sequence's
    step takes row j's text's routes, as row j of a batch would, so the step reads a batch's union."""
    from edge0.bench.speculative import forward_cost

    e = load(store_for("qwen3_moe"), decode_executor="staged")
    routes = use_synthetic_routing(e, seed=5)
    prompt = e.encode("hello world, once upon a time")
    want = e.generate(prompt, max_tokens=8, ignore_eos=True).tokens
    seen = []
    e.observe_routes(lambda layer, inds, scores: layer == routes.layers[0] and seen.append(np.array(inds)))
    assert forward_cost(e, prompt, want, 3, repeats=1, warmup=1, before_steps=routes.route_tokens_as_rows) > 0
    steps = np.stack([s.reshape(-1, e.k) for s in seen[-2:]])  # the warm-up and the timed step: [2, 3, K]

    def first_layer(text, n):
        return generate(e.spec.num_experts, e.k, len(routes.layers), n, seed=5, text_seed=text)[0][0]

    n = len(prompt)  # the prompt is prefilled on text 0's stream
    np.testing.assert_array_equal(steps[:, 0], first_layer(None, n + 2)[n:])
    np.testing.assert_array_equal(steps[:, 1], first_layer(1, 2))
    np.testing.assert_array_equal(steps[:, 2], first_layer(2, 2))
    assert e.generate(prompt, max_tokens=8, ignore_eos=True).tokens == want  # the next generation: as before
    assert not routes.tokens_as_rows


def test_the_read_ahead_stages_the_next_steps_rows_when_a_row_ends(store_for):
    """Rows ending at different steps: after the step that ends row 0, the rows behind it move up
    and route as their new index; the read-ahead stages exactly the routes the next step takes."""
    store = store_for("qwen3_moe")
    e = load(store, decode_executor="staged")
    routes = use_synthetic_routing(e, seed=6, lookahead=True)
    layer = sorted(e.hooks.staged)[0]
    events = []
    ex = e.hooks.staged[layer]
    ex.stage = lambda ids, *a, orig=ex.stage: (events.append(("stage", np.array(ids))), orig(ids, *a))[1]
    e.observe_routes(lambda l, inds, scores: l == layer and events.append(("route", np.array(inds))))
    prompts = [e.encode(t) for t in ("hello world", "once upon a time", "the quick brown fox")]
    e.generate_batch(prompts, max_tokens=[2, 5, 5], ignore_eos=True)
    pairs = [(a[1], b[1]) for a, b in zip(events, events[1:]) if a[0] == "stage" and b[0] == "route"]
    assert len(pairs) == 4  # 5 steps (the longest rows), every one but the last stages the next
    for staged, routed in pairs:
        assert set(staged.reshape(-1).tolist()) == set(routed.reshape(-1).tolist())
    assert routes.staged_rows() == 2


def test_a_batch_steps_read_ahead_starts_in_each_layer_once_it_has_routed(store_for):
    """A batch's layers route on the host; each one's next-step reads start right after its own
    route, while the later layers compute (as the pre-router's stager does)."""
    e = load(store_for("qwen3_moe"), decode_executor="staged")
    use_synthetic_routing(e, seed=6, lookahead=True)
    ev = []
    for layer, ex in e.hooks.staged.items():
        ex.stage = lambda *a, layer=layer, orig=ex.stage: (ev.append(("stage", layer)), orig(*a))[1]
        ex.host_ids = lambda ind, layer=layer, orig=ex.host_ids: (ev.append(("route", layer)), orig(ind))[1]
    prompts = [e.encode(t) for t in ("hello world", "once upon a time", "the quick brown fox")]
    e.generate_batch(prompts, max_tokens=5, ignore_eos=True)
    stages = [i for i, x in enumerate(ev) if x[0] == "stage"]
    assert len(stages) == 4 * len(e.hooks.staged)  # 5 steps, every one but the last stages the next
    assert all(ev[i - 1] == ("route", ev[i][1]) for i in stages), ev
    assert e.stats()["totals"]["dropped"] == 0
