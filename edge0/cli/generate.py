"""`edge0 generate`: one prompt in, text and stats out."""

from __future__ import annotations

import sys

from edge0.cli.common import (OneLineParser, add_model_options, add_sampling_options, check_sampling_options,
                              format_layer_stats, format_stats, load_options, run_main)


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 generate", description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    add_sampling_options(p, 100, "completion")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--stats", action="store_true", help="print per-layer expert statistics too")
    args = p.parse_args(argv)
    check_sampling_options(p, args)

    import edge0

    engine = edge0.load(args.model, **load_options(args))
    print(engine.describe(), file=sys.stderr)
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
        print(format_layer_stats(engine.stats()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(main)
