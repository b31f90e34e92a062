#!/usr/bin/env python3
"""Recovery-LoRA evaluation (fills docs/lora.md).

Validation perplexity and KL(teacher || model) per token for the full-precision teacher
(gate routing, native K) and, at each K given, the int4 store with gate routing, int4 + pre-router,
and int4 + pre-router + the adapter trained for that K; plus the share of the teacher ->
int4+pre-router perplexity gap that the adapter closes. Every model scores the same windows.

    python scripts/lora_recovery.py --model STORE --teacher HF_DIR --heads HEADS \
        --lora 4=ADAPTER_K4 --lora 2=ADAPTER_K2 --data data/valid.txt [--window 256] [--max-windows 40]

The decode cost of the adapter is measured by the benchmark suite instead (docs/lora.md):

    edge0 bench --model STORE --arms prerouter-warm,prerouter-lora-warm --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import numpy as np


def _logp(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def quality(args) -> dict:
    import edge0
    from edge0.engine.evaluate import windows
    from edge0.lora.distill import Teacher

    adapters = dict(s.split("=", 1) for s in args.lora)
    teacher = Teacher(args.teacher)
    models = {}
    for k in args.k:
        models[f"int4 gate K={k}"] = edge0.load(args.model, top_k=k, prerouter=False, lora=False)
        models[f"int4 + pre-router K={k}"] = edge0.load(args.model, top_k=k, prerouter=args.heads, lora=False)
        if str(k) in adapters:
            models[f"int4 + pre-router + LoRA K={k}"] = edge0.load(
                args.model, top_k=k, prerouter=args.heads, lora=adapters[str(k)]
            )
    tokens = next(iter(models.values())).encode(Path(args.data).read_text(encoding="utf-8"))
    ws = windows(tokens, args.window, args.max_windows)
    names = ["teacher (fp, gate)"] + list(models)
    nll, kl, agree, count = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), 0
    for i, w in enumerate(ws):
        target = np.array(w[1:])
        rows = np.arange(len(target))
        ref = _logp(teacher.logits(w))[:-1]
        for name in names:
            lp = ref if name == names[0] else _logp(models[name].prerouted_logits(w))[:-1]
            nll[name] -= lp[rows, target].sum()
            kl[name] += float((np.exp(ref) * (ref - lp)).sum())
            agree[name] += int((ref.argmax(-1) == lp.argmax(-1)).sum())
        count += len(target)
        print(f"window {i + 1}/{len(ws)}", file=sys.stderr, end="\r")
    print(file=sys.stderr)
    rows_out = {
        n: {"perplexity": math.exp(nll[n] / count), "kl_to_teacher": kl[n] / count, "agreement": agree[n] / count}
        for n in names
    }
    closed = {}
    for k in args.k:
        lora = rows_out.get(f"int4 + pre-router + LoRA K={k}")
        if lora:
            t, pr = rows_out[names[0]]["perplexity"], rows_out[f"int4 + pre-router K={k}"]["perplexity"]
            closed[str(k)] = (pr - lora["perplexity"]) / (pr - t) if pr != t else None
    return {
        "data": args.data,
        "window": args.window,
        "windows": len(ws),
        "tokens": count,
        "teacher": args.teacher,
        "model": args.model,
        "heads": args.heads,
        "adapters": adapters,
        "results": rows_out,
        "perplexity_gap_closed": closed,
        "date": datetime.date.today().isoformat(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="edge0 store")
    p.add_argument("--heads", required=True, help="pre-router heads file")
    p.add_argument("--teacher", required=True, help="full-precision checkpoint the store was converted from")
    p.add_argument(
        "--lora", action="append", default=[], help="K=FILE: the adapter trained for serving width K (repeatable)"
    )
    p.add_argument("--k", type=int, action="append", help="serving widths (default: 4 and 2)")
    p.add_argument("--data", default="data/valid.txt")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-windows", type=int, default=40)
    p.add_argument("--out", default="docs/benchmarks/lora-quality.json", help="JSON output")
    args = p.parse_args()
    args.k = args.k or [4, 2]
    result = quality(args)
    print("| model | perplexity | KL to teacher (nats/token) | top-1 agreement |\n|---|---|---|---|")
    for n, r in result["results"].items():
        print(f"| {n} | {r['perplexity']:.3f} | {r['kl_to_teacher']:.4f} | {100 * r['agreement']:.1f}% |")
    for k, c in result["perplexity_gap_closed"].items():
        print(f"K={k}: the LoRA closes {100 * c:.1f}% of the perplexity gap teacher -> int4 + pre-router")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
