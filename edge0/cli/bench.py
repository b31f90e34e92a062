"""`edge0 bench` command line: parse the options, run the suite, write the JSON, table and plot."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import signal
import sys
from pathlib import Path

from edge0.bench.arms import SIZES, select_arms
from edge0.bench.cgroup import read_limit_refusal
from edge0.bench.concurrency import concurrency_markdown, parse_batches, run_concurrency
from edge0.bench.curve import CURVE_ARMS, curve_markdown, run_curve
from edge0.bench.model import resolve_model
from edge0.bench.report import SCHEMA, append_docs, git_commit, machine_info, markdown, package_versions, plot, summary
from edge0.bench.roofline import add_rooflines, measure_read_rate
from edge0.bench.runner import run_suite
from edge0.cli.common import OneLineParser, add_routing_option
from edge0.errors import Edge0Error
from edge0.units import parse_rate

USAGE = """`edge0 bench`: Edge0 against resident mlx-lm, warm and cold storage, under a memory cap.

Every arm runs in its own process (clean peak memory), all arms in one run, with the same prompt,
the same number of greedy tokens and the same quantized weights. Results: a JSON file (date,
machine, git commit, package versions, command), a markdown table (printed; appended to
docs/benchmarks.md with --append-docs) and a PNG plot (needs matplotlib). See docs/bench-suite.md.

    edge0 bench                      the full suite on the bench model (built on first use)
    edge0 bench --quick              a smaller model and fewer tokens (a few minutes)
    edge0 bench --model DIR          a bench-model directory (mlx/ + store/) or an edge0 store
