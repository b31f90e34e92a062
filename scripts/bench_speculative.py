"""Speculative decoding bench: a controlled drafter (true greedy continuation with probability p
per token) at p x k against plain staged decoding, warm or under a read limit, in one process per
run so every setting shares one warm engine; plus the measured cost of a (k+1)-token verify
forward against a 1-token step, and the ceiling (tokens per verify) / (that cost ratio).

Usage: python scripts/bench_speculative.py --model /work/bench-quick [--p 0.9,0.6,0.3] [--k 2,4,8]
       [--tokens 64] [--repeats 2] [--read-limit 200MB --expert-cache 20%] [--routing qwen3-like]
       [--out FILE.json]

`--read-limit RATE` runs the measuring process in a block-I/O cgroup (edge0.bench.cgroup.ReadLimit)
that limits reads from the store's disk to RATE bytes/s, with direct I/O (no page cache) and an
expert cache of `--expert-cache` of all experts, so misses really wait on the limited disk.
Run it under the CPU lock: flock /tmp/edge0-cpu.lock python scripts/bench_speculative.py ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(args) -> dict:
    from edge0.bench.child import prompt_ids
    from edge0.bench.speculative import controlled, forward_cost, run_setting, staged_engine

    limited = bool(args.read_limit)  # misses must really wait on the limited disk
    engine = staged_engine(args.model, args.expert_cache if limited else None, "direct" if limited else None)
    if args.routing == "qwen3-like":  # routes with a real model's locality across tokens
        from edge0.bench.routing import use_synthetic_routing

        use_synthetic_routing(engine, seed=0)
    prompt = prompt_ids(engine.tokenizer, args.prompt_tokens)
    ks, ps = [int(k) for k in args.k.split(",")], [float(p) for p in args.p.split(",")]
    n = args.tokens
    reference = engine.generate(prompt, max_tokens=n + max(ks), ignore_eos=True).tokens  # also warms up
    costs = {t: forward_cost(engine, prompt, reference, t, args.cost_repeats) for t in [1, *(k + 1 for k in ks)]}
    runs = []
    # an adaptive speculator is kept across repeats, as an engine keeps it across requests: its
    # first generation starts from no estimates, the later ones from what it measured
    kept = {(p, k): controlled(engine, reference, p, k, True) for p in ps for k in ks}
    adaptive_ks = ks if args.adaptive_k is None else [int(k) for k in args.adaptive_k.split(",")]
    adaptive_ps = ps if args.adaptive_p is None else [float(p) for p in args.adaptive_p.split(",")]
    keys = [
        (p, k, a) for p in ps for k in ks for a in (False, True) if not a or (k in adaptive_ks and p in adaptive_ps)
    ]
    for rep in range(args.repeats):
        row = {}
        # each setting right after a plain run: its speedup is against that run (machine drift cancels)
        for p, k, adaptive in keys:
            key = f"p={p} k={k}{' adaptive' if adaptive else ''}"
            row[f"plain before {key}"] = run_setting(engine, prompt, n, reference)
            sp = kept[p, k] if adaptive else controlled(engine, reference, p, k, False, seed=rep)
            row[key] = run_setting(engine, prompt, n, reference, sp)
            print(
                f"rep {rep} {key}: {row[key]['decode_tps']:.2f} tok/s, plain "
                f"{row[f'plain before {key}']['decode_tps']:.2f}",
                file=sys.stderr,
                flush=True,
            )
        runs.append(row)
    settings = []
    for p, k, adaptive in keys:
        key = f"p={p} k={k}{' adaptive' if adaptive else ''}"
        rs = [r[key] for r in runs]
        speedups = [r[key]["decode_tps"] / r[f"plain before {key}"]["decode_tps"] for r in runs]
        first = speedups[0]
        if adaptive and len(runs) > 1:  # the later generations: the switch's steady state
            rs, speedups = rs[1:], speedups[1:]
        tpv = statistics.median(r["tokens_per_verify"] or 1.0 for r in rs)
        ratio = costs[k + 1] / costs[1]
        settings.append(
            {
                "p": p,
                "k": k,
                "adaptive": adaptive,
                "decode_tps": statistics.median(r["decode_tps"] for r in rs),
                "speedup": statistics.median(speedups),
                "first_generation_speedup": first,
                "tokens_per_verify": tpv,
                "verify_cost_ratio": ratio,
                "ceiling": tpv / ratio,
                "of_ceiling": statistics.median(speedups) / (tpv / ratio),
                "expert_bytes_per_token": statistics.median(r["expert_bytes_per_token"] for r in rs),
                "union_per_routed": statistics.median(r["union_per_routed"] or 0 for r in rs),
                "verifies": statistics.median(r["verifies"] for r in rs),
                "plain_steps": statistics.median(r["plain_steps"] for r in rs),
                "switched_off": max(r["switched_off"] for r in rs),
                "identical": all(r["identical"] for r in rs),
            }
        )
    plain = [v for r in runs for key, v in r.items() if key.startswith("plain before")]
    return {
        "describe": engine.describe(),
        "plain": {
            "decode_tps": statistics.median(r["decode_tps"] for r in plain),
            "expert_bytes_per_token": statistics.median(r["expert_bytes_per_token"] for r in plain),
            "hit_rate": statistics.median(r["hit_rate"] or 0 for r in plain),
        },
        "forward_ms": {t: 1000 * c for t, c in costs.items()},
        "settings": settings,
        "runs": runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a bench-model directory (with store/) or an edge0 store")
    p.add_argument("--p", default="0.9,0.6,0.3", help="draft-token accuracies")
    p.add_argument("--k", default="2,4,8", help="draft lengths")
    p.add_argument("--tokens", type=int, default=64, help="tokens per generation")
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--adaptive-k", default=None, help="the k values that also get an adaptive run (default: all)")
    p.add_argument("--adaptive-p", default=None, help="the p values that also get an adaptive run (default: all)")
    p.add_argument("--cost-repeats", type=int, default=7, help="forwards timed per token count")
    p.add_argument("--read-limit", default=None, metavar="RATE", help="e.g. 200MB (bytes/s); default: none (warm)")
    p.add_argument("--expert-cache", default="20%", help="with --read-limit: the expert cache, a share of all experts")
    p.add_argument(
        "--routing",
        default="uniform",
        choices=("uniform", "qwen3-like"),
        help="the model's own routes (uniform on a random bench model) or synthetic routes fitted to "
        "Qwen3-30B-A3B (docs/synthetic-routing.md): their overlap across tokens sets a verify's union",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    limit = None
    if args.read_limit:
        from edge0.bench.cgroup import ReadLimit
        from edge0.units import parse_size

        store = Path(args.model) / "store" if (Path(args.model) / "store").is_dir() else Path(args.model)
        limit = ReadLimit.create(store, parse_size(args.read_limit))
    try:
        r = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--child"],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=limit.enter if limit else None,
        )
        if limit:
            read = limit.bytes_read()
    finally:
        if limit:
            limit.remove()
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if r.returncode or line is None:
        sys.exit(f"bench_speculative: the measuring process failed (exit {r.returncode})")
    out = json.loads(line[len("RESULT ") :])
    out.update(
        {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
            "model": args.model,
            "read_limit": args.read_limit,
            "routing": args.routing,
            "read_limit_bytes_read": read if limit else None,
            "expert_cache": args.expert_cache if args.read_limit else "default (all experts if they fit)",
            "tokens": args.tokens,
            "prompt_tokens": args.prompt_tokens,
            "repeats": args.repeats,
        }
    )
    print(f"plain staged: {out['plain']['decode_tps']:.2f} tok/s; forward ms by tokens: {out['forward_ms']}")
    for s in out["settings"]:
        print(
            f"p={s['p']} k={s['k']}{' adaptive' if s['adaptive'] else '         '}: {s['decode_tps']:.2f} tok/s "
            f"x{s['speedup']:.2f} (first x{s['first_generation_speedup']:.2f}; ceiling x{s['ceiling']:.2f}, "
            f"{s['of_ceiling']:.2f} of it), "
            f"{s['tokens_per_verify']:.2f} tok/verify, cost ratio {s['verify_cost_ratio']:.2f}, "
            f"{s['expert_bytes_per_token'] / 2**20:.2f} MiB/token, union/TK {s['union_per_routed']:.2f}, "
            f"identical {s['identical']}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
