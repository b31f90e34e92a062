"""`edge0 train-cache-policy`: train the FlashMoE-style learned eviction policy on a routing
trace with Belady labels, evaluate it on a held-out tail of the trace against LRU and Belady,
and save its weights (safetensors) with provenance."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

from edge0.cache import tracefile
from edge0.cache.flashmoe import FEATURES
from edge0.cache.learn import train
from edge0.cache.replay import ORDER, format_table, parse_budgets, simulate
from edge0.cli.common import OneLineParser, run_main
from edge0.errors import Edge0Error
from edge0.store.format import sha256_file
from edge0.version import __version__


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 train-cache-policy", description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="trace file from edge0 trace")
    p.add_argument("--out", required=True, type=Path, help="weights file to write (.safetensors)")
    p.add_argument(
        "--holdout",
        type=float,
        default=0.2,
        help="fraction of the trace's steps (the tail) held out for evaluation (default 0.2)",
    )
    p.add_argument(
        "--budget",
        default="1/8,1/4,3/8",
        help="budgets to train and evaluate at (experts per layer, default 1/8,1/4,3/8)",
    )
    p.add_argument("--embed", type=int, default=4, help="expert embedding size (default 4)")
    p.add_argument("--hidden", type=int, default=64, help="MLP hidden width (default 64)")
    p.add_argument(
        "--rounds", type=int, default=2, help="data collection rounds: 1 Belady-driven, then model-driven (default 2)"
    )
    p.add_argument("--epochs", type=int, default=6, help="training epochs per round (default 6)")
    p.add_argument("--max-decisions", type=int, default=50000, help="eviction decisions kept per round (default 50000)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.holdout < 1:
        raise Edge0Error(f"--holdout: {args.holdout} must be between 0 and 1 (exclusive)")
    if min(args.embed, args.hidden, args.rounds, args.epochs, args.max_decisions) < 1:
        raise Edge0Error("--embed, --hidden, --rounds, --epochs and --max-decisions must be >= 1")
    if not args.out.parent.is_dir():
        raise Edge0Error(f"--out: directory {args.out.parent} does not exist; create it or pick another path")

    trace = tracefile.read(args.trace)
    budgets = parse_budgets(args.budget, trace.num_experts)
    split = int(round(trace.num_steps * (1 - args.holdout)))
    if split < 1 or split >= trace.num_steps:
        raise Edge0Error(
            f"--holdout: {args.holdout} of {trace.num_steps} steps leaves no training or no held-out steps"
        )
    head, tail = trace.slice(0, split), trace.slice(split, trace.num_steps)

    t0 = time.perf_counter()
    try:
        model, loss = train(
            head,
            [b.capacity for b in budgets],
            embed=args.embed,
            hidden=args.hidden,
            rounds=args.rounds,
            epochs=args.epochs,
            max_decisions=args.max_decisions,
            seed=args.seed,
        )
    except ValueError as e:
        raise Edge0Error(f"--trace {args.trace}: {e}") from None
    train_s = time.perf_counter() - t0
    results = simulate(tail, ORDER, budgets, {"flashmoe": {"weights": model}})
    held_out = {f"{r.policy}@{r.budget.label}": round(r.hit_rate, 5) for r in results}
    model.save(
        args.out,
        {
            "trace": str(args.trace),
            "trace_sha256": sha256_file(Path(args.trace)),
            "model": trace.meta.get("model"),
            "manifest_hash": trace.meta.get("manifest_hash"),
            "budgets": {b.label: b.capacity for b in budgets},
            "features": FEATURES,
            "architecture": {"embed": args.embed, "hidden": args.hidden, "layers": 2, "activation": "relu"},
            "training": {
                "train_steps": split,
                "held_out_steps": trace.num_steps - split,
                "holdout": args.holdout,
                "rounds": args.rounds,
                "epochs": args.epochs,
                "loss": round(loss, 5),
                "seed": args.seed,
                "seconds": round(train_s, 1),
                "labels": "belady (farthest next use), softmax over candidates",
            },
            "held_out_hit_rates": held_out,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "edge0_version": __version__,
        },
    )
    print(
        f"\nheld-out hit rates (last {trace.num_steps - split} of {trace.num_steps} steps), MiB read per token in "
        "parentheses:\n"
    )
    print(format_table(results, budgets, trace.num_experts, tail.num_steps))
    print(f"\nwrote {args.out} ({model.nbytes / 1024:.1f} KiB of weights, trained in {train_s:.0f} s)")
    return 0


if __name__ == "__main__":
    run_main(main)
