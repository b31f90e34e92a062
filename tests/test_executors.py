"""Every executor computes what the exact path computes: checked against a float32 dequantized
reference on random inputs, against exact tokens on every spec'd family, under a small memory
budget, with zero host syncs when the route is staged ahead, and under constant eviction."""

import gc
import threading

import mlx.core as mx
import numpy as np
import pytest

import edge0
from edge0.backend import core as B
from edge0.backend.moe import StreamingExperts
from edge0.engine import StepHooks
from edge0.errors import Edge0Error
from edge0.streaming.exact import ExactExecutor
from tests.fixtures.families import SPECD

LONG_PROMPT = "once upon a time there was a tiny model that read its experts from disk, " * 2


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def dequantized_reference(store, layer, x, inds):
    """float32 SwiGLU experts computed from dequantized int4 weights, one (token, k) at a time."""
    info = store.layers[layer]
    t = {
        f"{info['module']}.{name}": B.from_raw(buf, dt, (info["num_experts"], *shape))
        for name, (buf, dt, shape) in store.read_layer(layer).items()
    }
    w = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        p = f"{info['module']}.{proj}"
        w[proj] = np.array(
            mx.dequantize(
                t[f"{p}.weight"],
                t[f"{p}.scales"].astype(mx.float32),
                t[f"{p}.biases"].astype(mx.float32),
                group_size=64,
                bits=4,
            )
        )
    x, inds = np.array(x, np.float64)[0], np.array(inds)[0]
    out = np.zeros((*inds.shape, x.shape[-1]))
    for i, row in enumerate(inds):
        for j, e in enumerate(row):
            g, u = w["gate_proj"][e] @ x[i], w["up_proj"][e] @ x[i]
            out[i, j] = w["down_proj"][e] @ (g / (1 + np.exp(-g)) * u)
    return out[None]


def run(engine, layer, executor, x, inds):
    module = next(m for _, m in engine.model.named_modules() if isinstance(m, StreamingExperts) and m.layer == layer)
    saved, lookahead = module.executor, module.lookahead
    object.__setattr__(module, "executor", executor)
    module.use_lookahead(None)  # reading ahead is the engine's LayerDispatch's, not a bare executor's
    try:
        y = module(x, inds)
        mx.eval(y)
        return np.array(y)
    finally:
        object.__setattr__(module, "executor", saved)
        module.use_lookahead(lookahead)


class SwappedGateUp(ExactExecutor):
    """A deliberately wrong executor: gate and up exchanged."""

    def __call__(self, indices, scores=None):
        parts = super().__call__(indices)
        for params, _ in parts:
            params["gate_proj"], params["up_proj"] = params["up_proj"], params["gate_proj"]
        return parts


@pytest.fixture(scope="module")
def engine(store_for):
    return edge0.load(store_for("qwen3_moe"), expert_cache="40KB", decode_executor="staged")


def test_every_path_matches_dequantized_reference_and_exact(engine):
    rng = np.random.default_rng(0)
    st = engine.streaming
    layer = sorted(st.layers)[0]
    d = st.layers[layer]
    dim = engine.model.args.hidden_size
    hot = edge0.load(engine.root, expert_cache="40KB", decode_executor="hot").streaming.layers[layer].decode
    exact = ExactExecutor(engine.store, layer, "float32", st.stats)
    checked = 0
    for t, executors in (
        (40, {"whole": d.prefill["whole"], "exact": d.prefill["exact"]}),
        (1, {"staged": d.decode, "hot": hot, "exact": exact}),
    ):
        for _ in range(12 if t == 1 else 2):  # several decode steps: slots fill, evict, refresh
            x = mx.array(rng.normal(size=(1, t, dim)).astype(np.float32))
            inds = mx.array(np.stack([rng.choice(8, 2, replace=False) for _ in range(t)])[None].astype(np.uint32))
            ref = dequantized_reference(engine.store, layer, x, inds)
            want = run(engine, layer, exact, x, inds)
            for name, ex in executors.items():
                got = run(engine, layer, ex, x, inds)
                assert rel_l2(got, ref) < 0.01, name
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
                checked += 1
    assert checked == 2 * 2 + 12 * 3
    # The reference check has teeth: swapping gate and up fails it.
    x = mx.array(rng.normal(size=(1, 4, dim)).astype(np.float32))
    inds = mx.array(np.array([[[0, 1], [2, 3], [4, 5], [6, 7]]], np.uint32))
    bad = run(engine, layer, SwappedGateUp(engine.store, layer, "float32", st.stats), x, inds)
    assert rel_l2(bad, dequantized_reference(engine.store, layer, x, inds)) > 0.05


