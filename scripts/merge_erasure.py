#!/usr/bin/env python3
"""Merge-erasure check: merge a LoRA adapter into the int4 weights it adapts (dequantize W, add
(alpha/r)·B·A, requantize with the same group size and bits) and measure how much of the
adapter's effect on the logits survives, on held-out windows, along the serving route:

    survival = ||logits_merged - logits_base|| / ||logits_lora - logits_base||

Two requantizations: "fresh" quantizes W + dW from scratch (new per-group scales and biases, as
`mlx_lm convert -q` would quantize a merged checkpoint); "fixed" rounds W + dW onto the base's
own grid (scales and biases kept, only the int4 codes change).

(Frobenius norms over every position of every window), and the part of the merged change that
points along the adapter's own change, <merged - base, lora - base> / ||lora - base||^2 (requantizing
also flips roundings unrelated to the adapter; this part does not count them). A float merge (no requantization) is
the control and must give ~1. Also reports perplexity of each variant and, per adapted linear,
||Q(W + dW) - Q(W)|| / ||dW||, its part along dW, and the fraction of dW entries below half a quantization step.

Usage: python scripts/merge_erasure.py --model STORE --lora FILE [--prerouter HEADS] --data data/valid.txt
       [--window 256] [--max-windows 8] [--delta-scale 1.0] [--out docs/benchmarks/lora-merge-erasure.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

import numpy as np

import edge0
from edge0.backend import lora as blora
from edge0.engine.evaluate import windows
from edge0.lora.adapter import read_adapter


def _logp(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _scaled(args, kw):
    e = edge0.load(args.model, lora=args.lora, **kw)
    for m in blora.lora_modules(e.model).values():
        m.scale *= args.delta_scale
    return e


def _median(stats: dict, key: str) -> float:
    return float(np.median([v[key] for v in stats.values()]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="edge0 store")
    p.add_argument("--lora", required=True, help="adapter trained for this store")
    p.add_argument("--prerouter", default=None, help="heads the adapter was trained with (default: the store's)")
    p.add_argument("--data", default="data/valid.txt")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-windows", type=int, default=8)
    p.add_argument(
        "--delta-scale",
        type=float,
        default=1.0,
        help="multiply the adapter's delta (alpha/r) by this, to see how survival depends on the delta's size",
    )
    p.add_argument("--out", default="docs/benchmarks/lora-merge-erasure.json")
    args = p.parse_args()

    _, meta = read_adapter(args.lora)
    kw = dict(
        top_k=meta["top_k"], prefill_executor="exact", prerouter=args.prerouter if meta["prerouter_sha256"] else False
    )
    engines = {"base": edge0.load(args.model, lora=False, **kw), "lora": _scaled(args, kw)}
    per_linear = {}
    for how in blora.MERGES:
        e = _scaled(args, kw)
        per_linear[f"merged_{how}"] = blora.merge_lora(e.model, how)
        engines[f"merged_{how}"] = e
    tokens = engines["base"].encode(Path(args.data).read_text(encoding="utf-8"))
    sq = {n: 0.0 for n in engines}
    dot = {n: 0.0 for n in engines}
    nll = {n: 0.0 for n in engines}
    count = 0
    for w in windows(tokens, args.window, args.max_windows):
        logits = {n: e.prerouted_logits(w).astype(np.float64) for n, e in engines.items()}
        target = np.array(w[1:])
        for n, z in logits.items():
            sq[n] += float(((z - logits["base"]) ** 2).sum())
            dot[n] += float(((z - logits["base"]) * (logits["lora"] - logits["base"])).sum())
            nll[n] -= float(_logp(z)[:-1][np.arange(len(target)), target].sum())
        count += len(target)
    effect = math.sqrt(sq["lora"])
    merges = list(per_linear)
    result = {
        "model": str(args.model),
        "lora": str(args.lora),
        "top_k": meta["top_k"],
        "r": meta["r"],
        "alpha": meta["alpha"],
        "delta_scale": args.delta_scale,
        "data": args.data,
        "windows": len(windows(tokens, args.window, args.max_windows)),
        "tokens": count,
        "logit_effect_survival": {n: math.sqrt(sq[n]) / effect for n in merges},
        "logit_effect_aligned": {n: dot[n] / sq["lora"] for n in merges},
        "perplexity": {n: math.exp(v / count) for n, v in nll.items()},
        "weight_delta_kept_median": {n: _median(per_linear[n], "delta_kept") for n in merges},
        "weight_delta_aligned_median": {n: _median(per_linear[n], "delta_aligned") for n in merges},
        "median_delta_in_steps": _median(per_linear["merged_fresh"], "median_delta_in_steps"),
        "delta_below_half_step_mean": float(
            np.mean([v["below_half_step"] for v in per_linear["merged_fresh"].values()])
        ),
        "per_linear": per_linear,
        "date": datetime.date.today().isoformat(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    s, a, ppl = result["logit_effect_survival"], result["logit_effect_aligned"], result["perplexity"]
    for n in merges:
        print(
            f"{n}: logit effect kept {100 * s[n]:.1f}% by norm, {100 * a[n]:.1f}% along the adapter's; weight delta "
            "kept "
            f"{100 * result['weight_delta_kept_median'][n]:.1f}% by norm, "
            f"{100 * result['weight_delta_aligned_median'][n]:.1f}% along dW"
        )
    print(
        f"{100 * result['delta_below_half_step_mean']:.1f}% of delta entries are below half a 4-bit step "
        f"(median |dW| = {result['median_delta_in_steps']:.2f} steps)"
    )
    print("perplexity: " + ", ".join(f"{n} {v:.3f}" for n, v in ppl.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
