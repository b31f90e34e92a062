"""Where a decode step's time goes, one after another and batched: per step, the wall time, the
time blocked on expert reads and the rest (compute, host work), and the expert bytes read a step.
Gate-routed qwen3-like routes, a 20% expert cache, B prompts of 64 tokens, 16 tokens each, in a
280 MB memory cgroup (the page cache emptied first) with the store's reads throttled to RATE
(a cgroup, as `edge0 bench --read-limit`). Needs the cgroup rights the bench needs.

    python scripts/step_time_split.py BENCH_MODEL_DIR [B] [--rate 20MB/s]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path


def child(model: str, b: int, n: int) -> None:
    import edge0
    from edge0.bench.child import prompts_for
    from edge0.bench.model import expert_budget, store_sizes
    from edge0.bench.routing import use_synthetic_routing

    store = Path(model) / "store"
    engine = edge0.load(store, prerouter=False, lora=False, expert_cache=expert_budget("20%", store_sizes(store)))
    routes = use_synthetic_routing(engine, seed=0, lookahead=False)
    prompts = prompts_for(engine.encode, b, 64)
    engine.generate(prompts[0], max_tokens=4, ignore_eos=True)
    acc = defaultdict(lambda: [0, 0.0, 0.0, 0])  # steps, wall s, stall s, bytes

    def timed(name, step):
        def run(*a, **kw):
            s0, t0 = engine.stats()["totals"], time.perf_counter()
            out = step(*a, **kw)
            s1, got = engine.stats()["totals"], acc[name]
            got[0] += 1
            got[1] += time.perf_counter() - t0
            got[2] += (s1["stall_ms"] - s0["stall_ms"]) / 1000
            got[3] += s1["bytes_read"] - s0["bytes_read"]
            return out

        return run

    engine.stepper.decode = timed("one after another", engine.stepper.decode)
    engine.stepper.decode_batch = timed(f"batch of {b}", engine.stepper.decode_batch)
    for i, p in enumerate(prompts):
        routes.first_text = i  # generation i routes as row i of the batch does
        engine.generate(p, max_tokens=n, ignore_eos=True)
    routes.first_text = 0
    engine.generate_batch(prompts, max_tokens=n, ignore_eos=True)
    for name, (steps, wall, stall, nbytes) in acc.items():
        print(
            f"{name}: {steps} steps, {1000 * wall / steps:.1f} ms a step: blocked on reads {1000 * stall / steps:.1f}, "
            f"the rest {1000 * (wall - stall) / steps:.1f}; {nbytes / steps / 1e6:.2f} MB a step, "
            f"{nbytes / wall / 1e6:.1f} MB/s of step time"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("batch", nargs="?", type=int, default=4)
    ap.add_argument("--rate", default="20MB/s")
    args = ap.parse_args()
    from edge0.bench.cgroup import MemoryCgroup, enter_all, read_limited
    from edge0.bench.env import _child_env
    from edge0.store.pagecache import evict
    from edge0.units import parse_rate

    store = Path(args.model) / "store"
    evict(sorted(store.rglob("*.safetensors")))
    parent, reason = MemoryCgroup.available()
    if parent is None:
        print(f"step_time_split: no memory cgroup: {reason}", file=sys.stderr)
        return 2
    cg = MemoryCgroup.create(parent, 280_000_000)
    try:
        with read_limited(store, parse_rate(args.rate, "--rate")) as lim:
            cmd = [sys.executable, __file__, "--child", args.model, str(args.batch)]
            return subprocess.run(cmd, env=_child_env(), preexec_fn=enter_all(cg, lim)).returncode
    finally:
        cg.remove()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), 16)
        sys.exit(0)
    sys.exit(main())