@pytest.mark.parametrize("family", SPECD)
def test_all_executors_give_exact_tokens(family, store_for):
    store = store_for(family)
    prompt_engine = edge0.load(store, prefill_executor="exact", decode_executor="exact")
    prompt = prompt_engine.encode(LONG_PROMPT)
    assert len(prompt) >= 32  # long enough for whole-layer prefill
    want = prompt_engine.generate(prompt, max_tokens=16, ignore_eos=True).tokens
    k = prompt_engine.spec.top_k
    per_slot = sum(prompt_engine.store.expert_nbytes(l) for l in prompt_engine.store.layers)
    for prefill in ("whole", "exact"):
        for decode in ("staged", "hot"):
            e = edge0.load(store, prefill_executor=prefill, decode_executor=decode, expert_cache=(k + 1) * per_slot)
            got = e.generate(prompt, max_tokens=16, ignore_eos=True)
            assert got.tokens == want, (family, prefill, decode)
            t = e.stats()["totals"]
            assert t["loads"] > 0 and t["slot_rewrites"] > 0 and t["hits"] > 0, (prefill, decode)
            if prefill == "whole":
                assert t["loads"] >= len(e.store.layers) * e.spec.num_experts  # whole layers were read


def test_per_layer_executor_choice(store_for):
    store = store_for("qwen3_moe")
    base = edge0.load(store, decode_executor="exact")
    layers = sorted(base.store.layers)
    mixed = edge0.load(store, layer_executors={layers[0]: {"decode": "hot", "prefill": "exact"}})
    assert mixed.streaming.layers[layers[0]].decode.name == "hot"
    assert mixed.streaming.layers[layers[1]].decode.name == "staged"
    prompt = base.encode(LONG_PROMPT)
    assert (
        mixed.generate(prompt, max_tokens=10, ignore_eos=True).tokens
        == base.generate(prompt, max_tokens=10, ignore_eos=True).tokens
    )
    with pytest.raises(Edge0Error, match="decode-executor"):
        edge0.load(store, decode_executor="bogus")


def test_budget_too_small_is_a_clear_error(store_for):
    with pytest.raises(Edge0Error, match="too small.*--expert-cache"):
        edge0.load(store_for("qwen3_moe"), expert_cache="1KB")


def test_memory_budget_bounds_mlx_peak(big_store):
    budget = 8 * 2**20
    gc.collect()  # MLX's peak counts every live array of the process: other tests' engines too
    others = mx.get_active_memory()
    e = edge0.load(big_store, expert_cache=budget, prefill_executor="exact", decode_executor="staged")
    total_experts = e.streaming.total_expert_bytes
    assert total_experts > 10 * budget
    res = e.generate("hello world once upon a time", max_tokens=24, ignore_eos=True)
    assert e.stats()["totals"]["misses"] > 0
    kv = 64 * 2**10 * 2  # 2 layers x (k + v) x 40 tokens x 128 floats x 4 B, rounded up
    constant = 24 * 2**20  # exact prefill of <= T*K experts per layer, MLX temporaries
    peak = res.stats["peak_memory_bytes"] - others
    assert peak <= e.resident_bytes + budget + kv + constant
    assert peak < e.resident_bytes + total_experts


class OracleStager(StepHooks):
    """Stages each decode step's true route ahead of time (as the pre-router will), optionally
    issuing step t+1's reads before step t computes."""

    sees_first_forward = True  # step t stages the route recorded at step t: step 0 feeds the prompt's last token

    def __init__(self, engine, routes: dict, ahead: bool):
        self.staged, self.routes, self.ahead = engine.streaming.staged, routes, ahead

    def before_step(self, step):
        for layer, ex in self.staged().items():
            if self.ahead:
                if step == 1:
                    ex.stage(self.routes[layer][1])
                ex.swap()
                if step + 1 < len(self.routes[layer]):
                    ex.stage(self.routes[layer][step + 1])  # read during this step's compute
            else:
                ex.stage(self.routes[layer][step])
                ex.swap()


