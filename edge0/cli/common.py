"""What the verbs share: expected failures print one line and exit 2 without a traceback, the
model-loading and sampling flags (the former made from LoadOptions' fields), reading training
text, and stats lines."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from edge0.errors import Edge0Error
from edge0.options import LoadOptions, flag
from edge0.sampling import check_sampling
from edge0.units import format_size


def run_main(main, argv=None) -> None:
    """Run a verb's main(); Edge0Error -> 'edge0: error: ...' on stderr and exit code 2."""
    try:
        code = main(argv)
    except Edge0Error as e:
        print(f"edge0: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("edge0: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code or 0)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


STRIPE_HELP = (
    "another directory, on another disk, to cut every expert's row over (repeatable: one per disk; "
    "it must not exist yet): each read then draws on every disk at once (docs/store-format.md)"
)


# -- model-loading flags ------------------------------------------------------------------------
_TYPES = {"int": int, "float": float}


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--model and one flag per LoadOptions field (a tristate field also gets --no-NAME)."""
    p.add_argument("--model", default=None, help="edge0 store directory (default: the bundled demo model)")
    for f in fields(LoadOptions):
        m, name = f.metadata, flag(f.name)
        kind = m["kind"]
        if kind == "flag":
            p.add_argument(name, dest=f.name, action="store_true", help=m["help"])
        elif kind == "switch":
            p.add_argument(name, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=m["help"])
        elif kind == "tristate":
            g = p.add_mutually_exclusive_group()
            g.add_argument(name, dest=f.name, default=None, metavar="FILE", help=m["help"])
            g.add_argument(f"--no-{name[2:]}", dest=f.name, action="store_false", default=None, help=m["off_help"])
        elif kind == "layer_executors":
            p.add_argument(name, dest=f.name, action="append", default=[], metavar=m["metavar"], help=m["help"])
        else:
            p.add_argument(
                name,
                dest=f.name,
                default=f.default,
                type=_TYPES.get(kind, str),
                choices=None if m.get("checked_later") else m.get("choices"),
                metavar=m.get("metavar", "FILE" if kind == "path" else "SIZE" if kind == "size" else None),
                help=m["help"],
            )


def add_routing_option(p, own: str, own_help: str, synthetic: str = "") -> None:
    """--routing: `own` (the default; `own_help` says what it routes by) or qwen3-like, synthetic
    routes fitted to Qwen3-30B-A3B's cache statistics (`synthetic`: what more the help says of them)."""
    p.add_argument(
        "--routing",
        choices=[own, "qwen3-like"],
        default=own,
        help=f"{own} (default): {own_help}; qwen3-like: synthetic routes fitted to Qwen3-30B-A3B's cache "
        f"statistics{synthetic} (docs/synthetic-routing.md)",
    )


def add_sampling_options(p: argparse.ArgumentParser, max_tokens: int, what: str) -> None:
    """--max-tokens (default `max_tokens`, most tokens per `what`), --temp, --top-p, --seed."""
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens per {what} (default {max_tokens})")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold, in (0, 1] (default 1)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling, 0 to 2**64-1")


def check_sampling_options(p: argparse.ArgumentParser, args) -> None:
    """The sampling flags' ranges, checked before the model loads: a usage error naming the flag."""
    try:
        if args.max_tokens < 1:
            raise Edge0Error(f"--max-tokens {args.max_tokens}: must be >= 1")
        check_sampling(
            args.temp, args.top_p, args.seed, {"temperature": "--temp", "top_p": "--top-p", "seed": "--seed"}
        )
    except Edge0Error as e:
        p.error(str(e))


def load_options(args, **overrides) -> dict:
    """`edge0.load` keywords (LoadOptions fields) from parsed model-loading flags, with
    `overrides` (a verb's own needs)."""
    values = {f.name: getattr(args, f.name) for f in fields(LoadOptions)}
    values["layer_executors"] = parse_layer_executors(values["layer_executors"])
    return {**values, **overrides}


def load_or_follow(args, before_follow=None):
    """Load the model of a verb's --model and flags and print its describe line. Under
    mlx.launch a rank other than 0 runs its layers of rank 0's work here and gets None back
    (`before_follow(engine)` first, if given)."""
    import edge0

    engine = edge0.load(args.model, **load_options(args))
    print(engine.describe(), file=sys.stderr)
    if engine.follower:
        if before_follow is not None:
            before_follow(engine)
        engine.follow()
        return None
    return engine


def parse_layer_executors(specs: list[str]) -> dict:
    """['3:decode=hot', ...] -> {3: {"decode": "hot"}}."""
    out: dict = {}
    for spec in specs:
        try:
            layer, rest = spec.split(":", 1)
            phase, name = rest.split("=", 1)
            if phase not in ("prefill", "decode"):
                raise ValueError
            out.setdefault(int(layer), {})[phase] = name
        except ValueError:
            raise Edge0Error(f"--layer-executor {spec!r}: expected LAYER:PHASE=NAME, e.g. 3:decode=hot") from None
    return out


