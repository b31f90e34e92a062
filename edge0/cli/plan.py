"""`edge0 plan`: predict, for several expert-cache budgets, the hit rate (simulated on a routing
trace), the expert bytes read per token and the decode speed (from read and compute costs
measured on this machine), and recommend a budget."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

import edge0
from edge0.cache import POLICIES, tracefile
from edge0.cache.record import record, record_file, synthetic_record
from edge0.cache.replay import parse_budgets, simulate
from edge0.cli.common import OneLineParser, add_model_options, add_routing_option, load_options, run_main
from edge0.errors import Edge0Error
from edge0.planning.budget import PROMPTS, measure_decode, measure_reads, per_layer, predict, recommend
from edge0.store.format import manifest_hash
from edge0.units import format_size, parse_size


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 plan", description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--trace", default=None, help="trace of this model (default: record one now)")
    p.add_argument(
        "--data", type=Path, default=None, help="text to record the trace on (default: generate from built-in prompts)"
    )
    p.add_argument("--prompts", type=int, default=4, help="prompts when recording (default 4)")
    p.add_argument(
        "--prompt-tokens", type=int, default=256, help="teacher-forced tokens per prompt when recording from --data"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per prompt when recording (default 64)")
    add_routing_option(
        p, "model", "simulate on the model's own routes (--trace, or recorded now)", ", with this model's shape"
    )
    p.add_argument(
        "--budget", default="1/8,1/4,3/8,1/2,3/4,1/1", help="experts cached per layer (default 1/8,1/4,3/8,1/2,3/4,1/1)"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also write the measurements and predictions here, to check against later runs",
    )
    g = p.add_argument_group("forecast before download (reads only config.json and the safetensors headers)")
    g.add_argument(
        "--hf-path",
        default=None,
        metavar="REPO_OR_DIR",
        help="a Hugging Face repo id or a local model directory, not yet converted: forecast instead of plan",
    )
    g.add_argument(
        "--memory", default=None, metavar="SIZE", help="--hf-path: the memory to plan for (default: available now)"
    )
    args = p.parse_args(argv)
    if args.hf_path:
        return forecast_main(args)
    if args.memory:
        p.error("--memory goes with --hf-path")
    if args.cache_policy not in POLICIES or args.cache_policy in ("belady", "flashmoe"):
        raise Edge0Error(f"--cache-policy: {args.cache_policy!r} cannot be planned; use one of lru, lfu, arc, smoe")
    if args.substitute_alpha:
        raise Edge0Error(
            "--substitute-alpha: edge0 plan predicts exact serving; estimate substitution with "
            "edge0 simulate --substitute-alpha, measure it with edge0 eval --decode --substitute-alpha"
        )
    if min(args.prompts, args.max_tokens) < 1 or args.prompt_tokens < 2:
        raise Edge0Error("--prompts and --max-tokens must be >= 1, --prompt-tokens >= 2")

    # The engine for recording and read timing needs no slots (the thing planned here).
    engine = edge0.load(args.model, **load_options(args, decode_executor="exact"))
    if args.routing == "qwen3-like":
        if args.trace or args.data:
            raise Edge0Error("--routing qwen3-like: the routes are generated; drop --trace / --data")
        trace = synthetic_record(engine, 2000)
    elif args.trace:
        trace = tracefile.read(args.trace)
        if trace.meta.get("manifest_hash") != manifest_hash(engine.root):
            raise Edge0Error(
                f"--trace: {args.trace} was recorded on another store; record one with: edge0 trace --model "
                f"{engine.root} --data FILE --out TRACE"
            )
    elif args.data:
        trace = record_file(engine, args.data, args.prompts, args.prompt_tokens, args.max_tokens)
    else:
        trace = record(
            engine,
            [engine.encode(t) for t in PROMPTS[: args.prompts]],
            args.max_tokens,
            {"prompts": PROMPTS[: args.prompts]},
        )
    budgets = parse_budgets(args.budget, trace.num_experts)
    results = simulate(
        trace, [args.cache_policy], budgets, {"smoe": {"window": args.smoe_window}} if args.smoe_window else {}
    )

    reads = measure_reads(engine.store, trace.layers, trace.num_experts)
    cold, warm = (per_layer(reads[k], trace.layers) for k in ("cold_s", "warm_s"))
    cold_extra_per_byte = max(0.0, (sum(cold) - sum(warm)) / sum(trace.expert_bytes))
    # Step time against bytes read does not depend on which policy chose the bytes; LRU needs
    # nothing from the pool (smoe needs scores, flashmoe weights).
    options = load_options(args, cache_policy="lru", smoe_window=None)
    hi = measure_decode(engine.root, options, None)
    lo = measure_decode(engine.root, options, trace.top_k * sum(trace.expert_bytes))
    rows = predict(trace, results, hi, lo, cold_extra_per_byte)
    best = recommend(rows)

    print(
        f"{engine.model_id}: {len(trace.layers)} MoE layers x {trace.num_experts} experts, top-{trace.top_k}; "
        f"trace {trace.num_steps} steps; policy {args.cache_policy}"
    )
    print(
        f"measured: one expert read {1e3 * np.mean(cold):.2f} ms "
        f"{'cold' if reads['cold_forced'] else 'warm (could not drop the page cache)'}, "
        f"{1e3 * np.mean(warm):.3f} ms warm; "
        f"decode step {1e3 * hi['step_s']:.1f} ms reading {hi['bytes_per_token'] / 2**20:.2f} MiB/token "
        "(default cache), "
        f"{1e3 * lo['step_s']:.1f} ms reading {lo['bytes_per_token'] / 2**20:.2f} MiB/token (top-k slots), "
        "page cache warm; "
        f"resident weights {engine.resident_bytes / 2**20:.1f} MiB\n"
    )
    print("| budget | experts/layer | cache MiB | hit rate | MiB read/token | predicted tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['budget']} | {r['experts_per_layer']} | {r['cache_bytes'] / 2**20:.1f} | "
            f"{100 * r['hit_rate']:.1f}% | "
            f"{r['bytes_per_token'] / 2**20:.3f} | {r['tok_s']:.1f} |"
        )
    print(
        f"\nrecommended: {best['budget']} of the experts ({best['experts_per_layer']} per layer): "
        f"--expert-cache {best['cache_bytes']} --cache-policy {args.cache_policy}; "
        f"the smallest budget within 10% of the best predicted speed"
    )
    if best["experts_per_layer"] < trace.top_k:
        print(f"note: the live pool needs at least top-k = {trace.top_k} experts per layer")
    if args.json:
        doc = {
            "model": engine.model_id,
            "manifest_hash": trace.meta.get("manifest_hash"),
            "policy": args.cache_policy,
            "trace_steps": trace.num_steps,
            "measured": {**reads, "large_cache": hi, "topk_slots": lo},
            "predictions": rows,
            "recommended": best["budget"],
        }
        args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(main)


def forecast_main(args) -> int:
    """`edge0 plan --hf-path`: fit and speed of a checkpoint before it is downloaded."""
    from edge0.backend import memory as probe
    from edge0.planning.forecast import forecast, probe_compute, probe_disk, read_checkpoint, summarize
    from edge0.store.bundled import cache_dir

    memory = parse_size(args.memory, "--memory") if args.memory else probe.available()[0]
    config, tensors = read_checkpoint(args.hf_path)
    ck = summarize(config, tensors, args.hf_path)
    where = Path(args.hf_path).expanduser() if Path(args.hf_path).expanduser().is_dir() else cache_dir()
    where.mkdir(parents=True, exist_ok=True)
    disk, compute = probe_disk(where, ck.expert_bytes), probe_compute(config, ck.hidden)
    f = forecast(ck, memory, disk, compute)
    print(
        f"{args.hf_path}: {ck.model_type}, {ck.num_layers} layers ({ck.moe_layers} MoE) x {ck.num_experts} experts, "
        f"top-{ck.top_k}; checkpoint {format_size(ck.checkpoint_bytes)}"
    )
    print(
        f"probes: expert read {1e3 * disk['expert_read_s']:.2f} ms {'cold' if disk['cold'] else 'warm'} "
        f"({format_size(ck.expert_bytes)}), sequential {disk['sequential_bytes_per_s'] / 1e6:.0f} MB/s, int4 matmul "
        f"{compute['bytes_per_s'] / 1e9:.1f} GB/s of weights, {1e3 * compute['layer_s']:.2f} ms per layer of graph"
    )
    print(f"store size       {format_size(f['store_bytes'])}")
    print(f"resident         {format_size(f['resident_bytes'])}")
    print(
        f"expert cache     {format_size(f['expert_cache_bytes'])} of {format_size(ck.expert_store_bytes)} "
        f"({f['experts_cached_per_layer']} of {ck.num_experts} experts per layer) in {format_size(memory)}"
    )
    print(
        f"decode           {f['tok_s_low']:.1f}-{f['tok_s_high']:.1f} tok/s (uniform routing, hit rate "
        f"{100 * f['hit_rate_uniform']:.0f}%, to qwen3-like locality, {100 * f['hit_rate_local']:.0f}%)"
    )
    kv, longest = f["kv_bytes_at_max_context"], f["longest_context_kv"]
    print(
        f"KV cache         {format_size(kv['float32'])} at the model's {ck.max_context} tokens; --kv-bits 8: "
        f"{format_size(kv['8-bit'])}, --kv-bits 4: {format_size(kv['4-bit'])}"
    )
    print(
        f"longest context  {longest['float32']} tokens (--kv-bits 8: {longest['8-bit']}, "
        f"--kv-bits 4: {longest['4-bit']})"
    )
    print(f"verdict          {f['verdict']}")
    if args.json:
        args.json.write_text(
            json.dumps({"checkpoint": asdict(ck), "probes": {"disk": disk, "compute": compute}, **f}, indent=1) + "\n"
        )
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
