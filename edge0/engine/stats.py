"""Engine statistics: per generation call, and cumulative with a per-layer breakdown."""

from __future__ import annotations

import time

from edge0.backend import core as B


def sequence_stats(streaming, store, speculation, seq) -> dict:
    """A finished sequence's stats (a batch's, batch.py): the executors' and the store's counts
    from its joining to its end (while it shared steps, the batch's), and its own timings."""
    totals, io = streaming.stats.totals(), store.io_stats()
    before, io_before, spec_before = seq.before
    first = seq.first_token_s or 0.0
    stats = call_stats(
        before,
        seq.prefilled or before,
        totals,
        io_before,
        io,
        len(seq.prompt),
        len(seq.prompt) - seq.held,
        len(seq.tokens),
        first,
        time.perf_counter() - seq.joined - first,
    )
    stats["first_token_s"] = seq.first_token_s
    spec = speculation
    if spec is not None and spec_before is not None:
        decode_bytes = stats["expert_bytes_read"] - stats["prefill_expert_bytes_read"]
        stats["speculation"] = spec.call_stats(spec_before, before, totals, len(seq.tokens), decode_bytes)
    return stats


def call_stats(
    totals_before: dict,
    totals_prefilled: dict,
    totals_after: dict,
    io_before: dict,
    io_after: dict,
    n_prompt: int,
    n_prefill: int,
    n_gen: int,
    t_prefill: float,
    t_decode: float,
) -> dict:
    """The stats of one generate call (docs/engine-api.md, "Stats keys"), from executor totals
    before it, after its prefill (the prompt but its last token) and after it, and the store's
    read counters before and after it."""
    a, b, p = totals_after, totals_before, totals_prefilled
    return {
        "prompt_tokens": n_prompt,
        "prefill_tokens": n_prefill,
        "generation_tokens": n_gen,
        "prefill_tps": n_prefill / t_prefill if t_prefill > 0 else 0.0,
        "decode_tps": (n_gen - 1) / t_decode if n_gen > 1 and t_decode > 0 else 0.0,
        "peak_memory_bytes": B.peak_memory(),
        "peak_rss_bytes": B.peak_rss(),
        "expert_bytes_read": a["bytes_read"] - b["bytes_read"],
        "prefill_expert_bytes_read": p["bytes_read"] - b["bytes_read"],
        "prefill_stall_ms": p["stall_ms"] - b["stall_ms"],
        "prefill_layers_whole": p["span_whole"] - b["span_whole"],
        "prefill_layers_union": p["span_union"] - b["span_union"],
        "expert_hit_rate": _rate(a["hits"] - b["hits"], a["misses"] - b["misses"]),
        "host_syncs": a["host_syncs"] - b["host_syncs"],
        "stall_ms_per_step": (a["stall_ms"] - b["stall_ms"]) / max(1, n_gen),
        "fallbacks": a["fallbacks"] - b["fallbacks"],
        "overlapped": a["overlapped"] - b["overlapped"],
        "dropped_experts": a["dropped"] - b["dropped"],
        "substitutions": a["substitutions"] - b["substitutions"],
        # reads one layer ahead (streaming/lookahead.py): how often the predicted experts were routed,
        # and the bytes read on a prediction that the route did not take
        "lookahead_recall": _ratio(
            a["lookahead_agreed"] - b["lookahead_agreed"], a["lookahead_predicted"] - b["lookahead_predicted"]
        ),
        "lookahead_wasted_bytes": a["lookahead_wasted_bytes"] - b["lookahead_wasted_bytes"],
        "expert_reads": io_after["reads"] - io_before["reads"],
        "io_reader": io_after["reader"],
        "io_max_queue_depth": io_after["max_queue_depth"],
    }


def engine_stats(engine) -> dict:
    """Cumulative statistics of `engine`, with a per-layer breakdown."""
    st = engine.streaming
    totals = st.stats.totals()
    out = {
        "model": engine.model_id,
        "compute_dtype": engine.compute_dtype,
        "serving_top_k": engine.k,
        "resident_bytes": engine.resident_bytes,
        "expert_cache_bytes": st.budget,
        "slots_per_layer": st.n_slots,
        "cache_policy": st.options.cache_policy,
        "substitute_alpha": st.options.substitute_alpha,
        "prefill_executor": st.options.prefill_executor,
        "decode_executor": st.options.decode_executor,
        "decode_steps": st.stats.decode_steps,
        "stall_ms_per_step": totals["stall_ms"] / max(1, st.stats.decode_steps),
        "totals": totals,
        "layers": {n: s.as_dict() for n, s in sorted(st.stats.layers.items())},
        "peak_rss_bytes": B.peak_rss(),
        "io": engine.store.io_stats(),
        "prerouter": None,
        "speculation": None,
        "batch_speculation": None,
        "prompt_cache": engine.kv.stats(),
        **engine.prefiller.stats(),
    }
    out.update(engine.hooks.stats())
    if engine.speculation is not None:
        out.update(engine.speculation.stats())
        out["batch_speculation"] = engine.batch_speculation.stats()["speculation"]
    if engine.pipeline is not None and engine.pipeline.leads:
        out = engine.pipeline.merge_stats(out)
    return out


def _ratio(part: int, whole: int):
    return part / whole if whole else None


def _rate(hits: int, misses: int):
    return hits / (hits + misses) if hits + misses else None
