"""Prompt lookup (`--draft ngram`) on copy-heavy prompts with the bundled demo model (edge0
generate's default model): acceptance, tokens per verify and decode speed against plain decoding,
with the pre-router heads (the default) and without, in one process.

Usage: flock /tmp/edge0-cpu.lock python scripts/bench_prompt_lookup.py [--tokens 96] [--repeats 3]
       [--read-limit 20MB --expert-cache 25%] [--out docs/benchmarks/prompt-lookup-demo.json]

`--read-limit RATE` runs the measuring process in a block-I/O cgroup limiting reads from the
store's disk to RATE bytes/s (edge0.bench.cgroup.ReadLimit), with direct I/O and an expert cache
of `--expert-cache` of all experts: the regime where the pre-router's read-ahead matters.
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

PASSAGE = (
    "The with statement is used to wrap the execution of a block with methods defined by a context "
    "manager. This allows common try, except and finally usage patterns to be encapsulated for convenient "
    "reuse. The context expression is evaluated to obtain a context manager, and the manager's enter "
    "method is invoked before the block runs."
)
PROMPTS = {
    # the passage twice and the start of a third copy: the model continues by copying
    "continue-a-copy": ("raw", f"{PASSAGE}\n\n{PASSAGE}\n\n{PASSAGE[:60]}"),
    # a passage and the instruction to repeat it, through the chat template
    "repeat-instruction": ("chat", f"Repeat the following text exactly.\n\n{PASSAGE}"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-draft", default="4,8")
    p.add_argument("--read-limit", default=None, metavar="RATE")
    p.add_argument("--expert-cache", default="25%")
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.read_limit and not args.child:
        from edge0.bench.cgroup import ReadLimit
        from edge0.store.bundled import resolve_model
        from edge0.units import parse_size

        limit = ReadLimit.create(resolve_model(None), parse_size(args.read_limit))
        try:
            r = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child"], preexec_fn=limit.enter)
        finally:
            limit.remove()
        sys.exit(r.returncode)
    measure(args)


def measure(args) -> None:
    import edge0
    from edge0.engine.drafters import PromptLookup
    from edge0.engine.speculative import Speculator

    out = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.machine(),
        "read_limit": args.read_limit,
        "expert_cache": args.expert_cache if args.read_limit else "default",
        "prompts": {},
    }
    opts = {}
    if args.read_limit:
        total = edge0.load(None, decode_executor="exact").streaming.total_expert_bytes
        opts = {"io": "direct", "expert_cache": int(total * float(args.expert_cache.rstrip("%")) / 100)}
    for heads in (True, False):
        engine = edge0.load(None, prerouter=None if heads else False, **opts)
        out.setdefault("describe", {})["heads" if heads else "gate"] = engine.describe()
        for name, (kind, text) in PROMPTS.items():
            ids = engine.chat_prompt([{"role": "user", "content": text}]) if kind == "chat" else engine.encode(text)
            arms = {"plain": None}
            for k in (int(x) for x in args.num_draft.split(",")):
                arms[f"ngram k={k}"] = ("forced", k)
                arms[f"ngram k={k} adaptive"] = ("adaptive", k)
            kept = {a: Speculator(PromptLookup(), v[1], v[0] == "adaptive") for a, v in arms.items() if v}
            runs = {a: [] for a in arms}
            for _ in range(args.repeats):
                for arm in arms:
                    engine.use_speculation(kept.get(arm))
                    r = engine.generate(ids, max_tokens=args.tokens, ignore_eos=True)
                    runs[arm].append((r.tokens, r.stats))
            want = runs["plain"][0][0]
            rows = {}
            for arm, rs in runs.items():
                tps = [s["decode_tps"] for _, s in rs]
                plain = [s["decode_tps"] for _, s in runs["plain"]]
                sp = [s.get("speculation") or {} for _, s in rs]
                rows[arm] = {
                    "decode_tps": statistics.median(tps),
                    "speedup": statistics.median(t / q for t, q in zip(tps, plain)),
                    "identical": all(t == want for t, _ in rs),
                    "acceptance": statistics.median(x["acceptance"] or 0 for x in sp) if sp[0] else None,
                    "tokens_per_verify": statistics.median(x["tokens_per_verify"] or 0 for x in sp) if sp[0] else None,
                    "verifies": statistics.median(x["verifies"] for x in sp) if sp[0] else None,
                    "plain_steps": statistics.median(x["plain_steps"] for x in sp) if sp[0] else None,
                    "verify_cost_ratio": sp[-1].get("verify_cost_ratio"),
                }
                print(f"{'heads' if heads else 'gate'} {name} {arm}: {json.dumps(rows[arm])}", flush=True)
            out["prompts"][f"{name} ({'heads' if heads else 'gate'})"] = {
                "prompt_tokens": len(ids),
                "text": engine.tokenizer.decode(want)[:400],
                "arms": rows,
            }
        engine.close()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
