"""Running the arms: each in its own child process, repeated, with medians of the metrics."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from edge0.bench.arms import COUNTERS, METRICS, Arm, arm_spec, resolved_load, skip_reason
from edge0.bench.cgroup import MemoryCgroup, enter_all, read_limited
from edge0.bench.env import _child_env
from edge0.bench.model import Model, expert_budget, store_sizes
from edge0.bench.report import _gb
from edge0.errors import Edge0Error
from edge0.units import parse_size


def prewarm(paths) -> None:
    """Read files once so they sit in the page cache (warm arms)."""
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.read(8 << 20):
                pass


def run_child(spec: dict, timeout: float, *cgroups, module: str = "edge0.bench.child") -> dict:
    """Run one arm's process (`python -m module SPEC`), moved into `cgroups` (memory cap, read
    limit; None entries skipped)."""
    from edge0.bench.child import RESULT_PREFIX

    cmd = [sys.executable, "-m", module, json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_child_env(),
            preexec_fn=enter_all(*cgroups),
        )
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [l for l in r.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    if r.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT_PREFIX) :])
    # a child that reports as it goes (--concurrency) keeps what it measured before it died
    partial = {"partial": json.loads(lines[-1][len(RESULT_PREFIX) :])} if lines else {}
    if r.returncode < 0:
        sig = signal.Signals(-r.returncode).name
        return {"status": "killed", "reason": f"killed by {sig} after {wall:.1f} s", "signal": sig, **partial}
    tail = (r.stderr or r.stdout).strip().splitlines()[-12:]
    return {"status": "failed", "reason": f"exit {r.returncode}: " + " | ".join(tail)[-1500:], **partial}


def median_metrics(runs: list[dict]) -> dict:
    ok = [r for r in runs if r.get("status") == "ok"]
    out = {}
    for k in METRICS:
        vals = [r[k] for r in ok if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        out[k] = statistics.median(vals) if vals else None
    return out


def run_suite(args, model: Model, arms: list[Arm]) -> dict:
    sizes = store_sizes(model.store)
    budget = expert_budget(args.expert_cache, sizes)
    parent, reason = MemoryCgroup.available()
    args._cgroup_reason = reason
    cap = None
    if any(a.storage == "capped" for a in arms) and parent is not None and not args.no_cap:
        base = run_child({"runtime": "baseline", "store": str(model.store)}, args.arm_timeout)
        if base.get("status") != "ok":
            raise Edge0Error(
                f"the baseline-memory probe failed ({base.get('reason')}); rerun with --no-cap to skip the cap arms"
            )
        base_rss = base.get("peak_rss_bytes", 0)
        if args.cap:
            cap = parse_size(args.cap, "--cap")
        else:
            cap = int(base_rss + args.cap_fraction * sizes["store_bytes"])
        cap_info = {
            "cap_bytes": cap,
            "baseline_rss_bytes": base_rss,
            "cap_fraction_of_store": args.cap_fraction,
            "cgroup_parent": str(parent),
        }
    else:
        why = (
            "--no-cap"
            if args.no_cap
            else ("--arms selected none" if not any(a.storage == "capped" for a in arms) else reason)
        )
        cap_info = {"cap_bytes": None, "skipped": why}

    results = {a.name: {"runs": []} for a in arms}
    for rep in range(args.repeats):
        for arm in arms:
            why = skip_reason(arm, model, args, parent)
            if why:
                results[arm.name].update(status="skipped", reason=why)
                continue
            spec = arm_spec(arm, model, args, budget, sizes)
            if args.trace_arm == arm.name and rep == 0:
                spec["trace_out"] = str(Path(args.trace_out).resolve())
            prewarm(spec.pop("prewarm", []))
            label = f"[{rep + 1}/{args.repeats}] {arm.name}"
            print(f"edge0 bench: {label} ...", file=sys.stderr, flush=True)
            cg = None
            capped = arm.storage == "capped"
            if capped:
                cg = MemoryCgroup.create(parent, cap)
            try:
                with read_limited(model.store, args.read_limit if capped else None) as lim:
                    out = run_child(spec, args.arm_timeout, cg, lim)
                    device_read = lim.bytes_read() if lim is not None else None
            finally:
                if cg is not None:
                    out_cg = cg.report()
                    cg.remove()
            if cg is not None:
                out["cgroup"] = out_cg
                if out.get("status") == "killed" and out_cg["oom_kills"]:
                    out["reason"] += " (the memory cgroup's OOM killer)"
            if device_read is not None:  # everything the arm read from the limited disk
                out["read_limit"] = {"rate_bytes_per_s": args.read_limit, "device_bytes_read": device_read}
            results[arm.name]["runs"].append(out)
            if out.get("status") == "skipped":
                results[arm.name].update(status="skipped", reason=out["reason"])
            print(f"edge0 bench: {label}: {_one_line(out)}", file=sys.stderr, flush=True)

    # synthetic routes differ from the gates by design: tokens are compared only with the model's own routing
    ref_tokens = (
        None
        if args.routing != "uniform"
        else next(
            (r["tokens"] for r in results.get("mlx-lm-resident", {}).get("runs", []) if r.get("status") == "ok"), None
        )
    )
    rows = []
    for arm in arms:
        res = results[arm.name]
        runs = res["runs"]
        ok = [r for r in runs if r.get("status") == "ok"]
        status = res.get("status") or ("ok" if ok else (runs[-1]["status"] if runs else "skipped"))
        row = {
            "name": arm.name,
            "runtime": arm.runtime,
            "executor": arm.base.name if arm.runtime == "edge0" else None,
            "storage": arm.storage,
            "status": status,
            "reason": res.get("reason") or (None if ok else (runs[-1].get("reason") if runs else None)),
            "load_options": {k: v for k, v in resolved_load(arm, args).items() if k != "prerouter" or v is not False},
            "metrics": median_metrics(runs) if ok else {k: None for k in METRICS},
            "counters": {k: max((r.get(k) or 0) for r in ok) if ok else None for k in COUNTERS},
            "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
        }
        if ok:
            row["describe"] = ok[0].get("describe")
            row["io"] = ok[0].get("io")
            row["prompt_digest"] = ok[0].get("prompt_digest")
            row["tokens_match_resident"] = (
                (ok[0]["tokens"] == ref_tokens) if ref_tokens is not None and arm.name != "mlx-lm-resident" else None
            )
        if arm.storage == "capped" and runs:
            row["cgroup"] = runs[-1].get("cgroup")
            row["read_limit"] = runs[-1].get("read_limit")
        rows.append(row)
    return {
        "settings": {
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "expert_cache": args.expert_cache,
            "expert_cache_bytes": budget,
            "dtype": args.dtype or "auto",
            "repeats": args.repeats,
            "greedy": True,
            "memory_cap": cap_info,
            "read_limit": read_limit_info(args, model),
            "routing": args.routing,
            **sizes,
        },
        "arms": rows,
        "reference_tokens": ref_tokens,
    }


def read_limit_info(args, model: Model) -> dict:
    """What --read-limit set, for the JSON: the rate, the disk and which arms ran inside it."""
    if args.read_limit is None:
        return {"rate_bytes_per_s": None}
    from edge0.bench.cgroup import ReadLimit, block_device, stripe_dirs

    devices = sorted({block_device(d) for d in stripe_dirs(model.store)})
    return {
        "rate_bytes_per_s": args.read_limit,
        "device": ", ".join(f"{major}:{minor}" for major, minor in devices),
        # each disk of a striped store has the limit: the store reads at their sum
        "store_rate_bytes_per_s": args.read_limit * len(devices),
        "cgroup_version": ReadLimit.parent()[1],
        "arms": "capped",
    }


def _one_line(out: dict) -> str:
    if out.get("status") != "ok":
        return f"{out.get('status')}: {out.get('reason')}"
    bits = [
        f"decode {out['decode_tps']:.2f} tok/s" if out.get("decode_tps") else "decode -",
        f"TTFT {out['ttft_s']:.1f} s",
        f"MLX peak {_gb(out.get('mlx_peak_bytes'))}",
        f"RSS {_gb(out.get('peak_rss_bytes'))}",
    ]
    if out.get("stall_ms_per_step") is not None:
        bits.append(f"stall {out['stall_ms_per_step']:.0f} ms/step")
    return ", ".join(bits)
