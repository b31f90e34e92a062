"""`edge0 bench`: Edge0 against resident mlx-lm, warm and cold storage, under a memory cap.

Every arm runs in its own process (clean peak memory), all arms in one run, with the same prompt,
the same number of greedy tokens and the same quantized weights. Results: a JSON file (date,
machine, git commit, package versions, command), a markdown table (printed; appended to
docs/benchmarks.md with --append-docs) and a PNG plot (needs matplotlib). See docs/bench-suite.md.

    edge0 bench                      the full suite on the bench model (built on first use)
    edge0 bench --quick              a smaller model and fewer tokens (a few minutes)
    edge0 bench --model DIR          a bench-model directory (mlx/ + store/) or an edge0 store
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from edge0.cli_util import run_main
from edge0.errors import Edge0Error

SCHEMA = "edge0-bench/1"
PKG_ROOT = Path(__file__).resolve().parents[1]
PREROUTER = "<prerouter>"  # placeholder in an arm's load options: the --prerouter path (or the store's)
LORA = "<lora>"  # placeholder: the --lora path (or the store's lora.safetensors)


@dataclass(frozen=True)
class Base:
    """One way of running the model. Edge0 bases get a warm and a cold arm each."""

    name: str
    runtime: str  # "edge0" or "mlx-lm"
    load: dict = field(default_factory=dict)
    needs_prerouter: bool = False
    needs_lora: bool = False
    storages: tuple = ("warm", "cold")  # edge0 arms to make from this base


# Adding an arm is one entry here.
BASES = (
    Base("mlx-lm", "mlx-lm"),
    Base("exact", "edge0", {"decode_executor": "exact", "prerouter": False, "lora": False}),
    Base("staged", "edge0", {"decode_executor": "staged", "prerouter": False, "lora": False}),
    Base("hot", "edge0", {"decode_executor": "hot", "prerouter": False, "lora": False}),
    Base("prerouter", "edge0", {"decode_executor": "staged", "prerouter": PREROUTER, "lora": False}, needs_prerouter=True),
    # the decode cost of the recovery LoRA: compare with prerouter-warm
    Base("prerouter-lora", "edge0", {"decode_executor": "staged", "prerouter": PREROUTER, "lora": LORA},
         needs_prerouter=True, needs_lora=True, storages=("warm",)),
)
CAPPED = ("mlx-lm", "staged")  # run under the memory cap


@dataclass(frozen=True)
class Arm:
    name: str
    base: Base
    storage: str  # "warm", "cold" or "capped"

    @property
    def runtime(self) -> str:
        return self.base.runtime


def all_arms() -> list[Arm]:
    arms = [Arm("mlx-lm-resident", BASES[0], "warm")]
    edge = [b for b in BASES if b.runtime == "edge0"]
    arms += [Arm(f"{b.name}-warm", b, "warm") for b in edge if "warm" in b.storages]
    arms += [Arm(f"{b.name}-cold", b, "cold") for b in edge if "cold" in b.storages]
    by_name = {b.name: b for b in BASES}
    arms += [Arm(f"{n}-capped", by_name[n], "capped") for n in CAPPED]
    return arms


# Per-arm numbers (positive and finite, or null where they do not apply).
METRICS = ("decode_tps", "prefill_tps", "ttft_s", "load_s", "wall_s", "mlx_peak_bytes", "mlx_decode_peak_bytes",
           "mlx_load_peak_bytes", "peak_rss_bytes", "resident_bytes", "expert_cache_bytes", "expert_bytes_read",
           "decode_expert_bytes_read", "hit_rate", "stall_ms_per_step", "host_syncs_per_step",
           "prompt_tokens", "generation_tokens")
COUNTERS = ("fallbacks", "dropped_experts")

SIZES = {  # preset -> (bench-model size, prompt tokens, decode tokens)
    "full": ("full", 40, 32),
    "quick": ("quick", 40, 32),
}


# ----------------------------------------------------------------------------- model

@dataclass
class Model:
    store: Path
    mlx: Path | None
    mlx_missing_reason: str = ""
    info: dict = field(default_factory=dict)


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text())


def resolve_model(args) -> Model:
    if args.store:
        store = Path(args.store).expanduser()
        mlx = Path(args.mlx_model).expanduser() if args.mlx_model else None
        return _check_model(store, mlx, {})
    if args.model:
        d = Path(args.model).expanduser()
    else:
        from edge0.models import cache_dir

        d = Path(os.environ.get("EDGE0_BENCH_DIR") or cache_dir() / "bench") / args.size
        if not d.exists():
            build_bench_model(d, args.size)
    if (d / "edge0-manifest.json").is_file():  # an edge0 store
        mlx = Path(args.mlx_model).expanduser() if args.mlx_model else None
        return _check_model(d, mlx, {})
    if not (d / "store").is_dir():
        raise Edge0Error(f"--model {d}: neither an edge0 store nor a bench-model directory (store/ + mlx/); "
                         "make one with: python scripts/make_bench_model.py DIR")
    info = _read_json(d / "bench-model.json") if (d / "bench-model.json").is_file() else {}
    mlx = Path(args.mlx_model).expanduser() if args.mlx_model else d / "mlx"
    return _check_model(d / "store", mlx, info)


def _check_model(store: Path, mlx: Path | None, info: dict) -> Model:
    if not (store / "edge0-manifest.json").is_file():
        raise Edge0Error(f"{store}: not an edge0 store (no edge0-manifest.json); pass --model DIR or --store DIR")
    m = Model(store, None, info=info)
    if mlx is None:
        src = _read_json(store / "edge0-manifest.json").get("source", {})
        if src.get("already_quantized") and Path(src.get("path", "")).is_dir():
            mlx = Path(src["path"])  # the store was converted from this mlx-lm checkpoint
    if mlx is None:
        m.mlx_missing_reason = ("no mlx-lm checkpoint with the same weights: pass --mlx-model DIR (the mlx-lm "
                                "quantized checkpoint the store was converted from)")
    elif not (mlx / "config.json").is_file() or "quantization" not in _read_json(mlx / "config.json"):
        raise Edge0Error(f"--mlx-model {mlx}: not an mlx-lm quantized checkpoint (config.json without "
                         "\"quantization\"); pass the directory the store was converted from")
    else:
        m.mlx = mlx
    return m


def build_bench_model(out: Path, size: str) -> None:
    script = PKG_ROOT / "scripts" / "make_bench_model.py"
    if not script.is_file():
        raise Edge0Error(f"no --model given and {script} is missing (it ships with a source checkout); "
                         "make a bench model there, or pass --model DIR")
    print(f"edge0 bench: building the {size} bench model into {out} (once)", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, str(script), str(out), "--size", size], env=_child_env())
    if r.returncode != 0:
        raise Edge0Error(f"building the bench model failed (exit {r.returncode}); run {script} {out} --size {size}")


def store_sizes(store: Path) -> dict:
    man = _read_json(store / "edge0-manifest.json")
    config = _read_json(store / "config.json")
    c = {**config, **config.get("text_config", {})}
    per_slot = sum(sum(t["expert_nbytes"] for t in l["tensors"].values()) for l in man["expert_layers"])
    experts = sum(sum(t["expert_nbytes"] for t in l["tensors"].values()) * int(l["num_experts"])
                  for l in man["expert_layers"])
    top_k = int((man.get("spec") or {}).get("top_k") or c.get("num_experts_per_tok") or 1)
    return {"store_bytes": sum(int(f["size"]) for f in man["files"].values()), "expert_bytes": experts,
            "slot_bytes_all_layers": per_slot, "top_k": top_k, "moe_layers": len(man["expert_layers"])}


def expert_budget(text: str, sizes: dict) -> int:
    """'20%' of all experts, or a size like '400MB'; at least two routes' worth of slots."""
    text = str(text).strip()
    if text.endswith("%"):
        try:
            frac = float(text[:-1]) / 100
        except ValueError:
            frac = -1
        if not 0 < frac <= 1:
            raise Edge0Error(f"--expert-cache {text}: a percentage must be in (0, 100]; e.g. 20%")
        budget = int(sizes["expert_bytes"] * frac)
    else:
        from edge0.streaming.pool import parse_size

        budget = parse_size(text)
    return max(budget, 2 * sizes["top_k"] * sizes["slot_bytes_all_layers"])


