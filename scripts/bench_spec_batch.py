"""Speculative decoding in a batch on this machine (docs/speculative.md, "In a batch"): generate_batch
of B prompts (each its own greedy continuation repeated, so prompt lookup drafts), plain, with
prompt lookup always on, and with the adaptive switch; decode tok/s, verifies, acceptance, and
whether the tokens are the same.

    python scripts/bench_spec_batch.py STORE OUT.json
"""

import json
import sys
import time

import edge0
from edge0.engine.drafters import PromptLookup
from edge0.engine.speculative import Speculator

store = sys.argv[1]
e = edge0.load(store, prerouter=False)
base = [
    e.encode(t)
    for t in [
        "The history of the printing press begins in the fifteenth century",
        "Within fifty years, presses were running in more than two hundred cities",
        "movable metal type made it possible to reproduce books quickly and cheaply",
        "the number of books in Europe grew into the millions",
    ]
]
out = {}
for b in (1, 4):
    prompts = []
    for p in base[:b]:  # the prompt, its own greedy continuation, the prompt again: prompt lookup finds it
        cont = e.generate(p, max_tokens=24, ignore_eos=True).tokens
        prompts.append(p + cont + p)
    for name, spec in [
        ("plain", None),
        ("ngram", Speculator(PromptLookup(3), 4, adaptive=False)),
        ("ngram-adaptive", Speculator(PromptLookup(3), 4, adaptive=True)),
    ]:
        e.use_speculation(spec)
        e.generate_batch(prompts[:1], max_tokens=2, ignore_eos=True)
        t0 = time.perf_counter()
        res = e.generate_batch(prompts, max_tokens=24, ignore_eos=True)
        st = res[0].stats["batch"]
        sp = e.stats()["batch_speculation"]
        row = {
            "decode_tps": st["generated_tokens"] / st["decode_s"],
            "steps": st["batch_steps"],
            "verifies": sp["verifies"] if sp else None,
            "acceptance": sp["acceptance"] if sp else None,
            "tokens": [r.tokens for r in res],
        }
        out[f"{name} B={b}"] = row
        print(name, b, round(row["decode_tps"], 2), row["steps"], row["verifies"], row["acceptance"], flush=True)
        e.use_speculation(None)
    same = all(out[f"{n} B={b}"]["tokens"] == out[f"plain B={b}"]["tokens"] for n in ("ngram", "ngram-adaptive"))
    print("same tokens", b, same)
json.dump(
    {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in out.items()}, open(sys.argv[2], "w"), indent=1
)
