"""The result: summary ratios, the markdown table, the plot, machine facts and the docs section."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from edge0.bench.env import PKG_ROOT

SCHEMA = "edge0-bench/1"


def _gb(n) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _rate(bytes_per_s) -> str:
    return f"{bytes_per_s / 1e6:g} MB/s"


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def table_head(columns: str) -> list[str]:
    """A markdown table's header row (`columns`: the names, between " | ") and the rule under it."""
    return [f"| {columns} |", "|---" * (columns.count("|") + 1) + "|"]


def summary(result: dict) -> dict:
    arms = {a["name"]: a for a in result["arms"]}

    def m(name, key):
        a = arms.get(name)
        return a["metrics"].get(key) if a and a["status"] == "ok" else None

    def ratio(a, b):
        return a / b if a is not None and b else None

    out = {
        "staged_warm_vs_resident_decode": ratio(m("staged-warm", "decode_tps"), m("mlx-lm-resident", "decode_tps")),
        "staged_warm_mlx_peak_vs_resident": ratio(
            m("staged-warm", "mlx_peak_bytes"), m("mlx-lm-resident", "mlx_peak_bytes")
        ),
        "staged_warm_decode_peak_vs_resident": ratio(
            m("staged-warm", "mlx_decode_peak_bytes"), m("mlx-lm-resident", "mlx_decode_peak_bytes")
        ),
        "prerouter_cold_vs_exact_cold_decode": ratio(m("prerouter-cold", "decode_tps"), m("exact-cold", "decode_tps")),
        "lora_warm_vs_prerouter_warm_decode": ratio(
            m("prerouter-lora-warm", "decode_tps"), m("prerouter-warm", "decode_tps")
        ),
        "staged_capped_vs_staged_cold_decode": ratio(m("staged-capped", "decode_tps"), m("staged-cold", "decode_tps")),
        "staged_capped_vs_staged_warm_decode": ratio(m("staged-capped", "decode_tps"), m("staged-warm", "decode_tps")),
        "prerouter_capped_vs_exact_capped_decode": ratio(
            m("prerouter-capped", "decode_tps"), m("exact-capped", "decode_tps")
        ),
        "staged_capped_vs_exact_capped_decode": ratio(
            m("staged-capped", "decode_tps"), m("exact-capped", "decode_tps")
        ),
        "prerouter_capped_stall_vs_exact_capped": ratio(
            m("prerouter-capped", "stall_ms_per_step"), m("exact-capped", "stall_ms_per_step")
        ),
        # the read share of exact's step: >= 0.5 is the regime the pre-router was designed for
        "exact_capped_stall_share": ratio(
            m("exact-capped", "stall_ms_per_step"),
            1000 / m("exact-capped", "decode_tps") if m("exact-capped", "decode_tps") else None,
        ),
        "targets": {
            "decode_vs_resident": 0.9,
            "mlx_peak_vs_resident": 0.3,
            "lora_vs_no_lora": 0.95,
            "staged_capped_vs_cold_and_warm": 0.8,
            "prerouter_capped_vs_exact_capped": 1.5,
            "prerouter_capped_stall_vs_exact_capped": 0.10,
            "exact_capped_stall_share": 0.5,
        },
    }
    out["capped"] = {n[: -len("-capped")]: arms[n]["status"] for n in arms if n.endswith("-capped")}
    out["decode_vs_resident_by_repeat"] = by_repeat(result)
    return out


