"""Cost of the read-time expert checks (crc32 of each expert the first time a process reads it):
decode tok/s and time to first token with `check_experts` on and off, interleaved runs, each in a
fresh process (checks are per process), page cache warm, staged decode with 20% of the experts.

    python scripts/measure_expert_checks.py STORE [--repeats 5] [--out docs/benchmarks/expert-checks.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, sys, edge0
store, check = sys.argv[1], sys.argv[2] == "on"
e = edge0.load(store, prerouter=False, lora=False, check_experts=check, expert_cache=sys.argv[3])
ids = e.encode("The history of the printing press begins in the fifteenth century, when movable type " * 3)[:40]
s = e.generate(ids, max_tokens=32, ignore_eos=True).stats
io = e.stats()["io"]
print(json.dumps({"decode_tps": s["decode_tps"], "ttft_s": s["prompt_tokens"] / s["prefill_tps"],
                  "experts_checked": io["experts_checked"], "check_ms": io["check_ms"]}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store", type=Path)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--expert-cache", default=None, help="default: 20%% of the experts")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    m = json.loads((args.store / "edge0-manifest.json").read_text())
    experts = sum(m["files"][l["file"]]["size"] for l in m["expert_layers"])
    cache = args.expert_cache or str(int(0.2 * experts))
    for f in sorted(args.store.rglob("*.safetensors")):  # warm: the checks, not the disk, are measured
        f.read_bytes()
    runs = {"on": [], "off": []}
    for i in range(args.repeats):
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(args.store), mode, cache], capture_output=True, text=True, check=True
            )
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(mode, runs[mode][-1], file=sys.stderr, flush=True)
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    result = {
        "date": datetime.date.today().isoformat(),
        "store": str(args.store),
        "expert_cache_bytes": int(cache),
        "command": " ".join(sys.argv),
        "median": med,
        "runs": runs,
        "decode_cost": 1 - med["on"]["decode_tps"] / med["off"]["decode_tps"],
        "ttft_cost_s": med["on"]["ttft_s"] - med["off"]["ttft_s"],
    }
    print(json.dumps({k: result[k] for k in ("median", "decode_cost", "ttft_cost_s")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
