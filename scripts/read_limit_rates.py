"""How fast the bench's read limit (a cgroup block-I/O throttle) serves reads, by pattern, and
where a batch's decode time goes under it (docs/benchmarks.md, "Several sequences at once").

    python scripts/read_limit_rates.py patterns STORE RATE [paced]    # MB/s inside reads, per pattern
    python scripts/read_limit_rates.py decode STORE CAP RATE B [paced]  # qwen3-like, B one after another, then batched

`patterns` reads the store's expert files (page cache emptied first) inside a read-limited cgroup:
back to back and with pauses between reads, buffered and O_DIRECT. `decode` runs B 16-token
generations one after another and then as one batch (qwen3-like routes, 64-token prompts, the
expert cache at 20%) under a memory cap and the read limit, and reports for each decode (the
prefills left out): bytes the process read from storage (/proc/self/io), seconds inside expert
reads (the executors' stall) and wall seconds. Needs root (cgroups). With `paced`, reads go
through edge0's paced disk (store/pacing.py, `--pace-reads`) instead of the cgroup throttle."""

import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

RESULT = "READ-LIMIT-RESULT "


def patterns(files: list[str], pace: int | None) -> dict:
    from edge0.store.pacing import StoragePacer
    from edge0.store.pagecache import evict

    out = {}
    for chunk in (131072, 524288, 2097152):
        for direct in (False, True):
            for pause in (0.0, 0.03):
                evict(files)
                fds = [os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for f in files]
                size = os.fstat(fds[0]).st_size
                buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
                done = inside = 0.0
                i = 0
                pacer = StoragePacer(pace) if pace else None
                while done < 12e6 and (i // len(fds) + 1) * chunk <= size:
                    t0 = time.perf_counter()
                    fd, at = fds[i % len(fds)], (i // len(fds)) * chunk
                    if pacer is None:
                        os.preadv(fd, [buf], at)
                    else:
                        pacer.read(lambda: os.preadv(fd, [buf], at), chunk)
                    done += chunk
                    inside += time.perf_counter() - t0
                    i += 1
                    time.sleep(pause)
                for fd in fds:
                    os.close(fd)
                name = f"{chunk // 1024} KB {'direct' if direct else 'buffered'}, pause {pause * 1000:.0f} ms"
                out[name] = round(done / inside / 1e6, 2)
    return out


def decode(store: str, b: int, pace: int | None) -> dict:
    import edge0
    from edge0.bench.child import prompts_for
    from edge0.bench.env import storage_bytes_read
    from edge0.bench.model import expert_budget, store_sizes
    from edge0.bench.routing import use_synthetic_routing
    from edge0.store.pagecache import evict

    evict([str(f) for f in Path(store).rglob("*.safetensors")])
    budget = expert_budget("20%", store_sizes(Path(store)))
    e = edge0.load(store, prerouter=False, lora=False, expert_cache=budget, pace_reads=pace)
    routes = use_synthetic_routing(e, seed=0)
    real = e.prefiller
    mark = {}

    class Marked:  # the state at the end of each prefill: what follows is decode
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *a, **kw):
            fed = real(*a, **kw)
            mark.update(disk=storage_bytes_read(), stall=e.streaming.stats.totals()["stall_ms"], t=time.perf_counter())
            return fed

    e.prefiller = Marked()

    def since_prefill() -> dict:
        return {
            "storage_mb": (storage_bytes_read() - mark["disk"]) / 1e6,
            "in_reads_s": (e.streaming.stats.totals()["stall_ms"] - mark["stall"]) / 1000,
            "wall_s": time.perf_counter() - mark["t"],
        }

    prompts = prompts_for(e.encode, b, 64)
    alone = []
    for i, p in enumerate(prompts):
        routes.first_text = i
        e.generate(p, max_tokens=16, ignore_eos=True)
        alone.append(since_prefill())
    routes.first_text = 0
    e.generate_batch(prompts, max_tokens=16, ignore_eos=True)
    out = {"one_after_another": alone, "batched": since_prefill()}
    for d in alone + [out["batched"]]:
        d["mb_per_s_in_reads"] = d["storage_mb"] / d["in_reads_s"]
    return out


def main() -> int:
    mode, store = sys.argv[1], sys.argv[2]
    if mode.startswith("child-"):
        pace = json.loads(sys.argv[4])
        arg = sys.argv[3]
        res = patterns(json.loads(arg), pace) if mode == "child-patterns" else decode(store, int(arg), pace)
        print(RESULT + json.dumps(res), flush=True)
        return 0
    from edge0.bench.cgroup import MemoryCgroup, enter_all, read_limited
    from edge0.units import parse_size

    files = sorted(str(f) for f in (Path(store) / "experts").glob("*.safetensors"))
    if mode == "patterns":
        rate, cap, arg = parse_size(sys.argv[3] if len(sys.argv) > 3 else "20MB"), None, json.dumps(files)
    else:
        cap, rate, arg = parse_size(sys.argv[3]), parse_size(sys.argv[4]), sys.argv[5]
    paced = sys.argv[-1] == "paced"
    parent, reason = MemoryCgroup.available()
    cg = MemoryCgroup.create(parent, cap) if cap else None
    try:
        with read_limited(Path(store), None if paced else rate) as lim:
            r = subprocess.run(
                [sys.executable, __file__, "child-" + mode, store, arg, json.dumps(rate if paced else None)],
                capture_output=True,
                text=True,
                preexec_fn=enter_all(lim, cg),
            )
    finally:
        if cg is not None:
            cg.remove()
    lines = [l for l in r.stdout.splitlines() if l.startswith(RESULT)]
    if not lines:
        print(r.stderr[-3000:], file=sys.stderr)
        return 1
    how = {"paced_bytes_per_s" if paced else "rate_bytes_per_s": rate, "cap_bytes": cap}
    print(json.dumps({**how, **json.loads(lines[-1][len(RESULT) :])}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
