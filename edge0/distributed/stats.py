"""What the ranks report: each rank's summary (its stage, memory, reads, waits, the health of its
connections, its share of rank 0's prompt caches), and rank 0's statistics merged with everyone's."""

from __future__ import annotations

import os

from edge0.backend import core as B
from edge0.streaming.stats import COUNTERS


def rank_stats(pipe) -> dict:
    """A rank's summary, from its end of the stage exchange `pipe` (rank 0's FINISH gathers
    everyone's)."""
    p, st = pipe.parts, pipe.parts.streaming
    totals = st.stats.totals()
    steps = max(1, st.stats.decode_steps)
    full = pipe.layer_stats() if not pipe.leads else None
    return {
        "rank": pipe.stage.rank,
        "stage": pipe.stage.describe(),
        "layers": [pipe.stage.start, pipe.stage.end - 1],
        "moe_layers": sorted(p.store.layers),
        "resident_bytes": p.resident_bytes,
        "expert_bytes": st.total_expert_bytes,
        "expert_cache_bytes": st.budget,
        "peak_memory_bytes": B.peak_memory(),
        "peak_rss_bytes": B.peak_rss(),
        "hit_rate": totals["hit_rate"],
        "hits": totals["hits"],
        "misses": totals["misses"],
        "expert_bytes_read": totals["bytes_read"],
        "stall_ms": totals["stall_ms"],
        "stall_ms_per_step": totals["stall_ms"] / steps,
        "decode_steps": st.stats.decode_steps,
        "forwards": pipe.forwards,
        "send_ms": 1000 * pipe.send_s,
        "wait_ms": 1000 * pipe.wait_s,
        "step_compute_ms": 1000 * pipe.compute_s,
        "bytes_sent": pipe.bytes_sent,
        "cpu_s": sum(os.times()[:2]),  # user + system
        "waits": "blocking" if pipe.sockets else "spinning (ring sockets not found)",
        "keepalive": pipe.keepalive or "on",  # else why not: a silent peer machine is then not found
        "heartbeat": _heartbeat_state(pipe),
        # the others: their share of rank 0's prompt caches, and how much of it they asked to free
        "kv_share_bytes": pipe.replica.nbytes() if pipe.replica is not None else None,
        "kv_free_wanted": pipe.free_wanted if pipe.replica is not None else None,
        "kv_freed_for_others": pipe.freed_for_others if pipe.replica is None else None,
        "layer_stats": None if full is None else full["layers"],
        "prerouter": None if full is None else full["prerouter"],
    }


def _heartbeat_state(pipe) -> str:
    """Whether a stopped or stuck peer is found (its heartbeat), for the stats."""
    unheard = pipe.heartbeat.unheard() if pipe.heartbeat is not None else []
    if unheard:
        return f"no heartbeat heard from rank {unheard[0]} (UDP blocked?): a stopped or stuck peer is not detected"
    return pipe.heartbeat_note


def merged_stats(pipe, out: dict) -> dict:
    """Rank 0's Engine.stats() `out` with every rank: per-layer rows of all ranks, totals summed,
    and a per-rank summary under "ranks"."""
    mine = rank_stats(pipe)
    layers = dict(out["layers"])
    for r in pipe.ranks:
        layers.update({int(k): v for k, v in (r["layer_stats"] or {}).items()})
    totals = {k: sum(s[k] for s in layers.values()) for k in COUNTERS}
    totals["stall_ms"] = sum(s["stall_ms"] for s in layers.values())
    totals["distinct_experts"] = sum(s["distinct_experts"] for s in layers.values())
    lookups = totals["hits"] + totals["misses"]
    totals["hit_rate"] = totals["hits"] / lookups if lookups else None
    totals["read_amplification"] = totals["bytes_read"] / totals["bytes_used"] if totals["bytes_used"] else None
    out = dict(
        out,
        layers=dict(sorted(layers.items())),
        totals=totals,
        stall_ms_per_step=totals["stall_ms"] / max(1, out["decode_steps"]),
    )
    pr = out["prerouter"]
    if pr is not None:  # per-layer counts of the pre-routed layers on every rank
        pr = dict(pr)
        for key in ("routed_by_head", "routed_by_gate", "recall"):
            parts = [pr[key]] + [r["prerouter"][key] for r in pipe.ranks if r["prerouter"]]
            pr[key] = (
                None if pr[key] is None else dict(sorted({int(l): v for p in parts for l, v in p.items()}.items()))
            )
        out["prerouter"] = pr
    out["ranks"] = [{k: v for k, v in r.items() if k not in ("layer_stats", "prerouter")} for r in [mine, *pipe.ranks]]
    return out