def record_decode_routes(engine, prompt, n):
    """Each layer's route at each decode step; step 0 feeds the prompt's last token (not its
    prefill span), as under a stager."""
    engine.hooks.sees_first_forward = True
    routes = {}
    engine.observe_routes(
        lambda layer, inds, _: inds.shape[0] == 1 and routes.setdefault(layer, []).append(inds[0].tolist())
    )
    tokens = engine.generate(prompt, max_tokens=n, ignore_eos=True).tokens
    engine.observe_routes(None)
    return routes, tokens


def test_staged_covered_route_does_zero_host_syncs(store_for):
    store = store_for("qwen3_moe")
    ref = edge0.load(store, decode_executor="exact", prefill_executor="exact")
    prompt = ref.encode("hello world, once upon a time")
    routes, want = record_decode_routes(ref, prompt, 12)
    e = edge0.load(store, decode_executor="staged", prefill_executor="exact")
    e.hooks = OracleStager(e, routes, ahead=False)
    res = e.generate(prompt, max_tokens=12, ignore_eos=True)
    assert res.tokens == want
    n_layers = len(e.store.layers)
    # One sync per layer for the exact prefill (the last layer computes only its cache there) and
    # one for the first (unstaged) token; none in the 11 staged decode steps.
    assert res.stats["host_syncs"] == 2 * n_layers - 1
    assert res.stats["dropped_experts"] == 0
    assert e.stats()["totals"]["calls"] >= 12 * n_layers


def _exact_reference(store_for, text: str):
    """(store, the exact engine, the prompt's ids, its 12 greedy tokens, one slot's bytes in every
    MoE layer) for the qwen3_moe fixture."""
    store = store_for("qwen3_moe")
    ref = edge0.load(store, decode_executor="exact", prefill_executor="exact")
    prompt = ref.encode(text)
    want = ref.generate(prompt, max_tokens=12, ignore_eos=True).tokens
    return store, ref, prompt, want, sum(ref.store.expert_nbytes(l) for l in ref.store.layers)


def test_a_cache_holding_every_expert_decodes_without_host_syncs(store_for):
    store, ref, prompt, want, per_slot = _exact_reference(store_for, "hello world, once upon a time")
    e = edge0.load(
        store, decode_executor="staged", prefill_executor="exact", expert_cache=ref.spec.num_experts * per_slot
    )
    staged = e.streaming.staged().values()
    for ex in staged:  # every expert into its slot
        _, loaded, evicted, slots = ex.slots.plan(0, list(range(ex.slots.num_experts)), None)
        ex.slots.apply(evicted, loaded, slots, ex.store.read(ex.layer, loaded), in_place=True)
        assert ex.holds_every_expert()
    start = e.stats()["totals"]
    one = e.generate(prompt, max_tokens=1, ignore_eos=True)  # the prefill's token alone
    before = e.stats()["totals"]
    res = e.generate(prompt, max_tokens=12, ignore_eos=True)
    after = e.stats()["totals"]
    assert res.tokens == want
    assert res.stats["host_syncs"] == one.stats["host_syncs"] > 0  # the 11 decode steps sync nowhere
    # beyond what the prefill's token did, every routed expert of the 11 steps hit (counted after
    # each step from the device routes) and nothing was read
    steps, n_layers = 11, len(e.store.layers)
    assert after["misses"] - before["misses"] == before["misses"] - start["misses"]
    assert (after["hits"] - before["hits"]) - (before["hits"] - start["hits"]) == steps * n_layers * ref.spec.top_k
    assert after["lookahead_predicted"] == before["lookahead_predicted"]


