"""Loss ablation for the pre-router heads: KL only, KL + listwise top-k term, listwise only.
Collects traces once, trains each variant per owner layer, reports held-out recall@K.

Usage: python scripts/prerouter_loss_ablation.py [--model STORE] [--data data/train.txt]
       [--max-tokens 40000] [--steps 600] [--out docs/benchmarks/prerouter-loss.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edge0  # noqa: E402
from edge0.backend import assemble as bas  # noqa: E402
from edge0.prerouter.train import collect, head_topk, owner_layers, pairs, recall, train_head  # noqa: E402

VARIANTS = {"kl": (1.0, 0.0), "kl+listwise": (1.0, 0.5), "listwise": (0.0, 1.0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--data", default="data/train.txt")
    p.add_argument("--max-tokens", type=int, default=40000)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", default="docs/benchmarks/prerouter-loss.json")
    args = p.parse_args()
    engine = edge0.load(args.model, prerouter=False, decode_executor="exact")
    text = Path(args.data).read_text()
    tokens = engine.encode(text[: args.max_tokens * 8])[: args.max_tokens]
    traces = collect(engine, tokens, 256)
    n_val = max(1, len(traces) // 10)
    tr, va = traces[:-n_val], traces[-n_val:]
    blocks = dict(bas.moe_blocks(engine.model))
    k = engine.spec.top_k
    rows = {}
    for owner, consumer in owner_layers(engine).items():
        x, inds, probs = pairs(tr, owner, consumer)
        vx, vinds, _ = pairs(va, owner, consumer)
        init = np.array(blocks[consumer].router_weight())
        bias = blocks[consumer].router_bias()
        rows[consumer] = {}
        for name, (w_div, w_list) in VARIANTS.items():
            head, _ = train_head(
                init,
                x,
                probs,
                inds,
                hidden=64,
                steps=args.steps,
                lr=2e-3,
                batch=512,
                listwise=w_list,
                divergence=w_div,
                score_function="softmax",
                seed=owner,
            )
            rows[consumer][name] = recall(head_topk(head, vx, engine.spec, k, bias), vinds)
        print(consumer, {n: round(r, 4) for n, r in rows[consumer].items()}, flush=True)
    mean = {n: float(np.mean([r[n] for r in rows.values()])) for n in VARIANTS}
    print("mean", {n: round(r, 4) for n, r in mean.items()})
    Path(args.out).write_text(
        json.dumps(
            {
                "date": datetime.date.today().isoformat(),
                "command": " ".join(sys.argv),
                "tokens": len(tokens),
                "steps": args.steps,
                "recall_at_k": rows,
                "mean": mean,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