def by_repeat(result: dict) -> dict[str, list]:
    """Each arm's decode tok/s over resident mlx-lm's in the same repeat, repeat by repeat (None where
    either run failed): {arm: [ratio, ...]}, {} without resident runs. The bench interleaves the arms,
    so the two runs of a repeat share the machine's state of the moment, which the medians of runs
    minutes apart do not (a VM that slows for a while moves one arm's median, not a pair's ratio)."""
    arms = {a["name"]: a for a in result["arms"]}
    ref = [
        r.get("decode_tps") if r.get("status") == "ok" else None
        for r in arms.get("mlx-lm-resident", {}).get("runs", [])
    ]
    if not any(ref):
        return {}
    out = {}
    for name, a in arms.items():
        if name == "mlx-lm-resident" or a["runtime"] != "edge0" or a["status"] != "ok":
            continue
        tps = [r.get("decode_tps") if r.get("status") == "ok" else None for r in a["runs"]]
        out[name] = [t / b if t and b else None for t, b in zip(tps, ref)]
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    ref = next((a for a in result["arms"] if a["name"] == "mlx-lm-resident" and a["status"] == "ok"), None)
    ref_tps = ref["metrics"]["decode_tps"] if ref else None
    lines = table_head(
        "arm | storage | decode tok/s | vs resident | prefill tok/s | TTFT s | MLX peak | MLX peak (decode) "
        "| peak RSS | expert bytes read | hit rate | stall ms/step | reads/step (reader) | tokens = resident"
    )
    rate = (s.get("read_limit") or {}).get("rate_bytes_per_s")
    for a in result["arms"]:
        m = a["metrics"]
        storage = f"{a['storage']}, {_rate(rate)}" if rate and a["storage"] == "capped" else a["storage"]
        if a["status"] != "ok":
            reason = str(a["reason"]).replace("|", "/").replace("\n", " ")
            lines.append(f"| {a['name']} | {storage} | {a['status']}: {reason} |" + " |" * 11)
            continue
        vs = m["decode_tps"] / ref_tps if ref_tps and m["decode_tps"] else None
        match = a.get("tokens_match_resident")
        lines.append(
            f"| {a['name']} | {storage} | {_f(m['decode_tps'])} | {_f(vs, '{:.2f}x')} | {_f(m['prefill_tps'])} "
            f"| {_f(m['ttft_s'], '{:.1f}')} | {_gb(m['mlx_peak_bytes'])} | {_gb(m['mlx_decode_peak_bytes'])} "
            f"| {_gb(m['peak_rss_bytes'])} | {_gb(m['expert_bytes_read'])} | {_f(m['hit_rate'], '{:.0%}')} "
            f"| {_f(m['stall_ms_per_step'], '{:.0f}')} | {_reads(a)} | "
            f"{'-' if match is None else ('yes' if match else 'no')} |"
        )
    if s.get("routing", "uniform") != "uniform":
        lines.append("")
        lines.append(
            f"Routing: {s['routing']}. Every Edge0 arm computes with synthetic routes fitted to published "
            "Qwen3-30B-A3B cache statistics (docs/synthetic-routing.md), not a real model's: reads, slot "
            "rewrites, stalls and compute are real, the choice of experts is not. Tokens are not compared "
            "with mlx-lm (the routes differ by design); the mlx-lm arms route with the model's own gates "
            "(every weight resident, so routing does not change what they read). The pre-router arms take "
            "the generated route of step t+1 as their prediction, one step ahead, as the pre-router does "
            "by construction."
        )
    lines += _repeat_lines(result)
    lines += _roofline_lines(result)
    cap = s["memory_cap"]
    if cap.get("cap_bytes"):
        lines.append("")
        lines.append(
            f"Memory cap: {_gb(cap['cap_bytes'])} = baseline process RSS {_gb(cap['baseline_rss_bytes'])} "
            f"(runtimes imported, tokenizer loaded, no weights) + {cap['cap_fraction_of_store']:.0%} of the "
            f"{_gb(s['store_bytes'])} store; a cgroup v1 memory limit (page cache included, reclaimable)."
        )
    else:
        lines.append("")
        lines.append(f"Memory-cap arms skipped: {cap.get('skipped')}.")
    if rate:
        rl, share = s["read_limit"], result.get("summary", {}).get("exact_capped_stall_share")
        lines.append("")
        lines.append(
            f"Read limit: {_rate(rate)} on the store's disk ({rl['device']}, a cgroup v{rl['cgroup_version']} "
            "block-I/O throttle) for every capped arm: storage slower than compute"
            + (f"; exact-capped stalls {share:.0%} of its step." if share is not None else ".")
        )
    return "\n".join(lines)


def _roofline_lines(result: dict) -> list[str]:
    """The roofline table (edge0/bench/roofline.py): one row per Edge0 arm that decoded."""
    rows = [a for a in result["arms"] if a.get("roofline")]
    if not rows:
        return []
    device, warm = result.get("device_read") or {}, result.get("page_cache_read") or {}
    out = [
        "",
        "Roofline: min(resident mlx-lm decode tok/s, read rate / expert bytes read per generated token); "
        f"the store's disk measured at {_f((device.get('bytes_per_s') or 0) / 1e6, '{:.0f}')} MB/s "
        f"({device.get('read_size')} B reads, {device.get('queue_depth')} at a time) for cold arms, "
        + (
            f"the same reads out of the page cache at {_f(warm['bytes_per_s'] / 1e6, '{:.0f}')} MB/s for warm arms, "
            if warm.get("bytes_per_s")
            else ""
        )
        + "--read-limit for capped arms.",
        "",
        *table_head(
            "arm | expert bytes / token | read rate achieved | read rate | roofline tok/s | bound | efficiency "
            "| lookahead recall | read ahead for nothing / token | computed early / step (unused)"
        ),
    ]
    for a in rows:
        r = a["roofline"]
        out.append(
            f"| {a['name']} | {_gb(r['bytes_per_token'])} | {_f(r['achieved_read_rate'] / 1e6, '{:.0f}')} MB/s "
            f"| {_f(r['read_rate'] and r['read_rate'] / 1e6, '{:.0f}')} MB/s | {_f(r['roofline_tps'])} "
            f"| {r['bound'] or '-'} | {_f(r['efficiency'])} | {_f(r['lookahead_recall'], '{:.0%}')} "
            f"| {_gb(r['wasted_per_token'])} | {_early(r)} |"
        )
    return out


