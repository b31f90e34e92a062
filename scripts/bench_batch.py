"""Batched decoding against the same requests one after another (issue 34, docs/benchmarks.md
"Batched decoding"): for each batch size B, B different prompts generate N tokens each, first
one after another (`generate`), then together (`generate_batch`), in one process.

Per B: aggregate decode tok/s of both and their ratio, the cost of a B-row step against a
1-token step in the same run (their ratio is B / that cost), expert bytes read per generated
token, and the batch's union of experts per routed (token, expert) pair. `--expert-cache` sizes the expert
cache (a fraction of the routed experts); `--cap` and `--read-limit` run the measurement in a
memory cgroup and a disk read limit (as `edge0 bench`'s capped arms), so misses come from disk.

    python scripts/bench_batch.py /work/bench-quick --batch 1,2,4,8 --tokens 24 --out out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RESULT = "BENCH_BATCH_RESULT "


def measure(args) -> dict:
    import edge0
    from edge0.bench.child import PROMPT_TEXT
    from edge0.bench.model import store_sizes

    experts = store_sizes(args.model / "store")["expert_bytes"]
    cache = int(args.expert_cache * experts) if args.expert_cache is not None else None
    engine = edge0.load(args.model / "store", prerouter=False, expert_cache=cache)
    words = PROMPT_TEXT.split()
    # B different prompts of the same length: the text rotated by a few words each
    prompts = [
        engine.encode(" ".join(words[3 * i :] + words[: 3 * i]))[: args.prompt_tokens] for i in range(max(args.batch))
    ]
    engine.generate(prompts[0], max_tokens=2, ignore_eos=True)  # first-call costs out of the way
    rows = []
    for b in args.batch:
        serial_s = serial_bytes = 0.0
        serial_tokens = []
        for p in prompts[:b]:
            r = engine.generate(p, max_tokens=args.tokens, ignore_eos=True)
            s = r.stats
            serial_s += (s["generation_tokens"] - 1) / s["decode_tps"]
            serial_bytes += s["expert_bytes_read"] - s["prefill_expert_bytes_read"]
            serial_tokens.append(r.tokens)
        t0 = time.perf_counter()
        res = engine.generate_batch(prompts[:b], max_tokens=args.tokens, ignore_eos=True)
        wall = time.perf_counter() - t0
        st = res[0].stats["batch"]
        step_s = st["decode_s"] / st["batch_steps"]
        plain_step_s = serial_s / (b * (args.tokens - 1))
        cost = step_s / plain_step_s
        generated = b * args.tokens
        rows.append(
            {
                "batch": b,
                "serial_decode_tps": b * (args.tokens - 1) / serial_s,
                "batch_decode_tps": generated / st["decode_s"],
                "speedup": (generated / st["decode_s"]) / (b * (args.tokens - 1) / serial_s),
                "step_cost": cost,
                "serial_bytes_per_token": serial_bytes / generated,
                "batch_bytes_per_token": (st["expert_bytes_read"] - st["prefill_expert_bytes_read"]) / generated,
                "union_per_routed": st["union_per_routed"],
                "tokens_identical": [r.tokens for r in res] == serial_tokens,
                "batch_wall_s": wall,
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"expert_cache_bytes": engine.stats()["expert_cache_bytes"], "expert_bytes": experts, "rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="bench-model directory (scripts/make_bench_model.py)")
    ap.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--expert-cache", type=float, help="the expert cache as a fraction of the routed experts")
    ap.add_argument("--cap", type=int, help="memory cgroup limit in bytes (the page cache cannot hold the store)")
    ap.add_argument("--read-limit", type=int, help="disk read limit in bytes/s (needs --cap)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child or args.cap is None:
        out = measure(args)
        if args.child:
            print(RESULT + json.dumps(out), flush=True)
            return
    else:
        from edge0.bench.cgroup import MemoryCgroup, enter_all, read_limited
        from edge0.store.pagecache import evict

        parent, why = MemoryCgroup.available()
        if parent is None:
            sys.exit(f"bench_batch: --cap: {why}")
        evict(sorted((args.model / "store").rglob("*.safetensors")))
        cg = MemoryCgroup.create(parent, args.cap)
        try:
            with read_limited(args.model / "store", args.read_limit) as lim:
                cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child"]
                r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=enter_all(cg, lim))
                device = lim.bytes_read() if lim is not None else None
        finally:
            report = cg.report()
            cg.remove()
        lines = [l for l in r.stdout.splitlines() if l.startswith(RESULT)]
        if r.returncode != 0 or not lines:
            sys.exit(f"bench_batch: the measurement exited {r.returncode} (cgroup: {report})")
        out = {**json.loads(lines[-1][len(RESULT) :]), "cgroup": report, "device_bytes_read": device}
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python scripts/bench_batch.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **out,
    }
    text = json.dumps(out, indent=1)
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)
    print(text)


if __name__ == "__main__":
    main()
