"""`edge0 generate`: one prompt in, text and stats out."""

from __future__ import annotations

import sys

from edge0.cli.common import (
    OneLineParser,
    add_model_options,
    add_sampling_options,
    check_sampling_options,
    format_layer_stats,
    format_rank_stats,
    format_stats,
    load_or_follow,
    run_main,
)
from edge0.engine.engine import TemplateFailed
from edge0.errors import Edge0Error


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 generate", description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    add_sampling_options(p, 100, "completion")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--stats", action="store_true", help="print per-layer expert statistics too")
    args = p.parse_args(argv)
    check_sampling_options(p, args)
    text = _prompt_text(args.prompt)

    engine = load_or_follow(args)
    if engine is None:  # under mlx.launch: this rank ran its layers of rank 0's work
        return 0
    try:
        return _generate(engine, args, text)
    finally:
        engine.close()


def _generate(engine, args, text: str) -> int:
    if not args.no_chat_template and engine.tokenizer.chat_template is not None:
        try:
            prompt = engine.chat_prompt([{"role": "user", "content": text}])
        except TemplateFailed as e:
            raise Edge0Error(
                f"{engine.template_file()}: {e}; the template is at fault: fix it there, or pass "
                "--no-chat-template to feed the prompt as raw text"
            ) from None
    else:
        prompt = engine.tokenizer.encode(text)
    if not prompt:
        raise Edge0Error(f"--prompt {args.prompt!r}: no tokens to start from; pass some text")
    stats = None
    for step in engine.stream_generate(
        prompt, args.max_tokens, temperature=args.temp, top_p=args.top_p, seed=args.seed
    ):
        print(step.text, end="", flush=True)
        stats = step.stats
    print()
    print("==========", file=sys.stderr)
    print(format_stats(stats), file=sys.stderr)
    if engine.pipeline is not None:
        print(format_rank_stats(engine.stats()), file=sys.stderr)
    if args.stats:
        print(format_layer_stats(engine.stats()), file=sys.stderr)
    return 0


def _prompt_text(prompt: str) -> str:
    """--prompt, or standard input for '-'; undecodable bytes arrive as errors or as surrogates
    (Python's surrogateescape), which the tokenizer rejects with a TypeError."""
    try:
        text = sys.stdin.read() if prompt == "-" else prompt
        text.encode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError):
        raise Edge0Error(f"--prompt{' -: standard input' if prompt == '-' else ''}: not UTF-8 text") from None
    return text


if __name__ == "__main__":
    run_main(main)
