"""Cache policies against their definitions: hand-written sequences, Belady against an exhaustive
search, ARC against a transcription of the paper's pseudocode, SMoE windows, substitution."""

import functools
import itertools
from collections import OrderedDict

import numpy as np
import pytest

from edge0.cache import POLICIES, ExpertCache, make_policy, substitute
from edge0.cache.flashmoe import PARAMS, FlashMoEModel, load_model
from edge0.errors import Edge0Error


def run(name, capacity, seq, num_experts=8, scores=None, **kw):
    """Replay `seq` (one route per step); returns (cache, per-step hit lists, per-step evictions)."""
    if name == "belady":
        kw["future"] = seq
    cache = ExpertCache(make_policy(name, capacity, num_experts, **kw))
    hits, evicted = [], []
    for t, r in enumerate(seq):
        h, _, ev = cache.access(t, r, None if scores is None else scores[t])
        hits.append(h)
        evicted.append(ev)
    return cache, hits, evicted


def random_seq(rng, steps, num_experts, k):
    return [list(rng.choice(num_experts, size=k, replace=False)) for _ in range(steps)]


def test_registry():
    assert set(POLICIES) == {"lru", "lfu", "arc", "smoe", "flashmoe", "belady"}
    with pytest.raises(ValueError, match="unknown cache policy"):
        make_policy("mru", 2, 8)


def test_lru_hand_sequence():
    cache, hits, ev = run("lru", 2, [[0], [1], [0], [2], [1], [0]])
    assert hits == [[], [], [0], [], [], []]
    assert ev == [[], [], [], [1], [0], [2]]
    assert (cache.hits, cache.misses) == (1, 5)


def test_route_wider_than_cache_is_held_then_trimmed():
    cache, hits, ev = run("lru", 1, [[0, 1], [1, 2]])
    assert ev[0] == [0] and cache.cached == {2}  # nothing protected after the step
    assert hits == [[], [1]]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_experts_admitted_ahead_of_their_route_are_its_hits_and_evict_no_one_of_them(name):
    """A prediction admitted before its step (ExpertCache.admit): inserted as misses would be,
    never evicting one another, uncounted; the route that follows finds them as hits."""
    rng = np.random.default_rng(0)
    seq = random_seq(rng, 40, 8, 2)
    kw = {"belady": {"future": seq}, "flashmoe": {"weights": lru_like_model(), "layer": 3}}.get(name, {})
    cache = ExpertCache(make_policy(name, 3, 8, **kw))
    for t, route in enumerate(seq):
        predicted = [int(e) for e in rng.choice(8, size=2, replace=False)]
        before, counted = set(cache.cached), (cache.hits, cache.misses)
        loaded, evicted = cache.admit(predicted)
        assert loaded == [e for e in predicted if e not in before] and set(predicted) <= cache.cached
        assert not set(evicted) & set(predicted) and set(evicted) <= before and len(cache.cached) <= 3
        assert (cache.hits, cache.misses) == counted
        hits, _, _ = cache.access(t, route, rng.random(8))
        assert set(hits) >= set(route) & set(predicted)
    full = ExpertCache(make_policy("lru", 2, 8))
    assert full.admit([4, 5, 6]) == ([4, 5], [])  # no room beyond the prediction itself: 6 waits for its call


def test_lfu_frequency_then_recency():
    # 0 is used twice; at step 3 the once-used 1 goes. Counts survive eviction: when 1 returns
    # at step 4 it has 2 uses, ties with 0, and the tie goes to the least recently used (0).
    _, _, ev = run("lfu", 2, [[0], [0], [1], [2], [1], [3]])
    assert ev == [[], [], [], [1], [2], [0]]


def test_lfu_tie_is_lru():
    _, _, ev = run("lfu", 2, [[0], [1], [2]])
    assert ev[2] == [0]


def test_belady_hand_sequence():
    cache, hits, ev = run("belady", 2, [[0], [1], [2], [0], [1]])
    assert ev[2] == [1]  # 0 is needed at step 3, 1 only at step 4
    assert cache.hits == 1