def _early(r: dict) -> str:
    """Experts computed before their route a decode step, and of them unused (streaming/early.py)."""
    if r.get("early_per_step") is None:
        return "-"
    return f"{r['early_per_step']:.1f} ({r['early_unused_per_step']:.2f})"


def _reads(arm: dict) -> str:
    io = arm.get("io")
    n = arm["metrics"].get("expert_reads_per_step")
    return "-" if io is None or n is None else f"{n:.0f} ({io['reader']})"


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
    fig.suptitle(
        f"edge0 bench {result['date'][:10]}: {s['prompt_tokens']} prompt + {s['decode_tokens']} greedy tokens, "
        f"expert cache {s['expert_cache']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "node": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
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


def _repeat_lines(result: dict) -> list[str]:
    """With several repeats: each arm's decode against resident mlx-lm's of the same repeat."""
    pairs = {n: r for n, r in by_repeat(result).items() if len(r) > 1}
    if not pairs:
        return []
    text = "; ".join(f"{n} {', '.join(_f(x, '{:.2f}x') for x in r)}" for n, r in pairs.items())
    return ["", f"Decode against resident mlx-lm in the same repeat (the arms interleaved): {text}."]


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
    shape_txt = (
        f"hidden {shape['hidden']}, {shape['layers']} layers, {shape['experts']} experts top-{shape['top_k']}, "
        f"moe_intermediate {shape['moe_intermediate']}, vocab {shape['vocab']}; "
        if shape
        else ""
    )
    rel = lambda p: os.path.relpath(p, path.parent)  # noqa: E731
    lines = [
        "",
        f"## Bench suite ({result['date'][:10]}, {mi.get('cpus')}-core {mi.get('machine')}, "
        f"mlx {result['packages'].get('mlx')}, mlx-lm {result['packages'].get('mlx-lm')})",
        "",
        f"`{result['command']}` at commit {(result['git']['commit'] or '?')[:10]}: {shape_txt}"
        f"{_gb(s['store_bytes'])} store ({_gb(s['expert_bytes'])} of int4 experts, random weights: near-flat routing). "
        f"{s['prompt_tokens']} prompt tokens, {s['decode_tokens']} greedy tokens, expert cache {s['expert_cache']} "
        "of the experts "
        f"({_gb(s['expert_cache_bytes'])}), each arm in its own process. Raw numbers: "
        f"[{json_path.name}]({rel(json_path)})" + (f", plot: [{png_path.name}]({rel(png_path)})." if png_path else "."),
        "",
        table,
        "",
    ]
    r1, r2 = sm.get("staged_warm_vs_resident_decode"), sm.get("staged_warm_mlx_peak_vs_resident")
    if r1 is not None:
        lines.append(
            f"- Staged (warm) decodes at {r1:.2f}x mlx-lm resident (target 0.9x) with {r2:.0%} of its MLX "
            f"allocator peak (target <= 30%)."
        )
    for name, st in sm.get("capped", {}).items():
        lines.append(f"- Under the memory cap, {name}: {st}.")
    if sm.get("lora_warm_vs_prerouter_warm_decode") is not None:
        lines.append(
            f"- Recovery LoRA: decode at {sm['lora_warm_vs_prerouter_warm_decode']:.3f}x the same arm without it."
        )
    if sm.get("prerouter_capped_vs_exact_capped_decode") is not None:
        rate = (s.get("read_limit") or {}).get("rate_bytes_per_s")
        stall = sm.get("prerouter_capped_stall_vs_exact_capped")
        lines.append(
            f"- Under the memory cap{f' and a {_rate(rate)} read limit' if rate else ''}: pre-router decodes at "
            f"{sm['prerouter_capped_vs_exact_capped_decode']:.2f}x exact on-demand (target 1.5x)"
            + (f", stalling {stall:.0%} of exact's stall per step (target <= 10%)" if stall is not None else "")
            + (
                f"; staged at {sm['staged_capped_vs_exact_capped_decode']:.2f}x"
                if sm.get("staged_capped_vs_exact_capped_decode") is not None
                else ""
            )
            + "."
        )
    if sm.get("prerouter_cold_vs_exact_cold_decode") is not None:
        lines.append(
            f"- Cold storage: pre-router decodes at {sm['prerouter_cold_vs_exact_cold_decode']:.2f}x exact on-demand."
        )
    with open(path, "a") as fh:
        fh.write("\n".join(lines) + "\n")
