"""Expert-read microbenchmark: one decode step's expert reads (K random experts in every MoE layer,
fixed seed) through each read strategy (mmap / pread / direct), tensor-major (v1: one range per
tensor, 9 per expert) vs expert-major (v2: one range per expert) layer files, queue depth
1 / 4 / 16, three cache states:

- warm: every step's experts read once before timing (page cache hits);
- cold: the layer files evicted from the page cache (posix_fadvise DONTNEED) before each step;
- capped: a child process in a cgroup v1 memory limit (`--cap`, below the store's size) that
  first reads the whole store sequentially (the cache keeps what the limit allows; redone for
  each queue depth), then runs the steps with no eviction: a store that does not fit in memory.

Next to them, the disk's sequential read bandwidth measured the same way: cold (evicted) layer
files read in 8 MiB preads on one thread, buffered and O_DIRECT.

Usage:
    python scripts/io_bench.py --v1 STORE_V1 --v2 STORE_V2 [--k 8] [--steps 4] [--qd 1,4,16]
        [--modes warm,cold,capped] [--cap 512MiB] [--json OUT.json] [--md OUT.md]

STORE_V2 is STORE_V1 re-laid out: python -m edge0 relayout STORE_V1 STORE_V2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from edge0.backend.memory import available as memory_available  # noqa: E402
from edge0.store import ExpertStore, open_manifest  # noqa: E402
from edge0.store.readers import STRATEGIES, aligned_empty, choose_io  # noqa: E402

SEQ_CHUNK = 8 << 20


def layer_files(root: Path, manifest: dict) -> list[Path]:
    return [root / l["file"] for l in manifest["expert_layers"]]


def evict(files) -> None:
    """Drop the files' pages from the page cache (no root needed)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_mb_s(files, direct: bool) -> float:
    """MB/s of reading `files` front to back in 8 MiB preads on one thread, after evicting them."""
    evict(files)
    buf = aligned_empty(SEQ_CHUNK)
    view, total = memoryview(buf), 0
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            size, off = f.stat().st_size, 0
            while off < size:
                n = os.preadv(fd, [view], off)  # O_DIRECT: the last chunk may come back short
                if n == 0:
                    break
                off += n
            total += off
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t0) / 1e6


def routes(manifest: dict, k: int, steps: int, seed: int) -> list[dict[int, list[int]]]:
    """Per step, per MoE layer: K distinct experts, sorted as the exact executor's np.unique gives them."""
    rng = np.random.default_rng(seed)
    return [
        {
            int(l["layer"]): sorted(rng.choice(int(l["num_experts"]), size=k, replace=False).tolist())
            for l in manifest["expert_layers"]
        }
        for _ in range(steps)
    ]


def run_steps(store: ExpertStore, steps, files, cold: bool) -> dict:
    """Time each step's reads (layer after layer, as decode does); returns per-step figures."""
    for layer in store.layers:  # first-use costs (open, mmap, thread pool) are not read costs
        store.read(layer, [0])
    before = store.io_stats()
    times, payload = [], 0
    for route in steps:
        if cold:
            evict(files)
        t0 = time.perf_counter()
        for layer, ids in route.items():
            got = store.read(layer, ids)
            payload += sum(b.nbytes for b, _, _ in got.values())
        times.append(time.perf_counter() - t0)
    after = store.io_stats()
    n = len(steps)
    return {
        "ms_per_step": 1e3 * float(np.mean(times)),
        "ms_per_step_min": 1e3 * float(np.min(times)),
        "mb_per_s": payload / float(np.sum(times)) / 1e6,
        "payload_mb_per_step": payload / n / 1e6,
        "reads_per_step": (after["reads"] - before["reads"]) / n,
        "max_queue_depth": after["max_queue_depth"],
        "direct_fallbacks": after["direct_fallbacks"],
        "fallback_reasons": after["direct_fallback_reasons"],
    }


def cell(root: Path, io: str, qd: int, steps, mode: str) -> dict:
    manifest = open_manifest(root)
    files = layer_files(root, manifest)
    store = ExpertStore(root, manifest, io=io, queue_depth=qd)
    try:
        if mode == "warm":
            for route in steps:
                for layer, ids in route.items():
                    store.read(layer, ids)
        return run_steps(store, steps, files, cold=mode == "cold")
    finally:
        store.close()


def child(args: dict) -> dict:
    """Runs inside the memory cgroup: for each queue depth, evict the store and read it all once
    (the cache keeps what the limit allows), then time the steps."""
    root = Path(args["root"])
    files = layer_files(root, open_manifest(root))
    out = {"auto": choose_io(sum(f.stat().st_size for f in files))}
    for qd in args["qds"]:
        sequential_mb_s(files, direct=False)  # evicts first, then reads every layer file
        out[qd] = cell(root, args["io"], qd, args["steps"], "capped")
    return out