def test_a_whole_layer_prefill_fills_a_cache_that_holds_every_expert(store_for):
    text = "hello world, once upon a time, in a land far away"
    store, ref, prompt, want, per_slot = _exact_reference(store_for, text)
    layers = {}
    for fill in (True, False):
        e = edge0.load(
            store, decode_executor="staged", prefill_executor="whole", expert_cache=ref.spec.num_experts * per_slot
        )
        if not fill:
            for d in e.streaming.layers.values():
                d.prefill["whole"].on_read = None
        assert e.generate(prompt, max_tokens=12, ignore_eos=True).tokens == want
        layers[fill] = e.stats()["layers"]
    # every layer the prefill read whole (all but the last, which computes only the last token
    # there) filled its slots from that read: its decode steps read and synced nothing
    *read_whole, last = sorted(layers[True])
    for l in read_whole:
        assert layers[True][l]["host_syncs"] == 0 < layers[False][l]["host_syncs"]
        assert layers[True][l]["misses"] == 0 and layers[True][l]["slot_rewrites"] == ref.spec.num_experts
    assert layers[True][last]["host_syncs"] > 0


def test_unstaged_experts_are_counted_exactly_as_dropped(store_for):
    store = store_for("qwen3_moe")
    ref = edge0.load(store, decode_executor="exact", prefill_executor="exact")
    prompt = ref.encode("hello world, once upon a time")
    routes, _ = record_decode_routes(ref, prompt, 12)
    wrong = {layer: r[1:] + r[:1] for layer, r in routes.items()}  # each step staged with another step's route
    per_slot = sum(ref.store.expert_nbytes(l) for l in ref.store.layers)
    e = edge0.load(store, decode_executor="staged", prefill_executor="exact", expert_cache=ref.spec.top_k * per_slot)
    e.hooks = OracleStager(e, wrong, ahead=False)  # k slots: the slot set is exactly the staged route
    used, _ = record_decode_routes(e, prompt, 12)
    per_layer = {l: sum(len(set(u) - set(s)) for u, s in zip(used[l][1:], wrong[l][1:])) for l in used}
    assert sum(per_layer.values()) > 0
    assert {l: d["dropped"] for l, d in e.stats()["layers"].items()} == per_layer


def test_stress_background_reads_with_constant_eviction(store_for):
    store = store_for("qwen3_moe")
    ref = edge0.load(store, decode_executor="exact", prefill_executor="exact")
    prompt = ref.encode("hello world, once upon a time")
    routes, want = record_decode_routes(ref, prompt, 64)
    k = ref.spec.top_k
    per_slot = sum(ref.store.expert_nbytes(l) for l in ref.store.layers)
    e = edge0.load(store, decode_executor="staged", prefill_executor="exact", expert_cache=k * per_slot)
    assert e.streaming.n_slots == k  # every new expert evicts one
    e.hooks = OracleStager(e, routes, ahead=True)
    res = e.generate(prompt, max_tokens=64, ignore_eos=True)
    assert res.tokens == want
    t = e.stats()["totals"]
    assert t["slot_rewrites"] > 64 and t["dropped"] == 0


def test_in_place_slot_writes_match_the_scatter_reference(store_for):
    store = store_for("qwen3_moe")
    ref = edge0.load(store, decode_executor="exact", prefill_executor="exact")
    prompt = ref.encode("hello world, once upon a time")
    routes, want = record_decode_routes(ref, prompt, 24)
    per_slot = sum(ref.store.expert_nbytes(l) for l in ref.store.layers)
    totals = {}
    for path in ("in place", "scatter"):
        e = edge0.load(
            store, decode_executor="staged", prefill_executor="exact", expert_cache=ref.spec.top_k * per_slot
        )
        if path == "scatter":  # the reference: every rewrite makes new slot tensors on the device
            for ex in e.streaming.staged().values():
                ex.slots.views = {p: dict.fromkeys(parts) for p, parts in ex.slots.params.items()}
        e.hooks = OracleStager(e, routes, ahead=True)
        assert e.generate(prompt, max_tokens=24, ignore_eos=True).tokens == want
        totals[path] = e.stats()["totals"]
    assert totals["in place"]["slot_rewrites"] == totals["scatter"]["slot_rewrites"] > 24
    assert totals["in place"]["slot_scatters"] == 0 and totals["scatter"]["slot_scatters"] > 0


