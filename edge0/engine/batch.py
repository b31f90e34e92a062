"""Several sequences decoded together. Each prompt is prefilled alone (span by span, as a single
generation's is); their KV caches are then merged into mlx-lm's batched caches (left padding,
masked, each row at its own positions), and every step feeds one token of each running sequence
through one forward, so each MoE layer reads the union of the batch's experts once (hits from the
expert cache, counted as `multi_union` against `multi_routes`). A sequence that ends leaves the
batch; the others go on.

    # B running sequences, V vocabulary, E experts, K active per token
    step: tokens [B] -> forward [B, 1] -> log-probs [B, V] -> one sample per row (its own sampler)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from edge0.backend import core as B
from edge0.backend import kvcache as bkv
from edge0.engine.sampler import RequestSampler
from edge0.errors import Edge0Error
from edge0.sampling import check_sampling


@dataclass
class Sequence:
    """One sequence of a batch: its prompt, its sampler and what it generated."""

    prompt: list[int]
    sampler: RequestSampler
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None


def batch_problem(engine) -> str | None:
    """Why `engine` cannot decode a batch (None if it can)."""
    if engine.pipeline is not None:
        return "a batch decodes in one process, not across ranks under mlx.launch"
    if engine.prerouting is not None:
        return "the pre-router predicts one sequence's routes; load with prerouter=False (--no-prerouter) to batch"
    problem = bkv.batch_problem(engine.kv.make())
    return f"{engine.model_id}: {problem}" + (" (drop --kv-bits)" if engine.kv.kv_bits else "") if problem else None


def decode_batch(
    engine, prompts: list[list[int]], max_tokens: list[int], samplers: list[RequestSampler], eos: set[int]
):
    """Generate for every prompt in one batch (at most `max_tokens[i]` tokens for prompt i);
    returns (sequences, stats of the run)."""
    totals0, io0 = engine.streaming.stats.totals(), engine.store.io_stats()
    t0 = time.perf_counter()
    seqs = [Sequence(p, s) for p, s in zip(prompts, samplers)]
    caches = []
    for seq in seqs:  # alone, as a single generation's prefill (layer-major spans)
        cache = engine.kv.make()
        engine.prefiller(seq.prompt[:-1], cache, None)
        caches.append(cache)
    cache = bkv.merge_caches(caches)
    del caches  # the sequences' own caches: for a moment both they and the merged one are held
    t_prefill = time.perf_counter() - t0
    prefilled = engine.streaming.stats.totals()
    running = list(range(len(seqs)))
    inputs = [seq.prompt[-1] for seq in seqs]
    step = 0
    while running:
        out = engine.stepper.decode_batch(inputs, step, [seqs[i].sampler for i in running], cache)
        step += 1
        left = []
        for i, y in zip(running, out):
            seq = seqs[i]
            seq.tokens.append(y)
            if y in eos:
                seq.finish = "stop"
            elif len(seq.tokens) >= max_tokens[i]:
                seq.finish = "length"
            else:
                left.append(i)
        if len(left) < len(running) and left:
            bkv.filter_cache(cache, [running.index(i) for i in left])
        running = left
        inputs = [seqs[i].tokens[-1] for i in running]
    totals, io = engine.streaming.stats.totals(), engine.store.io_stats()
    generated = sum(len(s.tokens) for s in seqs)
    routes = totals["multi_routes"] - totals0["multi_routes"]
    stats = {
        "batch_size": len(seqs),
        "batch_steps": step,
        "prompt_tokens": sum(len(p) for p in prompts),
        "generated_tokens": generated,
        "prefill_s": t_prefill,
        "decode_s": time.perf_counter() - t0 - t_prefill,
        "expert_bytes_read": totals["bytes_read"] - totals0["bytes_read"],
        "prefill_expert_bytes_read": prefilled["bytes_read"] - totals0["bytes_read"],
        "store_bytes_read": io["bytes_read"] - io0["bytes_read"],
        "multi_union": totals["multi_union"] - totals0["multi_union"],
        "multi_routes": routes,
        "union_per_routed": (totals["multi_union"] - totals0["multi_union"]) / routes if routes else None,
    }
    return seqs, stats


def check_batch(engine, prompts, max_tokens, temperature, top_p, top_k, seed) -> tuple[list[list[int]], list[int]]:
    """The prompts encoded and each one's max_tokens (one int for all, or one per prompt), after
    the checks a batch needs (Edge0Error naming the problem)."""
    if problem := batch_problem(engine):
        raise Edge0Error(f"generate_batch: {problem}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise Edge0Error("generate_batch: no prompts (pass a list of strings or token-id lists)")
    limits = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    if len(limits) != len(prompts):
        raise Edge0Error(f"generate_batch: {len(limits)} max_tokens for {len(prompts)} prompts; give one per prompt")
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in limits):
        raise Edge0Error(f"max_tokens must be integers >= 1 (got {max_tokens!r})")
    check_sampling(temperature, top_p, seed, top_k=top_k)
    if seed is not None:
        B.seed(seed)  # one stream for the whole batch: a row's samples depend on the batch it is in
    tokens = [engine.encode(p) for p in prompts]
    return tokens, limits
