"""Two ranks against one process: decode speed, stall, hit rate and memory per rank, side by side in
one run.

Arms, each in its own process(es), one after the other:
  1 process, expert cache = FRACTION of all experts
  1 process, expert cache = 2 x FRACTION
  2 ranks (ring backend, 127.0.0.1), each caching FRACTION of its own layers' experts (the same
     total memory as the first arm)
  2 ranks, each with the first arm's budget, i.e. 2 x FRACTION of its own layers' experts (two
     machines of that size pooling their memory)
The layer split is the default (balanced by bytes); every rank gets the same --expert-cache, so the
budgets are fractions of each rank's experts when the split is even (checked in the output).
The ranks are started as mlx.launch starts them (MLX_HOSTFILE, MLX_RANK) but without mlx.launch
itself, whose output-forwarding loop busy-polls (about 1.4 cores here, see docs/distributed.md).
Unless --warm, the store is evicted from the page cache before each arm and every expert read is
dropped from it again (`cold_reads`): each miss comes from storage, as on a machine whose memory
cannot hold the model. A warm-up generation fills the caches; the numbers are the next one's.
With --repeat R the four arms run R times, in turn, and each arm's run with the median speed is
reported (every run is in the JSON), since other jobs on a shared machine come and go.

Usage: python scripts/bench_distributed.py --model STORE [--fraction 0.2] [--tokens 32] [--warmup 8]
       [--repeat 1] [--warm] [--out docs/benchmarks/distributed.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys
from pathlib import Path
import edge0
store, budget, cold = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "cold"
warmup, n = int(sys.argv[4]), int(sys.argv[5])
e = edge0.load(store, expert_cache=budget, cold_reads=cold, prerouter=False, lora=False)
if e.follower:
    e.follow()
    sys.exit(0)
e.generate("The history of the city begins with", max_tokens=warmup, ignore_eos=True)
before = e.stats()
r = e.generate("In the morning the workers went to", max_tokens=n, ignore_eos=True)
after = e.stats()
e.close()


def single(s, peak):
    t = s["totals"]
    return {"rank": 0, "stage": "all layers", "resident_bytes": s["resident_bytes"],
            "expert_bytes": e.streaming.total_expert_bytes, "expert_cache_bytes": s["expert_cache_bytes"],
            "peak_memory_bytes": peak, "peak_rss_bytes": s["peak_rss_bytes"], "hits": t["hits"], "misses": t["misses"],
            "stall_ms": t["stall_ms"], "expert_bytes_read": t["bytes_read"], "decode_steps": s["decode_steps"],
            "send_ms": 0.0, "wait_ms": 0.0, "step_compute_ms": 0.0, "cpu_s": sum(os.times()[:2])}


ranks_before = before.get("ranks") or [single(before, 0)]
ranks_after = after.get("ranks") or [single(after, r.stats["peak_memory_bytes"])]
rows = []
for b, a in zip(ranks_before, ranks_after):
    d = {k: a[k] - b[k] for k in ("hits", "misses", "stall_ms", "expert_bytes_read", "decode_steps", "send_ms",
                                  "wait_ms", "step_compute_ms")}
    rows.append({"rank": a["rank"], "stage": a["stage"], "resident_bytes": a["resident_bytes"],
                 "expert_bytes": a["expert_bytes"], "expert_cache_bytes": a["expert_cache_bytes"],
                 "budget_fraction": a["expert_cache_bytes"] / a["expert_bytes"],
                 "peak_memory_bytes": a["peak_memory_bytes"], "peak_rss_bytes": a["peak_rss_bytes"],
                 "hit_rate": d["hits"] / max(1, d["hits"] + d["misses"]),
                 "stall_ms_per_step": d["stall_ms"] / max(1, d["decode_steps"]),
                 "expert_mib_read": d["expert_bytes_read"] / 2**20, "send_ms_per_step": d["send_ms"] / n,
                 "wait_ms_per_step": d["wait_ms"] / n,
                 "compute_ms_per_step": d["step_compute_ms"] / max(1, d["decode_steps"]),
                 "cpu_s_total": a["cpu_s"]})
print(json.dumps({"decode_tps": r.stats["decode_tps"], "ranks": rows, "load_average": os.getloadavg()}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def evict(store: Path) -> None:
    for f in store.rglob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def run_arm(store: Path, ranks: int, budget: int, cold: bool, warmup: int, tokens: int) -> dict:
    child = [sys.executable, "-c", CHILD, str(store), str(budget), "cold" if cold else "warm", str(warmup), str(tokens)]
    if cold:
        evict(store)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        if ranks > 1:
            hostfile = Path(tmp) / "hosts.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
            env["MLX_HOSTFILE"] = str(hostfile)
        procs = [
            subprocess.Popen(
                child,
                env={**env, "MLX_RANK": str(r)} if ranks > 1 else env,
                cwd=ROOT,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for r in range(ranks)
        ]
        outs = [p.communicate() for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"arm with {ranks} rank(s) failed:\n" + "\n".join(err[-3000:] for _, err in outs))
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--fraction", type=float, default=0.2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1, help="runs of every arm, in turn (the median is reported)")
    p.add_argument("--warm", action="store_true", help="leave the store in the page cache (default: cold reads)")
    p.add_argument("--out", default="docs/benchmarks/distributed.json")
    args = p.parse_args()
    manifest = json.loads((args.model / "edge0-manifest.json").read_text())
    total = sum(
        sum(t["expert_nbytes"] for t in l["tensors"].values()) * int(l["num_experts"])
        for l in manifest["expert_layers"]
    )
    f = args.fraction
    arms = [
        (f"1 process, {f:.0%} of all experts", 1, int(f * total)),
        (f"1 process, {2 * f:.0%} of all experts", 1, int(2 * f * total)),
        (f"2 ranks, each {f:.0%} of its layers' experts", 2, int(f * total / 2)),
        (f"2 ranks, each {2 * f:.0%} of its layers' experts (= the {f:.0%} process's budget)", 2, int(f * total)),
    ]
    runs: dict[str, list] = {name: [] for name, _, _ in arms}
    for i in range(args.repeat):
        for name, ranks, budget in arms:
            r = run_arm(args.model, ranks, budget, not args.warm, args.warmup, args.tokens)
            runs[name].append(r)
            print(
                f"[{i + 1}/{args.repeat}] {name}: {r['decode_tps']:.2f} tok/s (load average "
                f"{r['load_average'][0]:.1f})",
                flush=True,
            )
    rows = {name: sorted(rs, key=lambda r: r["decode_tps"])[len(rs) // 2] for name, rs in runs.items()}
    for name, r in rows.items():
        print(f"{name}: median {r['decode_tps']:.2f} tok/s")
        for k in r["ranks"]:
            print(
                f"  rank {k['rank']} ({k['stage']}): cache {k['expert_cache_bytes'] / 2**20:.0f} MiB "
                f"({k['budget_fraction']:.0%} of {k['expert_bytes'] / 2**20:.0f} MiB), hit {k['hit_rate']:.0%}, "
                f"stall {k['stall_ms_per_step']:.0f} ms/step, read {k['expert_mib_read']:.0f} MiB, "
                f"send {k['send_ms_per_step']:.2f} ms/step, wait {k['wait_ms_per_step']:.0f} ms/step, "
                f"compute {k['compute_ms_per_step']:.0f} ms/step, "
                f"resident {k['resident_bytes'] / 2**20:.0f} MiB, MLX peak {k['peak_memory_bytes'] / 2**20:.0f} MiB, "
                f"RSS peak {k['peak_rss_bytes'] / 2**20:.0f} MiB, CPU {k['cpu_s_total']:.0f} s",
                flush=True,
            )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(sys.argv),
        "model": str(args.model),
        "cold_reads": not args.warm,
        "tokens": args.tokens,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "expert_bytes_total": total,
        "median": rows,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
