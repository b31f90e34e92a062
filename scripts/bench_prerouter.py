"""Cold-storage decode benchmark: pre-router (staged, predicted routes read ahead) against exact
on-demand reads and against staged gate routing, side by side in one run.

Every arm runs in its own process; the store's files are evicted from the page cache before it
(posix_fadvise DONTNEED) and each expert read is dropped from the page cache again after it is
copied (`cold_reads`), so every miss really comes from storage, as on a machine whose RAM cannot
hold the model. The expert cache is a fraction of all experts.

Usage: python scripts/bench_prerouter.py --model STORE --heads HEADS [--budget-fraction 0.25]
       [--tokens 64] [--prompt "..."] [--out docs/benchmarks/prerouter-cold.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json, os, sys
from pathlib import Path
import edge0
store, arm, heads, prompt = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[6]
fraction, n = float(sys.argv[4]), int(sys.argv[5])
for f in Path(store).rglob("*.safetensors"):
    fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
probe = edge0.load(store, prerouter=False, decode_executor="exact")
total = probe.streaming.total_expert_bytes
one_slot = sum(probe.store.expert_nbytes(l) for l in probe.store.layers)
budget = max(int(total * fraction), one_slot * probe.spec.top_k * 2)
opts = {"exact": dict(decode_executor="exact", prerouter=False),
        "staged-gate": dict(decode_executor="staged", prerouter=False, expert_cache=budget),
        "prerouter": dict(decode_executor="staged", prerouter=heads, expert_cache=budget)}[arm]
e = edge0.load(store, cold_reads=True, prefill_executor="exact", lora=False, **opts)
r = e.generate(prompt, max_tokens=n, ignore_eos=True)
s = r.stats
step_ms = 1000 / s["decode_tps"]
print(json.dumps({"decode_tps": s["decode_tps"], "stall_ms_per_step": s["stall_ms_per_step"],
                  "stall_fraction": s["stall_ms_per_step"] / step_ms, "expert_bytes_read": s["expert_bytes_read"],
                  "hit_rate": s["expert_hit_rate"], "host_syncs": s["host_syncs"], "dropped": s["dropped_experts"],
                  "budget_bytes": budget if arm != "exact" else 0, "expert_bytes_total": total}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--heads", required=True)
    p.add_argument("--budget-fraction", type=float, default=0.25)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", default="The Python tutorial explains how to")
    p.add_argument("--out", default="docs/benchmarks/prerouter-cold.json")
    args = p.parse_args()
    rows = {}
    for arm in ("exact", "staged-gate", "prerouter"):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                PROBE,
                args.model,
                arm,
                args.heads,
                str(args.budget_fraction),
                str(args.tokens),
                args.prompt,
            ],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise SystemExit(f"arm {arm} failed:\n{out.stderr[-2000:]}")
        rows[arm] = json.loads(out.stdout.strip().splitlines()[-1])
        r = rows[arm]
        print(
            f"{arm:12s} {r['decode_tps']:7.1f} tok/s  stall {r['stall_ms_per_step']:6.2f} ms/step "
            f"({100 * r['stall_fraction']:4.1f}% of step)  read {r['expert_bytes_read'] / 2**20:7.1f} MiB",
            flush=True,
        )
    speedup = rows["prerouter"]["decode_tps"] / rows["exact"]["decode_tps"]
    print(f"pre-router vs exact on-demand: {speedup:.2f}x")
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.node()}, 2 cores",
        "command": " ".join(sys.argv),
        "model": args.model,
        "heads": args.heads,
        "budget_fraction": args.budget_fraction,
        "tokens": args.tokens,
        "rows": rows,
        "prerouter_vs_exact": speedup,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
