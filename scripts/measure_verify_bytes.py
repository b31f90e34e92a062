"""Expert bytes read per generated token by plain staged decoding and by speculative verifies with
the controlled drafter, on a bench model with qwen3-like routes and a small expert cache. Bytes
read do not depend on timing, so this needs no read limit and runs in seconds; run it at two
commits to compare what a change to the verify's reads does.

Usage: python scripts/measure_verify_bytes.py --model /work/bench-quick [--expert-cache 20%]
       [--tokens 64] [--p 1.0,0.9] [--k 2,4] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a bench-model directory (with store/) or an edge0 store")
    ap.add_argument("--expert-cache", default="20%", help="the expert cache, a share of all experts")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--p", default="1.0,0.9", help="draft-token accuracies")
    ap.add_argument("--k", default="2,4", help="draft lengths")
    ap.add_argument("--seeds", type=int, default=3, help="drafter seeds per setting (their mean is printed)")
    args = ap.parse_args()

    from edge0.bench.child import prompt_ids
    from edge0.bench.routing import use_synthetic_routing
    from edge0.bench.speculative import controlled, run_setting, staged_engine

    engine = staged_engine(args.model, args.expert_cache)
    use_synthetic_routing(engine, seed=0)
    prompt = prompt_ids(engine.tokenizer, 40)
    ks, ps = [int(k) for k in args.k.split(",")], [float(p) for p in args.p.split(",")]
    reference = engine.generate(prompt, max_tokens=args.tokens + max(ks), ignore_eos=True).tokens
    plain = run_setting(engine, prompt, args.tokens, reference)
    print(f"{engine.describe()}\nplain staged: {plain['expert_bytes_per_token'] / 2**20:.2f} MiB / token")
    for p in ps:
        for k in ks:
            runs = [
                run_setting(engine, prompt, args.tokens, reference, controlled(engine, reference, p, k, False, seed=s))
                for s in range(args.seeds)
            ]
            if not all(r["identical"] for r in runs):
                sys.exit(f"p={p} k={k}: speculative tokens differ from plain ones")
            mib = statistics.mean(r["expert_bytes_per_token"] for r in runs) / 2**20
            tpv = statistics.mean(r["tokens_per_verify"] for r in runs)
            print(
                f"p={p} k={k}: {mib:.2f} MiB / token ({mib / (plain['expert_bytes_per_token'] / 2**20):.2f} of plain), "
                f"{tpv:.2f} tokens / verify"
            )


if __name__ == "__main__":
    main()
