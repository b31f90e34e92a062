"""`edge0 bench --prompt-lengths`: time to first token against prompt length (docs/long-prompts.md).

For each prompt length, the suite's arms run with that prompt and two generated tokens: mlx-lm
resident, Edge0 warm (the CLI's prefill and the server's cancellable one), Edge0 under the memory
cap, and, with --read-limit, Edge0 under the cap with reads limited too. Each row reports prefill
tok/s, TTFT, the prefill's expert reads as a multiple of the store's experts, its stall and the
peak memory."""

from __future__ import annotations

import copy

from edge0.bench.arms import BASES, Arm
from edge0.bench.report import _f, _gb, table_head
from edge0.bench.runner import run_suite

CURVE_ARMS = (
    Arm("mlx-lm-resident", BASES[0], "warm"),
    Arm("staged-warm", BASES[2], "warm"),
    Arm("staged-warm-server", BASES[2], "warm", cancellable=True),  # should_stop given, as the server does
    Arm("staged-capped", BASES[2], "capped"),
)
CURVE_DECODE_TOKENS = 2


def run_curve(args, model, lengths: list[int]) -> dict:
    """One suite per prompt length (and one more for the capped arm under --read-limit)."""
    points = []
    for n in lengths:
        a = copy.copy(args)
        a.prompt_tokens, a.decode_tokens, a.repeats = n, CURVE_DECODE_TOKENS, args.repeats
        a.read_limit, a.trace_arm = None, None
        runs = [run_suite(a, model, list(CURVE_ARMS))]
        if args.read_limit is not None:
            a.read_limit = args.read_limit
            limited = run_suite(a, model, [CURVE_ARMS[-1]])
            for row in limited["arms"]:
                row["name"] += "+read-limit"
            runs.append(limited)
        points.append(
            {
                "prompt_tokens": n,
                "settings": runs[0]["settings"],
                "arms": [row for r in runs for row in r["arms"]],
            }
        )
    return {"prompt_curve": points, "settings": {**points[0]["settings"], "read_limit_bytes_per_s": args.read_limit}}


def curve_markdown(result: dict) -> str:
    """The TTFT-against-prompt-length table."""
    lines = table_head(
        "prompt tokens | arm | prefill tok/s | vs resident | TTFT s | expert reads / store | prefill stall s "
        "| MLX peak | peak RSS"
    )
    for p in result["prompt_curve"]:
        experts = p["settings"]["expert_bytes"]
        ref = next((a for a in p["arms"] if a["name"] == "mlx-lm-resident" and a["status"] == "ok"), None)
        ref_tps = ref["metrics"]["prefill_tps"] if ref else None
        for a in p["arms"]:
            m = a["metrics"]
            if a["status"] != "ok":
                lines.append(f"| {p['prompt_tokens']} | {a['name']} | {a['status']}: {a['reason']} |" + " |" * 6)
                continue
            read = m.get("prefill_expert_bytes_read")
            stall = m.get("prefill_stall_ms")
            vs = m["prefill_tps"] / ref_tps if ref_tps and m["prefill_tps"] else None
            lines.append(
                f"| {p['prompt_tokens']} | {a['name']} | {_f(m['prefill_tps'])} | {_f(vs, '{:.2f}x')} "
                f"| {_f(m['ttft_s'], '{:.1f}')} | {_f(read / experts if read is not None else None, '{:.2f}x')} "
                f"| {_f(stall / 1000 if stall is not None else None, '{:.1f}')} | {_gb(m['mlx_peak_bytes'])} "
                f"| {_gb(m['peak_rss_bytes'])} |"
            )
    rate = result["settings"].get("read_limit_bytes_per_s")
    if rate:
        lines.append("")
        lines.append(
            f"`+read-limit`: the capped arm with reads from the store's disk limited to {rate / 1e6:.0f} MB/s."
        )
    return "\n".join(lines)