# ----------------------------------------------------------------------------- memory cgroup

class MemoryCgroup:
    """A cgroup v1 memory controller child of this process's own cgroup, with a hard limit."""

    def __init__(self, path: Path, limit: int):
        self.path, self.limit = path, limit

    @staticmethod
    def available() -> tuple[Path | None, str]:
        """(parent cgroup dir, "") if a child memory cgroup can be made here, else (None, reason)."""
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None, "no /proc/self/cgroup (not Linux): memory caps need cgroups"
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                parent = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
                if not (parent / "memory.limit_in_bytes").is_file():
                    return None, f"{parent}: no cgroup v1 memory controller mounted there"
                if not os.access(parent, os.W_OK):
                    return None, f"{parent}: not writable by this user (needs a delegated cgroup or root)"
                return parent, ""
        return None, "no cgroup v1 memory controller for this process (cgroup v2 needs a delegated subtree)"

    @classmethod
    def create(cls, parent: Path, limit: int) -> "MemoryCgroup":
        path = parent / f"edge0-bench-{os.getpid()}"
        path.mkdir()
        cg = cls(path, limit)
        try:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            try:  # no swap escape hatch (the file exists only with swap accounting)
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            except OSError:
                pass
        except OSError:
            cg.remove()
            raise
        return cg

    def enter(self) -> None:
        """Runs in the child between fork and exec: move itself into the cgroup."""
        with open(self.path / "cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

    def report(self) -> dict:
        def read(name):
            try:
                return (self.path / name).read_text()
            except OSError:
                return ""

        oom = dict(l.split() for l in read("memory.oom_control").splitlines() if len(l.split()) == 2)
        return {"limit_bytes": self.limit, "max_usage_bytes": int(read("memory.max_usage_in_bytes") or 0),
                "failcnt": int(read("memory.failcnt") or 0), "oom_kills": int(oom.get("oom_kill", 0))}

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        print(f"edge0 bench: could not remove cgroup {self.path}", file=sys.stderr)


# ----------------------------------------------------------------------------- running arms

def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PKG_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def prewarm(paths) -> None:
    """Read files once so they sit in the page cache (warm arms)."""
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.read(8 << 20):
                pass


def run_child(spec: dict, timeout: float, cgroup: MemoryCgroup | None = None) -> dict:
    from edge0.bench_arms import RESULT_PREFIX

    cmd = [sys.executable, "-m", "edge0.bench_arms", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_child_env(),
                           preexec_fn=cgroup.enter if cgroup else None)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [l for l in r.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    if r.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT_PREFIX):])
    if r.returncode < 0:
        sig = signal.Signals(-r.returncode).name
        return {"status": "killed", "reason": f"killed by {sig} after {wall:.1f} s", "signal": sig}
    tail = (r.stderr or r.stdout).strip().splitlines()[-12:]
    return {"status": "failed", "reason": f"exit {r.returncode}: " + " | ".join(tail)[-1500:]}


