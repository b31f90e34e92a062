"""`Engine.generate_batch`: several prompts through one Batch (batch.py), prefilled first, and
the run's statistics (docs/engine-api.md)."""

from __future__ import annotations

import time

from edge0.engine.batch import batch_problem
from edge0.engine.request import Request
from edge0.errors import Edge0Error


def generate_batch(engine, requests: list[Request]):
    """Every request in one batch, prefilled first; returns (sequences, stats of the run)."""
    totals0, io0 = engine.streaming.stats.totals(), engine.store.io_stats()
    t0 = time.perf_counter()
    with engine.batching() as batch:
        seqs = [batch.join(r) for r in requests]
        batch.prefill_all()
        t_prefill = time.perf_counter() - t0
        t_first = None
        while batch.busy:
            for _, step in batch.advance():
                if isinstance(step, Exception):
                    raise step
            if t_first is None:
                t_first = time.perf_counter() - t0 - t_prefill
        steps = batch.steps
    totals, io = engine.streaming.stats.totals(), engine.store.io_stats()
    prefilled = [s.prefilled for s in seqs if s.prefilled is not None]
    routes = totals["multi_routes"] - totals0["multi_routes"]
    stats = {
        "batch_size": len(seqs),
        "batch_steps": steps,
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "generated_tokens": sum(len(s.tokens) for s in seqs),
        "prefill_s": t_prefill,
        "decode_s": time.perf_counter() - t0 - t_prefill,
        "first_step_s": t_first,  # feeds every prompt's last token: alone, the prefill's last step
        "expert_bytes_read": totals["bytes_read"] - totals0["bytes_read"],
        "prefill_expert_bytes_read": max(p["bytes_read"] for p in prefilled) - totals0["bytes_read"],
        "store_bytes_read": io["bytes_read"] - io0["bytes_read"],
        "multi_union": totals["multi_union"] - totals0["multi_union"],
        "multi_routes": routes,
        "union_per_routed": (totals["multi_union"] - totals0["multi_union"]) / routes if routes else None,
    }
    return seqs, stats


def check_batch(engine, prompts, max_tokens) -> tuple[list[list[int]], list[int]]:
    """The prompts encoded and each one's max_tokens (one int for all, or one per prompt), after
    the checks a batch needs (Edge0Error naming the problem); each request's own fields are
    checked as it joins (Request.check)."""
    if problem := batch_problem(engine):
        raise Edge0Error(f"generate_batch: {problem}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise Edge0Error("generate_batch: no prompts (pass a list of strings or token-id lists)")
    limits = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    if len(limits) != len(prompts):
        raise Edge0Error(f"generate_batch: {len(limits)} max_tokens for {len(prompts)} prompts; give one per prompt")
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in limits):
        raise Edge0Error(f"max_tokens must be integers >= 1 (got {max_tokens!r})")
    return [engine.encode(p) for p in prompts], limits