def optimum(seq, capacity):
    """Most hits any eviction choice can get under ExpertCache's rules (exhaustive, memoized)."""

    @functools.lru_cache(maxsize=None)
    def best(t, cached):
        if t == len(seq):
            return 0
        route = frozenset(seq[t])
        hits = len(route & cached)
        union = cached | route
        if len(route) > capacity:  # held for the step, then any `capacity` of them are kept
            keep = [frozenset(c) for c in itertools.combinations(sorted(union), capacity)]
        else:  # victims come from the unrouted cached experts
            n = max(0, len(union) - capacity)
            keep = [union - frozenset(v) for v in itertools.combinations(sorted(cached - route), n)]
        return hits + max(best(t + 1, s) for s in keep)

    return best(0, frozenset())


@pytest.mark.parametrize("k,capacity", [(1, 2), (1, 3), (2, 2), (2, 3), (3, 2)])
def test_belady_matches_exhaustive_search(k, capacity):
    rng = np.random.default_rng(k * 10 + capacity)
    for _ in range(15):
        seq = random_seq(rng, 12, 6, k)
        cache, _, _ = run("belady", capacity, seq, num_experts=6)
        assert cache.hits == optimum(seq, capacity)


class PaperARC:
    """ARC(c) for one page per request, transcribed from Megiddo & Modha 2003, Figure 4."""

    def __init__(self, c):
        self.c, self.p = c, 0.0
        self.t1, self.t2, self.b1, self.b2 = (OrderedDict() for _ in range(4))

    def replace(self, x):
        if self.t1 and ((x in self.b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            y, _ = self.t1.popitem(last=False)
            self.b1[y] = None
        else:
            y, _ = self.t2.popitem(last=False)
            self.b2[y] = None

    def request(self, x) -> bool:
        c, t1, t2, b1, b2 = self.c, self.t1, self.t2, self.b1, self.b2
        if x in t1 or x in t2:  # case I
            (t1 if x in t1 else t2).pop(x)
            t2[x] = None
            return True
        if x in b1:  # case II
            self.p = min(self.p + (1 if len(b1) >= len(b2) else len(b2) / len(b1)), c)
            self.replace(x)
            b1.pop(x)
            t2[x] = None
        elif x in b2:  # case III
            self.p = max(self.p - (1 if len(b2) >= len(b1) else len(b1) / len(b2)), 0)
            self.replace(x)
            b2.pop(x)
            t2[x] = None
        else:  # case IV
            if len(t1) + len(b1) == c:
                if len(t1) < c:
                    b1.popitem(last=False)
                    self.replace(x)
                else:
                    t1.popitem(last=False)
            elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
                if len(t1) + len(t2) + len(b1) + len(b2) == 2 * c:
                    b2.popitem(last=False)
                self.replace(x)
            t1[x] = None
        return False


@pytest.mark.parametrize("capacity", [1, 2, 3, 5])
def test_arc_follows_the_paper(capacity):
    rng = np.random.default_rng(capacity)
    # A skewed distribution, so that both recency and frequency matter and p moves both ways.
    probs = np.array([0.3, 0.2, 0.1, 0.1, 0.08, 0.07, 0.05, 0.04, 0.03, 0.03])
    seq = [[int(x)] for x in rng.choice(10, size=400, p=probs)]
    ref = PaperARC(capacity)
    cache = ExpertCache(make_policy("arc", capacity, 10))
    arc, moved_p = cache.policy, set()
    for t, r in enumerate(seq):
        hit, _, _ = cache.access(t, r)
        assert bool(hit) == ref.request(r[0])
        for mine, theirs in ((arc.t1, ref.t1), (arc.t2, ref.t2), (arc.b1, ref.b1), (arc.b2, ref.b2)):
            assert list(mine) == list(theirs)
        assert arc.p == ref.p
        moved_p.add(arc.p)
    assert cache.cached == set(arc.t1) | set(arc.t2)
    if capacity > 1:
        assert len(moved_p) > 2  # the adaptation was exercised


def test_arc_ghost_hits_move_p_and_promote():
    seq = [[0], [0], [1], [2], [1], [0]]
    cache = ExpertCache(make_policy("arc", 2, 8))
    arc = cache.policy
    for t, r in enumerate(seq[:4]):
        cache.access(t, r)
    # 0 is in T2 (seen twice); 2 arrived with T1 above its target p = 0, so T1's 1 became a ghost
    assert list(arc.t1) == [2] and list(arc.t2) == [0] and list(arc.b1) == [1] and arc.p == 0
    cache.access(4, [1])  # B1 ghost hit: p + 1, 1 goes to T2, T2's LRU (0) becomes a B2 ghost
    assert arc.p == 1 and list(arc.t2) == [1] and list(arc.b2) == [0] and not arc.b1
    cache.access(5, [0])  # B2 ghost hit: p - 1, T1 (above p) gives up 2
    assert arc.p == 0 and list(arc.t2) == [1, 0] and list(arc.b1) == [2] and not arc.t1


def test_arc_full_t1_drops_without_ghost():
    cache, _, ev = run("arc", 2, [[0], [1], [2]])
    assert ev[2] == [0] and not cache.policy.b1  # case IV.A with |T1| = c: no ghost


def test_arc_multi_expert_routes_never_evict_the_route():
    rng = np.random.default_rng(0)
    seq = random_seq(rng, 300, 8, 3)
    cache = ExpertCache(make_policy("arc", 4, 8))
    for t, r in enumerate(seq):
        cache.access(t, r)
        assert set(r) <= cache.cached and len(cache.cached) <= 4


def smoe_scores():
    # dyadic values, so window sums are exact
    return np.array([[0.75, 0.125, 0.125], [0.125, 0.5, 0.375], [0.125, 0.25, 0.625]])


@pytest.mark.parametrize("window,victim", [(2, 0), (3, 1), (100, 1)])
def test_smoe_window(window, victim):
    # Steps 1-2 hold the mean of 0 at 0.125 while 1 scores 0.5, 0.25: with 2 steps 0 is the
    # weakest; counting step 0 too (0 scored 0.75 there) 1 is.
    _, _, ev = run("smoe", 2, [[0], [1], [2]], num_experts=3, scores=smoe_scores(), window=window)
    assert ev[2] == [victim]


def test_smoe_counts_inactive_steps():
    # 1 was routed once with a high score; 0 was never routed after step 0 but the router kept
    # scoring it above 1, so 1 is evicted.
    scores = np.array([[0.5, 0.25, 0.25], [0.375, 0.5, 0.125], [0.375, 0.0, 0.625], [0.375, 0.0, 0.625]])
    _, _, ev = run("smoe", 2, [[0], [1], [2], [2]], num_experts=3, scores=scores, window=4)
    assert ev[2] == [1]


def test_smoe_needs_scores():
    with pytest.raises(ValueError, match="router scores"):
        run("smoe", 2, [[0]])


def lru_like_model(num_experts=8, layers=(3,)):
    """Weights whose score is -1/r: the policy evicts the least recently used expert."""
    d, h = 2, 4
    p = {
        k: np.zeros(s, np.float32)
        for k, s in {
            "emb": (len(layers) * num_experts, d),
            "w1": (2 + d, h),
            "b1": (h,),
            "w2": (h, h),
            "b2": (h,),
            "w3": (h, 1),
            "b3": (1,),
        }.items()
    }
    p["w1"][0, 0] = 1.0
    p["w2"][0, 0] = 1.0
    p["w3"][0, 0] = -1.0
    return FlashMoEModel(p, list(layers), num_experts)


def test_flashmoe_scores_drive_eviction(tmp_path):
    rng = np.random.default_rng(1)
    seq = random_seq(rng, 200, 8, 1)  # one expert per step: no recency ties
    model = lru_like_model()
    path = tmp_path / "w.safetensors"
    model.save(path, {"note": "hand-made"})
    loaded = load_model(str(path))
    assert sorted(loaded.p) == sorted(PARAMS) and loaded.metadata["note"] == '"hand-made"'
    for weights in (model, path):
        _, _, ev_f = run("flashmoe", 4, seq, weights=weights, layer=3)
        _, _, ev_l = run("lru", 4, seq)
        assert ev_f == ev_l
    with pytest.raises(Edge0Error, match="no layer 5"):
        run("flashmoe", 2, seq, weights=model, layer=5)


def test_flashmoe_weights_errors(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors")
    with pytest.raises(Edge0Error, match="train-cache-policy"):
        load_model(str(bad))
    with pytest.raises(Edge0Error, match="no such"):
        load_model(str(tmp_path / "missing.safetensors"))


def test_substitute_alpha_zero_is_identity():
    scores = np.array([0.3, 0.2, 0.2, 0.2, 0.1])  # ties at S_{k+1}
    sel = np.array([0, 1])
    out, n = substitute(scores, sel, cached={2, 3, 4}, alpha=0.0)
    assert n == 0 and out.tolist() == [0, 1] and out is not sel


def test_substitute_bands():
    # top-2 = [0, 1], S_{k+1} = 0.20 (expert 2). alpha = 0.1: routed band [0.20, 0.22],
    # substitute band [0.18, 0.20].
    scores = np.array([0.30, 0.21, 0.20, 0.19, 0.10])
    out, n = substitute(scores, [0, 1], cached={3}, alpha=0.1)
    assert out.tolist() == [0, 3] and n == 1
    out, n = substitute(scores, [0, 1], cached={4}, alpha=0.1)  # 0.10 is below the band
    assert out.tolist() == [0, 1] and n == 0
    out, n = substitute(scores, [0, 1], cached={1, 3}, alpha=0.1)  # 1 is cached: nothing to save
    assert out.tolist() == [0, 1] and n == 0
    scores2 = np.array([0.30, 0.25, 0.20, 0.19, 0.10])  # 0.25 is above (1 + alpha) * S
    out, n = substitute(scores2, [0, 1], cached={3}, alpha=0.1)
    assert n == 0
    out, n = substitute(scores, [0, 1], cached={2, 3}, alpha=0.1)  # strongest substitute first
    assert out.tolist() == [0, 2] and n == 1


def test_substitute_batched_counts_all_tokens():
    scores = np.array([[0.30, 0.21, 0.20, 0.19, 0.10], [0.21, 0.30, 0.20, 0.19, 0.10]])
    out, n = substitute(scores, np.array([[0, 1], [1, 0]]), cached={3}, alpha=0.1)
    assert out.tolist() == [[0, 3], [1, 3]] and n == 2
    with pytest.raises(ValueError):
        substitute(scores, [[0, 1], [1, 0]], cached=set(), alpha=-1)


def slot_bytes(engine, n):
    """An --expert-cache budget of `n` slots per layer."""
    return n * sum(engine.store.expert_nbytes(l) for l in engine.store.layers)


def weights_for(root, path, layers, num_experts=8):
    """LRU-like flashmoe weights recorded as trained on a trace of the store at `root`."""
    from edge0.store.format import manifest_hash

    lru_like_model(num_experts, layers).save(path, {"manifest_hash": manifest_hash(root), "model": "fixture"})
    return path


def test_live_policies_change_reads_only(store_for, tmp_path):
    """With the live pool, the policy changes which experts are read, never the tokens."""
    import edge0

    root = store_for("qwen3_moe")
    ref = edge0.load(root, decode_executor="exact")
    exact = ref.generate("hello world this is", max_tokens=24, ignore_eos=True)
    weights = weights_for(root, tmp_path / "policy.safetensors", sorted(ref.store.layers))
    reads, hits = {}, {}
    for name in ("lru", "lfu", "arc", "smoe", "flashmoe"):
        engine = edge0.load(
            root,
            expert_cache=slot_bytes(ref, 3),
            cache_policy=name,  # top-k is 2
            cache_weights=weights if name == "flashmoe" else None,
            smoe_window=8 if name == "smoe" else None,
        )
        policies = [d.decode.slots.cache.policy for d in engine.streaming.layers.values()]
        assert {p.name for p in policies} == {name}
        assert name != "smoe" or all(p.window == 8 for p in policies)
        res = engine.generate("hello world this is", max_tokens=24, ignore_eos=True)
        assert res.tokens == exact.tokens, name
        reads[name], hits[name] = res.stats["expert_bytes_read"], res.stats["expert_hit_rate"]
        assert res.stats["substitutions"] == 0 and res.stats["expert_bytes_read"] > 0
    assert len(set(reads.values())) > 1 and len(set(hits.values())) > 1


def test_live_substitution(store_for):
    """alpha 0 is the exact model; alpha > 0 on a budget with misses substitutes and reads less."""
    import edge0

    root = store_for("qwen3_moe")
    ref = edge0.load(root, decode_executor="exact")
    exact = ref.generate("hello world this is", max_tokens=24, ignore_eos=True)
    runs = {}
    for alpha in (0.0, 1.0):
        engine = edge0.load(root, expert_cache=slot_bytes(ref, 2), cache_policy="smoe", substitute_alpha=alpha)
        runs[alpha] = engine.generate("hello world this is", max_tokens=24, ignore_eos=True).stats
        st = engine.stats()
        assert st["totals"]["substitutions"] == sum(s["substitutions"] for s in st["layers"].values())
        assert st["totals"]["substitutions"] == runs[alpha]["substitutions"]
        if alpha == 0:
            assert engine.generate("hello world this is", max_tokens=24, ignore_eos=True).tokens == exact.tokens
    assert runs[0.0]["substitutions"] == 0 and runs[0.0]["expert_bytes_read"] > 0
    assert runs[1.0]["substitutions"] > 0
    assert runs[1.0]["expert_bytes_read"] < runs[0.0]["expert_bytes_read"]


def test_a_substituted_expert_computes_with_its_substitute(store_for):
    """The alias in the slot table sends the replaced expert to its substitute's weights, never to
    the zero row (which on the gate path would go uncounted)."""
    import edge0
    from edge0.backend import core as B

    root = store_for("qwen3_moe")  # 8 experts, top-2
    ref = edge0.load(root, decode_executor="exact")
    engine = edge0.load(root, expert_cache=slot_bytes(ref, 3), substitute_alpha=1.0)
    ex = next(iter(engine.streaming.layers.values())).decode

    def scores(pairs):
        s = np.zeros(8, dtype=np.float32)
        for e, v in pairs:
            s[e] = v
        return B.array(s)

    ex(B.array(np.array([[0, 1]], dtype=np.uint32)), scores([(0, 0.5), (1, 0.3)]))  # caches 0 and 1
    # route [2, 3]: S_{k+1} = 0.2 (expert 1, cached); 3 scores 0.3, inside [S, 2S], so 1 replaces it
    [(params, local)] = ex(B.array(np.array([[2, 3]], dtype=np.uint32)), scores([(2, 0.5), (3, 0.3), (1, 0.2)]))
    local = B.to_numpy(local)[0]
    assert ex.stats.substitutions == 1 and (local != ex.slots.zero).all()
    for slot, expert in zip(local, (2, 1)):
        want = ex.load([expert])[0]
        for proj, parts in params.items():
            for part, rows in parts.items():
                assert np.array_equal(B.to_numpy(rows[int(slot)]), B.to_numpy(want[proj][part][0])), (
                    expert,
                    proj,
                    part,
                )


def test_live_policy_errors(store_for, tmp_path):
    import edge0

    root = store_for("qwen3_moe")
    with pytest.raises(Edge0Error, match="--cache-policy flashmoe needs --cache-weights"):
        edge0.load(root, cache_policy="flashmoe")
    with pytest.raises(Edge0Error, match="--cache-weights .*no such"):
        edge0.load(root, cache_policy="flashmoe", cache_weights=tmp_path / "missing.safetensors")
    other = weights_for(store_for("mixtral"), tmp_path / "other.safetensors", [0, 1])
    with pytest.raises(Edge0Error, match="--cache-weights .*another model.*train-cache-policy"):
        edge0.load(root, cache_policy="flashmoe", cache_weights=other)
    with pytest.raises(Edge0Error, match="--cache-weights is read only by the flashmoe policy"):
        edge0.load(root, cache_weights=other)
    with pytest.raises(Edge0Error, match="belady"):
        edge0.load(root, cache_policy="belady")
    with pytest.raises(Edge0Error, match="--substitute-alpha needs the staged decode executor"):
        edge0.load(root, substitute_alpha=0.1, decode_executor="exact")
    with pytest.raises(Edge0Error, match="--substitute-alpha -1"):
        edge0.load(root, substitute_alpha=-1)
    with pytest.raises(Edge0Error, match="--smoe-window 0"):
        edge0.load(root, cache_policy="smoe", smoe_window=0)
    with pytest.raises(Edge0Error, match="--smoe-window is read only by the smoe policy"):
        edge0.load(root, smoe_window=8)
    with pytest.raises(Edge0Error, match="--cache-policy smoe needs router scores"):
        edge0.load(store_for("olmoe"), cache_policy="smoe")