def test_live_cache_policies_change_reads_not_outputs(store_for):
    store = store_for("qwen3_moe")
    ref = edge0.load(store, decode_executor="exact")
    prompt = ref.encode(LONG_PROMPT)
    want = ref.generate(prompt, max_tokens=24, ignore_eos=True).tokens
    per_slot = sum(ref.store.expert_nbytes(l) for l in ref.store.layers)
    reads = {}
    for policy in ("lru", "lfu", "arc"):
        e = edge0.load(
            store, cache_policy=policy, expert_cache=(ref.spec.top_k + 2) * per_slot, prefill_executor="exact"
        )
        assert e.generate(prompt, max_tokens=24, ignore_eos=True).tokens == want, policy
        t = e.stats()["totals"]
        reads[policy] = (t["bytes_read"], t["hits"])
        assert t["misses"] > 0 and t["hits"] > 0
    assert len(set(reads.values())) > 1  # the policies really made different choices
    with pytest.raises(Edge0Error, match="cache-policy"):
        edge0.load(store, cache_policy="belady")


def test_whole_layer_prefill_releases_each_layer(store_for):
    store = store_for("qwen3_moe", num_hidden_layers=8, num_experts=32)
    gc.collect()
    base = mx.get_active_memory()  # what other tests in this process still hold (module fixtures)
    e = edge0.load(store, prefill_executor="whole", decode_executor="exact")
    prompt = e.encode(LONG_PROMPT)
    per_layer = e.streaming.total_expert_bytes // len(e.store.layers)
    res = e.generate(prompt, max_tokens=2, ignore_eos=True)
    assert e.stats()["totals"]["loads"] >= 7 * 32  # every layer but the last (its cache alone) was read whole
    slack = 4 * 2**20  # KV cache, activations, logits
    # the peak counts what other tests in this process still hold too (`base`): in one -n 2 run its
    # worker's peak was 3.46 MB against the 2.08 MB this model's experts and weights take
    peak = res.stats["peak_memory_bytes"] - base
    assert peak <= e.resident_bytes + 3 * per_layer + slack
    assert peak < e.resident_bytes + e.streaming.total_expert_bytes
    assert mx.get_active_memory() - base <= e.resident_bytes + per_layer + slack


def test_writable_view_writes_through_to_the_array():
    from edge0.backend.core import writable_view

    a = mx.zeros((3, 4), dtype=mx.float32)
    view = writable_view(a)
    view[1] = 7.0
    assert np.array(a).tolist() == [[0.0] * 4, [7.0] * 4, [0.0] * 4]
    assert writable_view(mx.zeros((3, 4), dtype=mx.bfloat16)) is None  # numpy has no bfloat16: scatter instead


def test_host_rows_widen_exactly_as_the_device_does():
    from edge0.backend.core import from_raw
    from edge0.streaming.pool import host_rows

    vals = np.array([[1.0, -2.5, 3.140625, 1e-3], [65504.0, -0.0, 7.0, 0.1]], dtype=np.float32)
    for st, dt in (("F16", mx.float16), ("BF16", mx.bfloat16)):
        raw = np.array(mx.array(vals).astype(dt).view(mx.uint16)).view(np.uint8).reshape(2, -1)
        want = np.array(from_raw(raw, st, (2, 4)).astype(mx.float32))
        assert np.array_equal(host_rows(raw, st, np.dtype(np.float32)).reshape(2, 4), want)
    assert host_rows(np.zeros((1, 8), np.uint8), "F32", np.dtype(np.float16)) is None  # narrowing: the device does it


@pytest.mark.parametrize("family,executor", [("qwen3_moe", "staged"), ("qwen3_moe", "hot"), ("deepseek_v3", "staged")])
def test_an_engine_decodes_on_another_thread_than_the_one_that_loaded_it(family, executor, store_for):
    """The server loads on the main thread and generates on its engine thread; MLX evaluates a
    lazy array only on the thread that built it, so nothing built at load may stay lazy (a
    bfloat16 store's scales cast to float32 did, and deepseek_v3's YaRN RoPE frequencies: the
    server's first request was a 500)."""
    store = store_for(family, dtype="bfloat16")
    want = (
        edge0.load(store, decode_executor=executor)
        .generate("hello world once upon a time", max_tokens=6, ignore_eos=True)
        .tokens
    )
    engine = edge0.load(store, decode_executor=executor)
    out = {}

    def run():
        try:
            out["tokens"] = engine.generate("hello world once upon a time", max_tokens=6, ignore_eos=True).tokens
        except Exception as e:  # noqa: BLE001 - reported below with its message
            out["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert out.get("tokens") == want, out.get("error")
