#!/usr/bin/env python3
"""Merge-erasure check: merge a LoRA adapter into the int4 weights it adapts (dequantize W, add
(alpha/r)·B·A, requantize with the same group size and bits) and measure how much of the
adapter's effect on the logits survives, on held-out windows, along the serving route:

    survival = ||logits_merged - logits_base|| / ||logits_lora - logits_base||

(Frobenius norms over every position of every window), and the part of the merged change that
points along the adapter's own change, <merged - base, lora - base> / ||lora - base||^2 (requantizing
also flips roundings unrelated to the adapter; this part does not count them). A float merge (no requantization) is
the control and must give ~1. Also reports perplexity of each variant and, per adapted linear,
||Q(W + dW) - Q(W)|| / ||dW||, its part along dW, and the fraction of dW entries below half a quantization step.

Usage: python scripts/merge_erasure.py --model STORE --lora FILE --data data/valid.txt
       [--window 256] [--max-windows 8] [--out docs/benchmarks/lora-merge-erasure.json]
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
from edge0.evaluate import windows
from edge0.lora.adapter import read_adapter


def _logp(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="edge0 store")
    p.add_argument("--lora", required=True, help="adapter trained for this store")
    p.add_argument("--prerouter", default=None, help="heads the adapter was trained with (default: the store's)")
    p.add_argument("--data", default="data/valid.txt")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-windows", type=int, default=8)
    p.add_argument("--out", default="docs/benchmarks/lora-merge-erasure.json")
    args = p.parse_args()

    _, meta = read_adapter(args.lora)
    kw = dict(top_k=meta["top_k"], prefill_executor="exact",
              prerouter=args.prerouter if meta["prerouter_sha256"] else False)
    engines = {"base": edge0.load(args.model, lora=False, **kw), "lora": edge0.load(args.model, lora=args.lora, **kw)}
    per_linear = {}
    for name, requantize in (("merged_int4", True), ("merged_float", False)):
        e = edge0.load(args.model, lora=args.lora, **kw)
        per_linear[name] = blora.merge_lora(e.model, requantize=requantize)
        engines[name] = e
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
    kept = {n: [v["delta_kept"] for v in s.values()] for n, s in per_linear.items()}
    aligned = [v["delta_aligned"] for v in per_linear["merged_int4"].values()]
    result = {
        "model": str(args.model), "lora": str(args.lora), "top_k": meta["top_k"], "r": meta["r"], "alpha": meta["alpha"],
        "data": args.data, "windows": len(windows(tokens, args.window, args.max_windows)), "tokens": count,
        "logit_effect_survival": {n: math.sqrt(sq[n]) / effect for n in ("merged_int4", "merged_float")},
        "logit_effect_aligned": {n: dot[n] / sq["lora"] for n in ("merged_int4", "merged_float")},
        "perplexity": {n: math.exp(v / count) for n, v in nll.items()},
        "weight_delta_kept_median": {n: float(np.median(v)) for n, v in kept.items()},
        "weight_delta_kept_range": {n: [float(min(v)), float(max(v))] for n, v in kept.items()},
        "weight_delta_aligned_median": float(np.median(aligned)),
        "delta_below_half_step_mean": float(np.mean([v["below_half_step"] for v in per_linear["merged_int4"].values()])),
        "per_linear": per_linear["merged_int4"],
        "date": datetime.date.today().isoformat(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    s, ppl = result["logit_effect_survival"], result["perplexity"]
    a = result["logit_effect_aligned"]
    print(f"logit effect surviving the int4 merge: {100 * s['merged_int4']:.1f}% by norm, {100 * a['merged_int4']:.1f}% along the "
          f"adapter's direction (float-merge control {100 * s['merged_float']:.1f}% / {100 * a['merged_float']:.1f}%)")
    print(f"weight delta kept by requantization: median {100 * result['weight_delta_kept_median']['merged_int4']:.1f}% "
          f"(range {100 * min(kept['merged_int4']):.1f}-{100 * max(kept['merged_int4']):.1f}%), "
          f"{100 * result['weight_delta_aligned_median']:.1f}% along dW; "
          f"{100 * result['delta_below_half_step_mean']:.1f}% of delta entries are below half a 4-bit step")
    print("perplexity: " + ", ".join(f"{n} {v:.3f}" for n, v in ppl.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
