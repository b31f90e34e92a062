"""The budget planner behind `edge0 plan`: for several expert-cache budgets, the hit rate
(simulated on a routing trace), the expert bytes read per token and the decode speed (from read
and compute costs measured on this machine), and a recommended budget."""

from __future__ import annotations

import time

import numpy as np

from edge0.store.pagecache import evict

PROMPTS = ["The", "In this chapter we describe", "def main():", "Once upon a time"]


def measure_reads(store, layers: list[int], num_experts: int, per_layer: int = 8, seed: int = 0) -> dict:
    """Seconds to read one expert, cold (page cache dropped before each read) and warm, per
    measured layer (up to 8, evenly spread)."""
    rng = np.random.default_rng(seed)
    sample = sorted(set(layers[int(i)] for i in np.linspace(0, len(layers) - 1, min(8, len(layers)))))
    cold, warm, forced = {}, {}, True
    for l in sample:
        ids = rng.choice(num_experts, size=min(per_layer, num_experts), replace=False)
        paths = store.layer_paths(l)
        store.read(l, [int(ids[0])])  # first-use costs (mmap, page tables) are not read costs
        tc, tw = [], []
        for e in ids:
            forced &= evict(paths) is not None
            tc.append(_timed_read(store, l, int(e)))
            tw.append(_timed_read(store, l, int(e)))
        cold[l], warm[l] = float(np.median(tc)), float(np.median(tw))
    return {"cold_s": cold, "warm_s": warm, "cold_forced": forced}


def _timed_read(store, layer: int, expert: int) -> float:
    t = time.perf_counter()
    store.read(layer, [expert])
    return time.perf_counter() - t


def per_layer(values: dict, layers: list[int]) -> list[float]:
    """Measured per-layer values spread to every layer (nearest measured layer)."""
    keys = sorted(values)
    return [values[min(keys, key=lambda k: abs(k - l))] for l in layers]


def measure_decode(path, options: dict, expert_cache, tokens: int = 32) -> dict:
    """Seconds per decode step and expert bytes read per token of a live engine with `options`
    (edge0.load keywords) and `expert_cache` (None: the engine's default), in steady state: the
    second of two identical greedy runs, so the slots are warm and every read comes from the page
    cache."""
    import edge0

    engine = edge0.load(path, **{**options, "expert_cache": expert_cache})
    for _ in range(2):
        s = engine.generate(PROMPTS[0], max_tokens=tokens, ignore_eos=True).stats
    return {
        "expert_cache": expert_cache,
        "step_s": 1.0 / s["decode_tps"],
        "bytes_per_token": s["expert_bytes_read"] / s["generation_tokens"],
    }


def predict(trace, results, hi: dict, lo: dict, cold_extra_per_byte: float) -> list[dict]:
    """Per budget: hit rate, bytes read per token and predicted tok/s. Step time is taken as
    linear in the bytes read per token, through the two measured points (hi: large cache, lo:
    top-k slots; reads warm), plus the extra cost of reading those bytes cold."""
    T = trace.num_steps
    span = lo["bytes_per_token"] - hi["bytes_per_token"]
    per_byte = max(0.0, (lo["step_s"] - hi["step_s"]) / span) if span > 0 else 0.0
    rows = []
    for r in results:
        b = r.bytes_read / T
        t = hi["step_s"] + (b - hi["bytes_per_token"]) * per_byte + b * cold_extra_per_byte
        rows.append(
            {
                "budget": r.budget.label,
                "experts_per_layer": r.budget.capacity,
                "hit_rate": r.hit_rate,
                "cache_bytes": r.budget.capacity * sum(trace.expert_bytes),
                "bytes_per_token": b,
                "tok_s": 1.0 / t if t > 0 else float("inf"),
            }
        )
    return rows


def recommend(rows: list[dict], within: float = 0.10) -> dict:
    """The smallest budget whose predicted tok/s is within `within` of the best."""
    best = max(r["tok_s"] for r in rows)
    return min((r for r in rows if r["tok_s"] >= (1 - within) * best), key=lambda r: r["experts_per_layer"])
