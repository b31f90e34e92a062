"""`edge0 <verb>`: dispatch to the verb's module; each also runs as `python -m edge0.<verb>`."""

from __future__ import annotations

import importlib
import sys

from edge0.cli_util import run_main

VERBS = {
    "convert": ("edge0.convert", "convert a Hugging Face or mlx-lm checkpoint into an edge0 store"),
    "generate": ("edge0.generate", "generate text from a prompt"),
    "chat": ("edge0.chat", "interactive chat in the terminal"),
    "serve": ("edge0.serve", "OpenAI-compatible HTTP server"),
    "eval": ("edge0.evaluate", "perplexity and agreement with a reference on held-out text"),
    "train-prerouter": ("edge0.train_prerouter", "train pre-router heads for a store"),
    "train-lora": ("edge0.train_lora", "train a recovery LoRA against a full-precision teacher"),
    "trace": ("edge0.trace", "record routed experts and router scores during generation"),
    "simulate": ("edge0.simulate", "replay a routing trace through every cache policy"),
    "train-cache-policy": ("edge0.train_cache_policy", "train the learned (FlashMoE-style) eviction policy"),
    "plan": ("edge0.plan", "predict hit rate and speed per expert-cache budget"),
    "bench": ("edge0.bench", "benchmark suite: Edge0 against resident mlx-lm"),
    "verify": ("edge0.verify", "check a store's files against its manifest checksums"),
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
