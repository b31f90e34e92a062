"""`edge0 generate`: one prompt in, text and stats out."""

from __future__ import annotations

import argparse
import sys

from edge0.cli_util import run_main


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options shared by every verb that loads a model."""
    p.add_argument("--model", default=None, help="edge0 store directory (default: the bundled demo model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default auto: float32 on CPU, the checkpoint's dtype on GPU)")
    p.add_argument("--top-k", type=int, default=None, help="serving width: experts per token (default: the model's)")
    p.add_argument("--verify", action="store_true", help="check every store file's sha256 before loading")


def load_options(args) -> dict:
    return {"dtype": args.dtype, "top_k": args.top_k, "verify": args.verify}


def format_stats(s: dict) -> str:
    hit = "n/a" if s.get("expert_hit_rate") is None else f"{100 * s['expert_hit_rate']:.0f}%"
    return (
        f"prompt {s['prompt_tokens']} tok ({s['prefill_tps']:.1f} tok/s prefill), "
        f"generated {s['generation_tokens']} tok ({s['decode_tps']:.1f} tok/s), "
        f"MLX peak {s['peak_memory_bytes'] / 2**20:.1f} MiB, RSS peak {s['peak_rss_bytes'] / 2**20:.0f} MiB, "
        f"experts read {s['expert_bytes_read'] / 2**20:.1f} MiB, cache hits {hit}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="edge0 generate", description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--stats", action="store_true", help="print per-layer expert statistics too")
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")

    import edge0

    engine = edge0.load(args.model, **load_options(args))
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not args.no_chat_template and engine.tokenizer.chat_template is not None:
        prompt = engine.chat_prompt([{"role": "user", "content": prompt}])
    stats = None
    for step in engine.stream_generate(prompt, args.max_tokens, temperature=args.temp, top_p=args.top_p, seed=args.seed):
        print(step.text, end="", flush=True)
        stats = step.stats
    print()
    print("==========", file=sys.stderr)
    print(format_stats(stats), file=sys.stderr)
    if args.stats:
        for layer, s in engine.stats()["layers"].items():
            print(f"layer {layer:3d}: " + ", ".join(f"{k} {v}" for k, v in s.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(main)
