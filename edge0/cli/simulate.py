"""`edge0 simulate`: replay a routing trace through every cache policy at several budgets and
print hit rates, with Belady's offline optimum as the upper bound."""

from __future__ import annotations

import json
import sys

from edge0.cache import POLICIES, tracefile
from edge0.cache.flashmoe import load_model
from edge0.cache.replay import ORDER, format_table, parse_budgets, parse_byte_budgets, simulate
from edge0.cache.smoe import DEFAULT_WINDOW
from edge0.cache.synthetic import synthetic_trace
from edge0.cli.common import OneLineParser, run_main
from edge0.errors import Edge0Error

# int4 bytes of one Qwen3-30B-A3B expert: 3 x 2048 x 768 weights, 4 bits + a 16-bit scale and bias per 64
QWEN3_30B_EXPERT_BYTES = 3 * 2048 * 768 * 9 // 16


def to_json(trace, results) -> dict:
    return {
        "trace": {k: trace.meta.get(k) for k in ("model", "manifest_hash", "num_experts", "top_k", "layers", "source")},
        "steps": trace.num_steps,
        "results": [
            {
                "policy": r.policy,
                "budget": r.budget.label,
                "capacity": r.budget.capacity,
                "hit_rate": r.hit_rate,
                "hits": r.hits,
                "misses": r.misses,
                "bytes_read_per_step": r.bytes_read / max(1, trace.num_steps),
                "substitutions_per_step": r.substitutions / max(1, trace.num_steps),
                "layer_hit_rates": {str(k): v for k, v in r.layers.items()},
            }
            for r in results
        ],
    }


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 simulate", description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--trace", help="trace file from edge0 trace")
    g.add_argument(
        "--routing",
        choices=["qwen3-like"],
        help="instead of a trace: synthetic routes fitted to Qwen3-30B-A3B's cache statistics "
        "(docs/synthetic-routing.md), "
        "of --experts/--top-k/--layers/--steps; MiB columns assume Qwen3-30B-A3B's int4 expert (2.65 MB)",
    )
    p.add_argument("--experts", type=int, default=128, help="--routing: experts per layer (default 128)")
    p.add_argument("--top-k", type=int, default=8, help="--routing: experts per token (default 8)")
    p.add_argument("--layers", type=int, default=8, help="--routing: MoE layers (default 8)")
    p.add_argument("--steps", type=int, default=2000, help="--routing: tokens (default 2000)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="--routing: seed of the synthetic model: which experts are popular (default 0)",
    )
    p.add_argument(
        "--text-seed",
        type=int,
        default=None,
        help="--routing: seed of the token process, for another text through the same model",
    )
    p.add_argument(
        "--budget",
        default=None,
        help="experts cached per layer: fractions and/or counts, e.g. 1/8,1/4,3/8 (default) or 4,8",
    )
    p.add_argument("--budget-bytes", default=None, help="total cache bytes over all MoE layers, e.g. 16MiB,64MiB")
    p.add_argument(
        "--policies", default=None, help=f"comma-separated subset of {','.join(ORDER)} (default: all available)"
    )
    p.add_argument(
        "--smoe-window",
        type=int,
        default=DEFAULT_WINDOW,
        help=f"smoe: steps in the score window (default {DEFAULT_WINDOW})",
    )
    p.add_argument(
        "--cache-weights",
        default=None,
        help="flashmoe: weights from edge0 train-cache-policy (flashmoe is skipped without them)",
    )
    p.add_argument(
        "--substitute-alpha",
        type=float,
        default=0.0,
        help="estimate SMoE substitution (lossy: changes outputs) with this alpha; default 0 (off)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)

    if args.routing:
        if not (1 <= args.top_k <= args.experts and args.layers >= 1 and args.steps >= 1 and args.seed >= 0):
            p.error("--routing: needs 1 <= --top-k <= --experts, --layers >= 1, --steps >= 1 and --seed >= 0")
        trace = synthetic_trace(
            args.experts,
            args.top_k,
            list(range(args.layers)),
            [QWEN3_30B_EXPERT_BYTES] * args.layers,
            args.steps,
            args.seed,
            {"model": f"synthetic {args.routing}"},
            text_seed=args.text_seed,
        )
    else:
        trace = tracefile.read(args.trace)
    E = trace.num_experts
    budgets = parse_budgets(args.budget, E) if args.budget else []
    if args.budget_bytes:
        budgets += parse_byte_budgets(args.budget_bytes, trace.expert_bytes, E)
    if not budgets:
        budgets = parse_budgets("1/8,1/4,3/8", E)
    if args.policies:
        policies = [x.strip() for x in args.policies.split(",") if x.strip()]
        bad = [x for x in policies if x not in POLICIES]
        if bad:
            raise Edge0Error(f"--policies: unknown {', '.join(bad)}; choose from {', '.join(ORDER)}")
        if "flashmoe" in policies and not args.cache_weights:
            raise Edge0Error("--policies: flashmoe needs --cache-weights FILE (from edge0 train-cache-policy)")
    else:
        policies = [x for x in ORDER if x != "flashmoe" or args.cache_weights]
    if not 0 <= args.substitute_alpha < float("inf"):
        raise Edge0Error(f"--substitute-alpha {args.substitute_alpha}: must be a finite number >= 0")
    if args.substitute_alpha and "belady" in policies:
        policies.remove("belady")  # it knows only the unsubstituted routes: no longer a bound
    if args.smoe_window < 1:
        raise Edge0Error("--smoe-window: must be >= 1 step")
    options = {"smoe": {"window": args.smoe_window}}
    if args.cache_weights:
        options["flashmoe"] = {"weights": load_model(args.cache_weights)}

    results = simulate(trace, policies, budgets, options, alpha=args.substitute_alpha)
    if args.json:
        json.dump(to_json(trace, results), sys.stdout, indent=1)
        print()
        return 0
    src = trace.meta.get("source", {})
    source = (
        f"source {src.get('data', '?')}" if args.trace else f"seed {args.seed} (synthetic, not a real model's routes)"
    )
    print(
        f"trace {args.trace or args.routing}: {trace.meta.get('model')}, {trace.num_steps} steps x "
        f"{len(trace.layers)} MoE layers, "
        f"{E} experts, top-{trace.top_k}, {source}"
    )
    print("hit rate (MiB read per token); columns: budget (experts cached per layer / experts)\n")
    print(format_table(results, budgets, E, trace.num_steps))
    small = [b.label for b in budgets if b.capacity < trace.top_k]
    if small:
        print(
            f"\n{', '.join(small)}: below top-{trace.top_k}; the route is held for its step only "
            "(the live pool needs at least top-k slots; see docs/cache-policies.md)"
        )
    if args.substitute_alpha:
        print(
            f"\nsubstitution alpha {args.substitute_alpha} (CHANGES OUTPUTS; estimate on the unsubstituted trace, "
            "Belady omitted); substitutions per token: "
            + ", ".join(f"{r.policy}@{r.budget.label} {r.substitutions / trace.num_steps:.2f}" for r in results)
        )
    if "flashmoe" not in policies:
        print("\n(flashmoe: pass --cache-weights FILE from edge0 train-cache-policy to include it)")
    return 0


if __name__ == "__main__":
    run_main(main)
