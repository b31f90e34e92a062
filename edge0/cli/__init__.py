"""`edge0 <verb>` (also `python -m edge0 <verb>`): one module per verb in this package. Verbs
import the libraries below them, never each other; what they share is in common.py."""

from __future__ import annotations

import importlib
import sys

from edge0.cli.common import run_main

VERBS = {
    "convert": ("edge0.cli.convert", "convert a Hugging Face or mlx-lm checkpoint into an edge0 store"),
    "generate": ("edge0.cli.generate", "generate text from a prompt"),
    "chat": ("edge0.cli.chat", "interactive chat in the terminal"),
    "serve": ("edge0.cli.serve", "OpenAI-compatible HTTP server"),
    "eval": ("edge0.cli.eval", "perplexity and agreement with a reference on held-out text"),
    "train-prerouter": ("edge0.cli.train_prerouter", "train pre-router heads for a store"),
    "train-lora": ("edge0.cli.train_lora", "train a recovery LoRA against a full-precision teacher"),
    "trace": ("edge0.cli.trace", "record routed experts and router scores during generation"),
    "simulate": ("edge0.cli.simulate", "replay a routing trace through every cache policy"),
    "train-cache-policy": ("edge0.cli.train_cache_policy", "train the learned (FlashMoE-style) eviction policy"),
    "plan": ("edge0.cli.plan", "predict hit rate and speed per expert-cache budget"),
    "bench": ("edge0.cli.bench", "benchmark suite: Edge0 against resident mlx-lm"),
    "verify": ("edge0.cli.verify", "check a store's files against its manifest checksums"),
    "relayout": ("edge0.cli.relayout", "rewrite an older store's expert files in the current layout"),
}


def _usage() -> str:
    lines = ["usage: edge0 <verb> [options]", "", "verbs:"]
    lines += [f"  {v:<10} {d}" for v, (_, d) in VERBS.items()]
    lines += ["", "Run `edge0 <verb> --help` for a verb's options."]
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        sys.exit(0 if argv else 2)
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"edge0: error: unknown verb {verb!r}\n\n{_usage()}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(VERBS[verb][0])
    run_main(module.main, rest)


if __name__ == "__main__":
    main()