def read_utf8(path: Path, flag: str = "--data") -> str:
    """The contents of the text file given as `flag`; Edge0Error if it is missing or not UTF-8."""
    if not path.is_file():
        raise Edge0Error(f"{flag} {path}: no such file; pass a UTF-8 text file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise Edge0Error(
            f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start}); pass a UTF-8 text file"
        ) from None


def read_text(path: Path) -> str:
    """Training text: plain text, or JSONL with a "text" field per line."""
    raw = read_utf8(path)
    if path.suffix == ".jsonl":
        try:
            return "\n\n".join(json.loads(line)["text"] for line in raw.splitlines() if line.strip())
        except (json.JSONDecodeError, KeyError, TypeError):
            raise Edge0Error(f'--data {path}: every JSONL line needs a "text" field') from None
    return raw


# -- stats lines --------------------------------------------------------------------------------
def format_stats(s: dict) -> str:
    """One generation's stats on one line."""
    hit = "n/a" if s.get("expert_hit_rate") is None else f"{100 * s['expert_hit_rate']:.0f}%"
    sub = f", substitutions {s['substitutions']} (lossy)" if s.get("substitutions") else ""
    return (
        f"prompt {s['prompt_tokens']} tok ({s['prefill_tps']:.1f} tok/s prefill), "
        f"generated {s['generation_tokens']} tok ({s['decode_tps']:.1f} tok/s), "
        f"MLX peak {s['peak_memory_bytes'] / 2**20:.1f} MiB, RSS peak {s['peak_rss_bytes'] / 2**20:.0f} MiB, "
        f"experts read {s['expert_bytes_read'] / 2**20:.1f} MiB in {s['expert_reads']} reads ({s['io_reader']}), "
        f"cache hits {hit}, "
        f"stall {s.get('stall_ms_per_step', 0):.1f} ms/step{sub}{format_speculation(s)}"
    )


def format_speculation(s: dict) -> str:
    """The speculation part of a stats line ("" without a drafter)."""
    sp = s.get("speculation")
    if not sp:
        return ""
    acc = "n/a" if sp["acceptance"] is None else f"{100 * sp['acceptance']:.0f}%"
    tpv = "" if sp["tokens_per_verify"] is None else f", {sp['tokens_per_verify']:.2f} tok/verify"
    return (
        f", speculation ({sp['drafter']}, {'on' if sp['on'] else 'off'}): {sp['verifies']} verifies{tpv}, "
        f"acceptance {acc}, {sp['plain_steps']} plain steps"
    )


def format_layer_stats(st: dict) -> str:
    """Per-layer executor statistics as a table."""
    cols = (
        "calls",
        "host_syncs",
        "loads",
        "hits",
        "misses",
        "bytes_read",
        "read_amplification",
        "stall_ms",
        "slot_rewrites",
        "slot_scatters",
        "fallbacks",
        "overlapped",
        "dropped",
        "substitutions",
    )
    rows = [" ".join(f"{c:>12}" for c in ("layer",) + cols)]
    for name, s in list(st["layers"].items()) + [("total", st["totals"])]:
        vals = [s[c] for c in cols]
        rows.append(
            " ".join(f"{v:>12.2f}" if isinstance(v, float) else f"{'-' if v is None else v:>12}" for v in [name, *vals])
        )
    rows.append(f"stall {st['stall_ms_per_step']:.2f} ms per decode step over {st['decode_steps']} steps")
    io = st.get("io")
    if io:
        rows.append(
            f"expert reads: {io['reader']} ({io['reason']}), {io['reads']} reads, {io['bytes_issued'] / 2**20:.1f} MiB "
            f"issued, at most {io['max_queue_depth']} in flight, {io['direct_fallbacks']} direct-I/O fallbacks"
        )
    pr = st.get("prerouter")
    if pr:
        rows.append(f"pre-router {pr['heads']}: routed by head {pr['routed_by_head']}, by gate {pr['routed_by_gate']}")
        if pr["recall"] is not None:
            rows.append(
                "recall of predicted vs gate routes: "
                + ", ".join(f"layer {l} {r:.3f}" for l, r in pr["recall"].items())
            )
    return "\n".join(rows)


def format_rank_stats(st: dict) -> str:
    """One line per rank of a distributed engine (Engine.stats()["ranks"])."""
    rows = []
    for r in st["ranks"]:
        hit = "n/a" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f}%"
        rows.append(
            f"{r['stage']}: resident {format_size(r['resident_bytes'])}, expert cache "
            f"{format_size(r['expert_cache_bytes'])} of {format_size(r['expert_bytes'])}, "
            f"MLX peak {format_size(r['peak_memory_bytes'])}, RSS peak {format_size(r['peak_rss_bytes'])}, "
            f"cache hits {hit}, stall {r['stall_ms_per_step']:.1f} ms/step, sent {format_size(r['bytes_sent'])} "
            f"in {r['send_ms']:.0f} ms, waited {r['wait_ms']:.0f} ms for the previous stage"
        )
    return "\n".join(rows)