def arm_spec(arm: Arm, model: Model, args, budget: int, sizes: dict) -> dict:
    spec = {"name": arm.name, "runtime": arm.runtime, "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens, "dtype": args.dtype}
    if arm.runtime == "mlx-lm":
        spec["mlx_model"] = str(model.mlx)
        files = sorted(model.mlx.glob("*.safetensors"))
    else:
        load = {k: v for k, v in arm.base.load.items()}
        if load.get("prerouter") == PREROUTER:
            load["prerouter"] = args.prerouter  # None: the store's prerouter.safetensors
        if load.get("lora") == LORA:
            load["lora"] = args.lora  # None: the store's lora.safetensors
        load["expert_cache"] = budget
        load["dtype"] = args.dtype
        if arm.storage == "cold":
            load["cold_reads"] = True  # every expert read comes from storage, as with a model > RAM
        spec.update(store=str(model.store), load=load, prerouter_required=arm.base.needs_prerouter,
                    lora_required=arm.base.needs_lora)
        files = sorted(model.store.rglob("*.safetensors"))
    if arm.storage in ("cold", "capped"):
        spec["evict"] = [str(f) for f in files]
    else:
        spec["prewarm"] = [str(f) for f in files]
    return spec


def skip_reason(arm: Arm, model: Model, args, cgroup_parent) -> str:
    if arm.runtime == "mlx-lm" and model.mlx is None:
        return model.mlx_missing_reason
    if arm.base.needs_prerouter and args.prerouter is None and not (model.store / "prerouter.safetensors").is_file():
        return ("no pre-router heads for this model: the store has no prerouter.safetensors and --prerouter "
                "was not given (train some with edge0 train-prerouter)")
    if arm.base.needs_lora and args.lora is None and not (model.store / "lora.safetensors").is_file():
        return ("no recovery LoRA for this model: the store has no lora.safetensors and --lora was not given "
                "(train one with edge0 train-lora)")
    if arm.storage == "capped":
        if args.no_cap:
            return "--no-cap"
        if cgroup_parent is None:
            return args._cgroup_reason
    return ""


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
            raise Edge0Error(f"the baseline-memory probe failed ({base.get('reason')}); rerun with --no-cap to skip the cap arms")
        base_rss = base.get("peak_rss_bytes", 0)
        if args.cap:
            from edge0.streaming.pool import parse_size

            cap = parse_size(args.cap)
        else:
            cap = int(base_rss + args.cap_fraction * sizes["store_bytes"])
        cap_info = {"cap_bytes": cap, "baseline_rss_bytes": base_rss, "cap_fraction_of_store": args.cap_fraction,
                    "cgroup_parent": str(parent)}
    else:
        cap_info = {"cap_bytes": None, "skipped": "--no-cap" if args.no_cap else reason}

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
            if arm.storage == "capped":
                cg = MemoryCgroup.create(parent, cap)
            try:
                out = run_child(spec, args.arm_timeout, cg)
            finally:
                if cg is not None:
                    out_cg = cg.report()
                    cg.remove()
            if cg is not None:
                out["cgroup"] = out_cg
                if out.get("status") == "killed" and out_cg["oom_kills"]:
                    out["reason"] += " (the memory cgroup's OOM killer)"
            results[arm.name]["runs"].append(out)
            if out.get("status") == "skipped":
                results[arm.name].update(status="skipped", reason=out["reason"])
            print(f"edge0 bench: {label}: {_one_line(out)}", file=sys.stderr, flush=True)

    ref_tokens = next((r["tokens"] for r in results.get("mlx-lm-resident", {}).get("runs", []) if r.get("status") == "ok"), None)
    rows = []
    for arm in arms:
        res = results[arm.name]
        runs = res["runs"]
        ok = [r for r in runs if r.get("status") == "ok"]
        status = res.get("status") or ("ok" if ok else (runs[-1]["status"] if runs else "skipped"))
        row = {"name": arm.name, "runtime": arm.runtime, "executor": arm.base.name if arm.runtime == "edge0" else None,
               "storage": arm.storage, "status": status, "reason": res.get("reason") or
               (None if ok else (runs[-1].get("reason") if runs else None)),
               "load_options": {k: v for k, v in arm.base.load.items() if k != "prerouter" or v is not False},
               "metrics": median_metrics(runs) if ok else {k: None for k in METRICS},
               "counters": {k: max((r.get(k) or 0) for r in ok) if ok else None for k in COUNTERS},
               "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs]}
        if ok:
            row["describe"] = ok[0].get("describe")
            row["prompt_digest"] = ok[0].get("prompt_digest")
            row["tokens_match_resident"] = (ok[0]["tokens"] == ref_tokens) if ref_tokens is not None and arm.name != "mlx-lm-resident" else None
        if arm.storage == "capped" and runs:
            row["cgroup"] = runs[-1].get("cgroup")
        rows.append(row)
    return {"settings": {"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                         "expert_cache": args.expert_cache, "expert_cache_bytes": budget, "dtype": args.dtype or "auto",
                         "repeats": args.repeats, "greedy": True, "memory_cap": cap_info, **sizes},
            "arms": rows, "reference_tokens": ref_tokens}


def _one_line(out: dict) -> str:
    if out.get("status") != "ok":
        return f"{out.get('status')}: {out.get('reason')}"
    bits = [f"decode {out['decode_tps']:.2f} tok/s" if out.get("decode_tps") else "decode -",
            f"TTFT {out['ttft_s']:.1f} s", f"MLX peak {_gb(out.get('mlx_peak_bytes'))}",
            f"RSS {_gb(out.get('peak_rss_bytes'))}"]
    if out.get("stall_ms_per_step") is not None:
        bits.append(f"stall {out['stall_ms_per_step']:.0f} ms/step")
    return ", ".join(bits)


# ----------------------------------------------------------------------------- report

def _gb(n) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def summary(result: dict) -> dict:
    arms = {a["name"]: a for a in result["arms"]}

    def m(name, key):
        a = arms.get(name)
        return a["metrics"].get(key) if a and a["status"] == "ok" else None

    def ratio(a, b):
        return a / b if a is not None and b else None

    out = {
        "staged_warm_vs_resident_decode": ratio(m("staged-warm", "decode_tps"), m("mlx-lm-resident", "decode_tps")),
        "staged_warm_mlx_peak_vs_resident": ratio(m("staged-warm", "mlx_peak_bytes"), m("mlx-lm-resident", "mlx_peak_bytes")),
        "staged_warm_decode_peak_vs_resident": ratio(m("staged-warm", "mlx_decode_peak_bytes"), m("mlx-lm-resident", "mlx_decode_peak_bytes")),
        "prerouter_cold_vs_exact_cold_decode": ratio(m("prerouter-cold", "decode_tps"), m("exact-cold", "decode_tps")),
        "lora_warm_vs_prerouter_warm_decode": ratio(m("prerouter-lora-warm", "decode_tps"), m("prerouter-warm", "decode_tps")),
        "targets": {"decode_vs_resident": 0.9, "mlx_peak_vs_resident": 0.3, "lora_vs_no_lora": 0.95},
    }
    out["capped"] = {n[: -len("-capped")]: arms[n]["status"] for n in arms if n.endswith("-capped")}
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    ref = next((a for a in result["arms"] if a["name"] == "mlx-lm-resident" and a["status"] == "ok"), None)
    ref_tps = ref["metrics"]["decode_tps"] if ref else None
    lines = ["| arm | storage | decode tok/s | vs resident | prefill tok/s | TTFT s | MLX peak | MLX peak (decode) "
             "| peak RSS | expert bytes read | hit rate | stall ms/step | tokens = resident |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in result["arms"]:
        m = a["metrics"]
        if a["status"] != "ok":
            reason = str(a["reason"]).replace("|", "/").replace("\n", " ")
            lines.append(f"| {a['name']} | {a['storage']} | {a['status']}: {reason} |" + " |" * 10)
            continue
        vs = m["decode_tps"] / ref_tps if ref_tps and m["decode_tps"] else None
        match = a.get("tokens_match_resident")
        lines.append(
            f"| {a['name']} | {a['storage']} | {_f(m['decode_tps'])} | {_f(vs, '{:.2f}x')} | {_f(m['prefill_tps'])} "
            f"| {_f(m['ttft_s'], '{:.1f}')} | {_gb(m['mlx_peak_bytes'])} | {_gb(m['mlx_decode_peak_bytes'])} "
            f"| {_gb(m['peak_rss_bytes'])} | {_gb(m['expert_bytes_read'])} | {_f(m['hit_rate'], '{:.0%}')} "
            f"| {_f(m['stall_ms_per_step'], '{:.0f}')} | {'-' if match is None else ('yes' if match else 'no')} |")
    cap = s["memory_cap"]
    if cap.get("cap_bytes"):
        lines.append("")
        lines.append(f"Memory cap: {_gb(cap['cap_bytes'])} = baseline process RSS {_gb(cap['baseline_rss_bytes'])} "
                     f"(runtimes imported, tokenizer loaded, no weights) + {cap['cap_fraction_of_store']:.0%} of the "
                     f"{_gb(s['store_bytes'])} store; a cgroup v1 memory limit (page cache included, reclaimable).")
    else:
        lines.append("")
        lines.append(f"Memory-cap arms skipped: {cap.get('skipped')}.")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    arms = result["arms"]
    names = [a["name"] for a in arms]
    ok = [a["status"] == "ok" for a in arms]
    tps = [a["metrics"]["decode_tps"] or 0 if o else 0 for a, o in zip(arms, ok)]
    peak = [(a["metrics"]["mlx_peak_bytes"] or 0) / 1e9 if o else 0 for a, o in zip(arms, ok)]
    rss = [(a["metrics"]["peak_rss_bytes"] or 0) / 1e9 if o else 0 for a, o in zip(arms, ok)]
    colors = ["#777777" if a["runtime"] == "mlx-lm" else "#1f77b4" for a in arms]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.8 * len(arms)), 8), sharex=True)
    ax1.bar(range(len(arms)), tps, color=colors)
    ax1.set_ylabel("decode tok/s")
    for i, (a, o) in enumerate(zip(arms, ok)):
        if not o:
            ax1.text(i, 0, a["status"], rotation=90, ha="center", va="bottom", fontsize=8)
    dpeak = [(a["metrics"]["mlx_decode_peak_bytes"] or 0) / 1e9 if o else 0 for a, o in zip(arms, ok)]
    w = 0.27
    ax2.bar([i - w for i in range(len(arms))], peak, w, label="MLX allocator peak", color="#1f77b4")
    ax2.bar(range(len(arms)), dpeak, w, label="MLX peak during decode", color="#aec7e8")
    ax2.bar([i + w for i in range(len(arms))], rss, w, label="process peak RSS", color="#ff7f0e")
    cap = result["settings"]["memory_cap"].get("cap_bytes")
    if cap:
        ax2.axhline(cap / 1e9, color="red", linestyle="--", linewidth=1, label="memory cap")
    ax2.set_ylabel("GB")
    ax2.legend(fontsize=8)
    ax2.set_xticks(range(len(arms)))
    ax2.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    s = result["settings"]
    fig.suptitle(f"edge0 bench {result['date'][:10]}: {s['prompt_tokens']} prompt + {s['decode_tokens']} greedy tokens, "
                 f"expert cache {s['expert_cache']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def machine_info() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "node": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_bytes"] = int(line.split()[1]) * 1024
        info["loadavg_at_start"] = [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        pass
    return info


def package_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import edge0

    out = {"edge0": edge0.__version__}
    for name in ("mlx", "mlx-lm", "numpy", "transformers", "tokenizers", "matplotlib"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> dict:
    def git(*a):
        r = subprocess.run(["git", "-C", str(PKG_ROOT), *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None}


def append_docs(path: Path, result: dict, table: str, json_path: Path, png_path: Path | None) -> None:
    s, sm, mi = result["settings"], result["summary"], result["machine"]
    model = result["model"]
    shape = model.get("shape") or {}
    shape_txt = (f"hidden {shape['hidden']}, {shape['layers']} layers, {shape['experts']} experts top-{shape['top_k']}, "
                 f"moe_intermediate {shape['moe_intermediate']}, vocab {shape['vocab']}; " if shape else "")
    rel = lambda p: os.path.relpath(p, path.parent)  # noqa: E731
    lines = [
        "", f"## Bench suite ({result['date'][:10]}, {mi.get('cpus')}-core {mi.get('machine')}, "
        f"mlx {result['packages'].get('mlx')}, mlx-lm {result['packages'].get('mlx-lm')})", "",
        f"`{result['command']}` at commit {(result['git']['commit'] or '?')[:10]}: {shape_txt}"
        f"{_gb(s['store_bytes'])} store ({_gb(s['expert_bytes'])} of int4 experts, random weights: near-flat routing). "
        f"{s['prompt_tokens']} prompt tokens, {s['decode_tokens']} greedy tokens, expert cache {s['expert_cache']} of the experts "
        f"({_gb(s['expert_cache_bytes'])}), each arm in its own process. Raw numbers: [{json_path.name}]({rel(json_path)})"
        + (f", plot: [{png_path.name}]({rel(png_path)})." if png_path else "."), "", table, ""]
    r1, r2 = sm.get("staged_warm_vs_resident_decode"), sm.get("staged_warm_mlx_peak_vs_resident")
    if r1 is not None:
        lines.append(f"- Staged (warm) decodes at {r1:.2f}x mlx-lm resident (target 0.9x) with {r2:.0%} of its MLX "
                     f"allocator peak (target <= 30%).")
    for name, st in sm.get("capped", {}).items():
        lines.append(f"- Under the memory cap, {name}: {st}.")
    if sm.get("lora_warm_vs_prerouter_warm_decode") is not None:
        lines.append(f"- Recovery LoRA: decode at {sm['lora_warm_vs_prerouter_warm_decode']:.3f}x the same arm without it.")
    if sm.get("prerouter_cold_vs_exact_cold_decode") is not None:
        lines.append(f"- Cold storage: pre-router decodes at {sm['prerouter_cold_vs_exact_cold_decode']:.2f}x exact on-demand.")
    with open(path, "a") as fh:
        fh.write("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- CLI

def parse_args(argv):
    p = argparse.ArgumentParser(prog="edge0 bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[6:]))
    g = p.add_argument_group("model")
    g.add_argument("--model", help="bench-model directory (store/ + mlx/, from scripts/make_bench_model.py) or an "
                   "edge0 store (default: the bench model in the user cache, built on first use)")
    g.add_argument("--store", help="edge0 store (with --mlx-model; instead of --model)")
    g.add_argument("--mlx-model", help="mlx-lm quantized checkpoint with the store's weights (the resident arm)")
    g.add_argument("--quick", action="store_true", help="smaller bench model and fewer tokens (a few minutes)")
    g.add_argument("--prerouter", help="pre-router heads for the prerouter arms (default: the store's prerouter.safetensors)")
    g.add_argument("--lora", help="recovery LoRA for the prerouter-lora arm (default: the store's lora.safetensors)")
    g = p.add_argument_group("workload")
    g.add_argument("--prompt-tokens", type=int, help="prompt length (default 40)")
    g.add_argument("--decode-tokens", type=int, help="greedy tokens generated (default 32)")
    g.add_argument("--expert-cache", default="20%", help="edge0 expert cache: a share of all experts (20%%) or a size (400MB)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype of both runtimes (default: edge0's auto choice, float32 on CPU)")
    g.add_argument("--arms", help="comma-separated arm names or executor names (default: all); see docs/bench-suite.md")
    g.add_argument("--repeats", type=int, default=1, help="run the arm list this many times, report medians")
    g.add_argument("--arm-timeout", type=float, default=1800, help="seconds before an arm is stopped")
    g = p.add_argument_group("memory cap")
    g.add_argument("--cap-fraction", type=float, default=0.5,
                   help="cap = baseline process RSS + this share of the store (default 0.5)")
    g.add_argument("--cap", help="absolute cap instead, e.g. 1.5GB")
    g.add_argument("--no-cap", action="store_true", help="skip the memory-cap arms")
    g = p.add_argument_group("output")
    g.add_argument("--out", help="JSON file (default docs/benchmarks/bench.json, --quick: bench-quick.json); "
                   "the plot goes beside it as .png")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--append-docs", nargs="?", const="docs/benchmarks.md", default=None, metavar="FILE",
                   help="append the table as a new section (default file docs/benchmarks.md)")
    g.add_argument("--trace-arm", help="write per-step timings (compute, stall, reads) of this arm")
    g.add_argument("--trace-out", help="file for --trace-arm (JSON)")
    args = p.parse_args(argv)
    args.size = "quick" if args.quick else "full"
    _, prompt, decode = SIZES[args.size]
    args.prompt_tokens = args.prompt_tokens or prompt
    args.decode_tokens = args.decode_tokens or decode
    if args.prompt_tokens < 1:
        raise Edge0Error(f"--prompt-tokens {args.prompt_tokens}: must be >= 1")
    if args.decode_tokens < 2:
        raise Edge0Error(f"--decode-tokens {args.decode_tokens}: must be >= 2 (decode speed needs two tokens)")
    if args.repeats < 1:
        raise Edge0Error(f"--repeats {args.repeats}: must be >= 1")
    if not 0 < args.cap_fraction <= 4:
        raise Edge0Error(f"--cap-fraction {args.cap_fraction}: must be in (0, 4]; e.g. 0.5 for half the store")
    if bool(args.trace_arm) != bool(args.trace_out):
        raise Edge0Error("--trace-arm/--trace-out: give both (an arm name and an output file)")
    if args.store and args.model:
        raise Edge0Error("--store: use either --model or --store (with --mlx-model), not both")
    return args


def select_arms(spec: str | None) -> list[Arm]:
    arms = all_arms()
    if not spec:
        return arms
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    names = {a.name for a in arms} | {b.name for b in BASES}
    bad = [w for w in wanted if w not in names]
    if bad:
        raise Edge0Error(f"--arms {','.join(bad)}: unknown; choose from {', '.join(a.name for a in arms)} "
                         f"(or an executor name: {', '.join(b.name for b in BASES)})")
    return [a for a in arms if a.name in wanted or a.base.name in wanted]


def main(argv=None) -> int:
    args = parse_args(argv)
    arms = select_arms(args.arms)
    if args.trace_arm and args.trace_arm not in {a.name for a in arms}:
        raise Edge0Error(f"--trace-arm {args.trace_arm}: not among the arms run; choose one of {', '.join(a.name for a in arms)}")
    model = resolve_model(args)
    out = Path(args.out or f"docs/benchmarks/bench{'-quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now().astimezone()
    result = {"schema": SCHEMA, "date": started.isoformat(timespec="seconds"),
              "command": "edge0 bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
              "machine": machine_info(), "git": git_commit(), "packages": package_versions(),
              "model": {"store": str(model.store), "mlx_model": str(model.mlx) if model.mlx else None,
                        **{k: model.info.get(k) for k in ("shape", "seed", "size", "generator_version") if k in model.info}}}
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    # On SIGTERM unwind like Ctrl-C: stop the arm's process and remove the cgroup.
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        result.update(run_suite(args, model, arms))
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    end = git_commit()
    if end != result["git"]:  # the code changed under a long run: say so
        result["git_at_end"] = end
        print(f"edge0 bench: warning: the git tree changed during the run ({end})", file=sys.stderr)
    result["summary"] = summary(result)
    result["elapsed_s"] = (datetime.datetime.now().astimezone() - started).total_seconds()
    _check_numbers(result)
    out.write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    print(table)
    print(f"wrote {out}", file=sys.stderr)
    png = None
    if not args.no_plot:
        png = out.with_suffix(".png")
        msg = plot(result, png)
        if not png.exists():
            png = None
        print(msg, file=sys.stderr)
    if args.append_docs:
        append_docs(Path(args.append_docs), result, table, out, png)
        print(f"appended the table to {args.append_docs}", file=sys.stderr)
    return 0


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def _check_numbers(result: dict) -> None:
    """Refuse to write NaN/inf (json would write invalid tokens)."""
    for a in result["arms"]:
        for k, v in a["metrics"].items():
            if isinstance(v, float) and not math.isfinite(v):
                a["metrics"][k] = None


if __name__ == "__main__":
    run_main(main)