"""


def parse_args(argv):
    p = OneLineParser(
        prog="edge0 bench",
        description=USAGE.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(USAGE.splitlines()[6:]),
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        help="bench-model directory (store/ + mlx/, from scripts/make_bench_model.py) or an "
        "edge0 store (default: the bench model in the user cache, built on first use)",
    )
    g.add_argument("--store", help="edge0 store (with --mlx-model; instead of --model)")
    g.add_argument("--mlx-model", help="mlx-lm quantized checkpoint with the store's weights (the resident arm)")
    g.add_argument("--quick", action="store_true", help="smaller bench model and fewer tokens (a few minutes)")
    g.add_argument(
        "--prerouter", help="pre-router heads for the prerouter arms (default: the store's prerouter.safetensors)"
    )
    g.add_argument(
        "--lora", help="recovery LoRA for the prerouter-lora arm (default: the store's adapter for the serving K)"
    )
    g = p.add_argument_group("workload")
    g.add_argument("--prompt-tokens", type=int, help="prompt length (default 40)")
    g.add_argument("--decode-tokens", type=int, help="greedy tokens generated (default 32)")
    g.add_argument(
        "--prompt-lengths",
        metavar="N,N,...",
        help="time to first token against prompt length instead of the arm table: for each length, "
        "mlx-lm resident, staged warm (as the CLI and as the server call it) and staged capped (and with "
        "--read-limit, capped with reads limited), two tokens each (docs/long-prompts.md)",
    )
    g.add_argument(
        "--concurrency",
        metavar="B,B,...",
        help="several sequences at once instead of the arm table: for each B, B prompts decoded together "
        "against one after another (warm, capped, and capped with --read-limit), then edge0 serve against "
        "mlx_lm.server at that many concurrent streams (docs/bench-suite.md#concurrency)",
    )
    g.add_argument("--no-servers", action="store_true", help="--concurrency: skip the servers' side-by-side run")
    g.add_argument(
        "--read-ahead",
        action="store_true",
        help="--concurrency with --routing qwen3-like: stage each step's routes one step ahead, as the pre-router "
        "does (one after another and batched alike)",
    )
    g.add_argument(
        "--long-prompt",
        type=int,
        metavar="N",
        help="--concurrency: also send a short request during an N-token prefill, to both servers",
    )
    g.add_argument(
        "--edge0-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="--concurrency: an extra `edge0 serve` flag, e.g. --edge0-arg=--prefill-span=512 (repeatable)",
    )
    add_routing_option(g, "uniform", "the bench model's own gates, which route nearly uniformly (the worst case)")
    g.add_argument(
        "--expert-cache", default="20%", help="edge0 expert cache: a share of all experts (20%%) or a size (400MB)"
    )
    g.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype of both runtimes (default: edge0's auto choice, float32 on CPU)",
    )
    g.add_argument("--arms", help="comma-separated arm names or executor names (default: all); see docs/bench-suite.md")
    g.add_argument("--repeats", type=int, default=1, help="run the arm list this many times, report medians")
    g.add_argument("--arm-timeout", type=float, default=1800, help="seconds before an arm is stopped")
    g = p.add_argument_group("memory cap")
    g.add_argument(
        "--cap-fraction",
        type=float,
        default=0.5,
        help="cap = baseline process RSS + this share of the store (default 0.5)",
    )
    g.add_argument("--cap", help="absolute cap instead, e.g. 1.5GB")
    g.add_argument("--no-cap", action="store_true", help="skip the memory-cap arms")
    g.add_argument(
        "--read-limit",
        metavar="RATE",
        help="run the capped arms in a block-I/O cgroup that limits reads from the store's disk to RATE "
        "(e.g. 200MB/s): storage slower than compute, as on the machines Edge0 is for (cgroup v1 blkio "
        "or v2 io; root or a delegated cgroup)",
    )
    g.add_argument(
        "--pace-reads",
        metavar="RATE",
        help="--concurrency: also a capped setting whose expert reads arrive as from a disk of RATE (e.g. "
        "20MB/s; edge0's --pace-reads): the cgroup throttle of --read-limit lets reads after a pause pass "
        "faster than its rate, a disk does not (docs/bench-suite.md#concurrency)",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        help="JSON file (default docs/benchmarks/bench.json, --quick: bench-quick.json); "
        "the plot goes beside it as .png",
    )
    g.add_argument("--no-plot", action="store_true")
    g.add_argument(
        "--append-docs",
        nargs="?",
        const="docs/benchmarks.md",
        default=None,
        metavar="FILE",
        help="append the table as a new section (default file docs/benchmarks.md)",
    )
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
    args.read_limit = parse_rate(args.read_limit) if args.read_limit is not None else None
    args.pace_reads = parse_rate(args.pace_reads, "--pace-reads") if args.pace_reads is not None else None
    args.prompt_lengths = parse_lengths(args.prompt_lengths) if args.prompt_lengths is not None else None
    if args.prompt_lengths and (args.arms or args.trace_arm):
        raise Edge0Error("--prompt-lengths runs its own arms; drop --arms and --trace-arm")
    args.concurrency = parse_batches(args.concurrency) if args.concurrency is not None else None
    if args.concurrency and (args.arms or args.trace_arm or args.prompt_lengths):
        raise Edge0Error("--concurrency runs its own settings; drop --arms, --trace-arm and --prompt-lengths")
    if not args.concurrency and (
        args.no_servers or args.long_prompt or args.edge0_arg or args.read_ahead or args.pace_reads
    ):
        raise Edge0Error(
            "--no-servers, --long-prompt, --edge0-arg, --read-ahead and --pace-reads go with --concurrency"
        )
    if args.read_ahead and args.routing != "qwen3-like":
        raise Edge0Error("--read-ahead stages synthetic routes ahead: add --routing qwen3-like")
    if args.long_prompt is not None and args.long_prompt < 2:
        raise Edge0Error(f"--long-prompt {args.long_prompt}: give a prompt length of at least 2 tokens")
    if args.read_limit is not None and args.no_cap:
        raise Edge0Error("--read-limit applies to the capped arms, which --no-cap skips; drop one of them")
    if args.pace_reads is not None and args.no_cap:
        raise Edge0Error("--pace-reads adds a capped setting, which --no-cap skips; drop one of them")
    return args


def parse_lengths(text: str) -> list[int]:
    """'512,2048,8192' -> [512, 2048, 8192] (an Edge0Error naming --prompt-lengths)."""
    try:
        lengths = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise Edge0Error(f"--prompt-lengths {text!r}: not a list of token counts; use e.g. 512,2048,8192") from None
    if not lengths or min(lengths) < 2:
        raise Edge0Error(f"--prompt-lengths {text!r}: give one or more lengths of at least 2 tokens")
    return lengths


def main(argv=None) -> int:
    args = parse_args(argv)
    arms = select_arms(args.arms)
    if args.trace_arm and args.trace_arm not in {a.name for a in arms}:
        raise Edge0Error(
            f"--trace-arm {args.trace_arm}: not among the arms run; choose one of {', '.join(a.name for a in arms)}"
        )
    if args.prompt_lengths:
        arms = list(CURVE_ARMS)
    if args.read_limit is not None and not args.concurrency and not any(a.storage == "capped" for a in arms):
        raise Edge0Error(
            f"--read-limit applies to the capped arms; --arms {args.arms} selects none (add e.g. exact-capped)"
        )
    model = resolve_model(args)
    if args.read_limit is not None and (why := read_limit_refusal(model.store, args.read_limit)):
        raise Edge0Error(f"--read-limit {args.read_limit / 1e6:g}MB/s: cannot limit reads here: {why}")
    default = "prompt-curve" if args.prompt_lengths else "concurrency" if args.concurrency else "bench"
    out = Path(args.out or f"docs/benchmarks/{default}{'-quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now().astimezone()
    result = {
        "schema": SCHEMA,
        "date": started.isoformat(timespec="seconds"),
        "command": "edge0 bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        "machine": machine_info(),
        "git": git_commit(),
        "packages": package_versions(),
        "model": {
            "store": str(model.store),
            "mlx_model": str(model.mlx) if model.mlx else None,
            **{k: model.info.get(k) for k in ("shape", "seed", "size", "generator_version") if k in model.info},
        },
    }
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    # On SIGTERM unwind like Ctrl-C: stop the arm's process and remove the cgroup.
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        if args.prompt_lengths:
            result.update(run_curve(args, model, args.prompt_lengths))
        elif args.concurrency:
            result.update(run_concurrency(args, model, args.concurrency))
        else:
            # the disk's own rate first (the page cache dropped): the roofline of the cold arms;
            # the same reads out of the page cache: the warm arms'
            result["device_read"] = measure_read_rate(model.store)
            print(f"edge0 bench: the store's disk reads {_mbps(result['device_read'])}", file=sys.stderr)
            result["page_cache_read"] = measure_read_rate(model.store, warm=True)
            print(f"edge0 bench: the page cache reads {_mbps(result['page_cache_read'])}", file=sys.stderr)
            result.update(run_suite(args, model, arms))
            add_rooflines(result, result["device_read"]["bytes_per_s"], result["page_cache_read"]["bytes_per_s"])
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    end = git_commit()
    if end != result["git"]:  # the code changed under a long run: say so
        result["git_at_end"] = end
        print(f"edge0 bench: warning: the git tree changed during the run ({end})", file=sys.stderr)
    result["elapsed_s"] = (datetime.datetime.now().astimezone() - started).total_seconds()
    if args.concurrency:
        _write_json(out, result)
        print(concurrency_markdown(result))
        print(f"wrote {out}", file=sys.stderr)
        return 0
    if args.prompt_lengths:
        for point in result["prompt_curve"]:
            _check_numbers(point)
        _write_json(out, result)
        print(curve_markdown(result))
        print(f"wrote {out}", file=sys.stderr)
        return 0
    result["summary"] = summary(result)
    _check_numbers(result)
    _write_json(out, result)
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


def _mbps(read: dict) -> str:
    cached = "" if read["warm"] or read["page_cache_dropped"] else " (the page cache could not be dropped here)"
    return f"{read['bytes_per_s'] / 1e6:.0f} MB/s at {read['read_size']} B x {read['queue_depth']}{cached}"


def _write_json(path: Path, result: dict) -> None:
    """A temp file, then a rename: an interrupted write never leaves a truncated result."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def _check_numbers(result: dict) -> None:
    """Refuse to write NaN/inf (json would write invalid tokens)."""
    for a in result["arms"]:
        for k, v in a["metrics"].items():
            if isinstance(v, float) and not math.isfinite(v):
                a["metrics"][k] = None