def capped(root: Path, io: str, qds, steps, cap: int) -> dict:
    from edge0.bench.cgroup import MemoryCgroup

    parent, why = MemoryCgroup.available()
    if parent is None:
        raise SystemExit(f"io_bench: cannot make a memory cgroup: {why}")
    evict(layer_files(root, open_manifest(root)))  # pages cached outside are charged elsewhere
    cg = MemoryCgroup.create(parent, cap)
    try:
        spec = json.dumps({"root": str(root), "io": io, "qds": qds, "steps": steps})
        r = subprocess.run(
            [sys.executable, __file__, "--child", spec],
            capture_output=True,
            text=True,
            preexec_fn=cg.enter,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        report = cg.report()
    finally:
        cg.remove()
    if r.returncode != 0:
        raise SystemExit(f"io_bench: capped child failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["cgroup"] = report
    return out


def table(result: dict) -> str:
    qds = result["meta"]["queue_depths"]
    seq = result["sequential_mb_s"]
    lines = [
        f"Sequential cold read of the layer files (8 MiB preads, 1 thread): buffered {seq['buffered']:.0f} MB/s, "
        f"O_DIRECT {seq['direct']:.0f} MB/s. One step = {result['meta']['k']} experts x "
        f"{result['meta']['layers']} layers = {result['meta']['payload_mb_per_step']:.1f} MB.",
        "",
        "| state | layout | reader | " + " | ".join(f"qd {q}: ms/step (MB/s)" for q in qds) + " | reads/step |",
        "|---|---|---|" + "---|" * len(qds) + "---|",
    ]
    for mode in result["meta"]["modes"]:
        for layout in ("v1", "v2"):
            for io in STRATEGIES:
                cells = [c for c in result["cells"] if (c["mode"], c["layout"], c["io"]) == (mode, layout, io)]
                if not cells:
                    continue
                by = {c["qd"]: c for c in cells}
                row = [f"{by[q]['ms_per_step']:.0f} ({by[q]['mb_per_s']:.0f})" if q in by else "" for q in qds]
                note = " (falls back to pread)" if any(c["direct_fallbacks"] for c in cells) else ""
                name = {"v1": "v1: 9 ranges/expert", "v2": "v2: 1 range/expert"}[layout]
                lines.append(
                    f"| {mode} | {name} | {io}{note} | " + " | ".join(row) + f" | {cells[0]['reads_per_step']:.0f} |"
                )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--v1", type=Path)
    p.add_argument("--v2", type=Path)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qd", default="1,4,16")
    p.add_argument("--modes", default="warm,cold,capped")
    p.add_argument("--cap", default="512MiB")
    p.add_argument("--json", type=Path)
    p.add_argument("--md", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        spec = json.loads(a.child)
        spec["steps"] = [{int(l): ids for l, ids in s.items()} for s in spec["steps"]]
        print(json.dumps(child(spec)))
        return
    from edge0.streaming.pool import parse_size

    qds, modes, cap = [int(q) for q in a.qd.split(",")], a.modes.split(","), parse_size(a.cap)
    m1 = open_manifest(a.v1)
    steps = routes(m1, a.k, a.steps, a.seed)
    os.sync()  # freshly written files have dirty pages that DONTNEED cannot drop
    files = layer_files(a.v2, open_manifest(a.v2))
    seq = {"buffered": sequential_mb_s(files, direct=False), "direct": sequential_mb_s(files, direct=True)}
    print(f"sequential: {seq}", file=sys.stderr, flush=True)
    cells, extra = [], {}
    for mode in modes:
        for layout, root in (("v1", a.v1), ("v2", a.v2)):
            for io in STRATEGIES:
                if mode == "capped":
                    got = capped(root, io, qds, steps, cap)
                    extra[f"{layout}/{io}"] = {"auto": got.pop("auto"), "cgroup": got.pop("cgroup")}
                    res = {int(q): r for q, r in got.items()}
                else:
                    res = {qd: cell(root, io, qd, steps, mode) for qd in qds}
                for qd, r in res.items():
                    cells.append({"mode": mode, "layout": layout, "io": io, "qd": qd, **r})
                    print(
                        f"{mode:6} {layout} {io:6} qd {qd:2}: {r['ms_per_step']:7.1f} ms/step "
                        f"{r['mb_per_s']:7.0f} MB/s, {r['reads_per_step']:.0f} reads, max qd {r['max_queue_depth']}",
                        file=sys.stderr,
                        flush=True,
                    )
    manifest_bytes = sum(f.stat().st_size for f in files)
    result = {
        "meta": {
            "date": datetime.date.today().isoformat(),
            "machine": f"shared 2-core VM ({platform.machine()}, Linux {platform.release()}, {os.cpu_count()} CPUs)",
            "command": " ".join(["python", "scripts/io_bench.py", *sys.argv[1:]]),
            "store_v1": str(a.v1),
            "store_v2": str(a.v2),
            "expert_bytes": manifest_bytes,
            "k": a.k,
            "layers": len(m1["expert_layers"]),
            "steps": a.steps,
            "seed": a.seed,
            "queue_depths": qds,
            "modes": modes,
            "cap_bytes": cap,
            "payload_mb_per_step": cells[0]["payload_mb_per_step"] if cells else 0.0,
            "auto_here": choose_io(manifest_bytes),
            "memory_available": memory_available(),
        },
        "sequential_mb_s": seq,
        "cells": cells,
        "capped": extra,
    }
    md = table(result)
    print(md)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    if a.md:
        a.md.write_text(md + "\n")


if __name__ == "__main__":
    main()
