"""`edge0 trace`: record every MoE layer's routes and router scores while the model reads
held-out text (teacher-forced) and then generates from it."""

from __future__ import annotations

from pathlib import Path

from edge0.cache import tracefile
from edge0.cache.record import record_file, synthetic_record
from edge0.cli.common import OneLineParser, add_model_options, add_routing_option, load_options, run_main
from edge0.errors import Edge0Error


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 trace", description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument(
        "--data", type=Path, help="text file; documents separated by <|endoftext|> lines (with --routing model)"
    )
    p.add_argument("--out", required=True, type=Path, help="trace file to write (.npz)")
    p.add_argument("--prompts", type=int, default=8, help="number of prompts taken from --data (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="teacher-forced tokens per prompt (default 512)")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="tokens generated after each prompt (default 64; 0: none)"
    )
    add_routing_option(
        p,
        "model",
        "record the model's own routes on --data",
        ", with this model's shape, one per token of prompts x (prompt-tokens + max-tokens)",
    )
    p.add_argument("--routing-seed", type=int, default=0, help="seed of the synthetic routes (default 0)")
    args = p.parse_args(argv)
    if args.routing == "model" and args.data is None:
        p.error("--data is required (or --routing qwen3-like)")
    if args.prompts < 1 or args.prompt_tokens < 2 or args.max_tokens < 0:
        p.error("--prompts must be >= 1, --prompt-tokens >= 2 and --max-tokens >= 0")
    if not args.out.parent.is_dir():
        raise Edge0Error(f"--out: directory {args.out.parent} does not exist; create it or pick another path")

    import edge0

    engine = edge0.load(args.model, **load_options(args))
    if args.routing == "qwen3-like":
        trace = synthetic_record(engine, args.prompts * (args.prompt_tokens + args.max_tokens), args.routing_seed)
    else:
        trace = record_file(engine, args.data, args.prompts, args.prompt_tokens, args.max_tokens)
    tracefile.write(args.out, trace)
    gen = int(trace.phase.sum())
    print(
        f"{args.out}: {trace.num_steps} steps ({trace.num_steps - gen} teacher-forced, {gen} generated), "
        f"{len(trace.layers)} MoE layers, {trace.num_experts} experts, top-{trace.top_k}"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
