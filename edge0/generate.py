"""`edge0 generate`: one prompt in, text and stats out."""

from __future__ import annotations

import argparse
import sys

from edge0.cli_util import run_main
from edge0.errors import Edge0Error


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options shared by every verb that loads a model."""
    p.add_argument("--model", default=None, help="edge0 store directory (default: the bundled demo model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default auto: float32 on CPU, the checkpoint's dtype on GPU)")
    p.add_argument("--top-k", type=int, default=None, help="serving width: experts per token (default: the model's)")
    p.add_argument("--verify", action="store_true", help="check every store file's sha256 before loading")
    p.add_argument("--expert-cache", default=None, metavar="SIZE",
                   help="memory for cached experts, e.g. 2GB (default: from free memory and model size)")
    p.add_argument("--cache-policy", default="lru",
                   help="expert-cache eviction policy: lru (default), lfu, arc, smoe (router scores), flashmoe (learned)")
    p.add_argument("--cache-weights", default=None, metavar="FILE",
                   help="flashmoe: weights from edge0 train-cache-policy, trained on a trace of this model")
    p.add_argument("--smoe-window", type=int, default=None, metavar="N",
                   help="smoe: steps over which router scores are averaged (default 32)")
    p.add_argument("--substitute-alpha", type=float, default=0.0, metavar="A",
                   help="LOSSY, CHANGES OUTPUTS: a routed expert scoring in [S, (1+A)S] (S: best unselected score) "
                        "may be replaced by a cached one scoring in [(1-A)S, S], saving its read (default 0: off)")
    p.add_argument("--prefill-executor", default="whole", choices=["whole", "exact"],
                   help="prefill: whole-layer reads (default) or exact per-expert reads")
    p.add_argument("--decode-executor", default="staged", choices=["staged", "hot", "exact"],
                   help="decode: staged slots (default), hot set + exact misses, or exact")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prerouter", default=None, metavar="FILE",
                   help="pre-router heads (default: the store's prerouter.safetensors, if any)")
    g.add_argument("--no-prerouter", action="store_true", help="route every layer with its own gate")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--lora", default=None, metavar="FILE",
                   help="recovery LoRA adapter (default: the store's adapter for this K and routing, if any)")
    g.add_argument("--no-lora", action="store_true", help="serve without the recovery LoRA")
    p.add_argument("--prerouter-diagnostics", action="store_true",
                   help="also evaluate the gate on pre-routed layers and report recall (slower)")
    p.add_argument("--layer-executor", action="append", default=[], metavar="LAYER:PHASE=NAME",
                   help="per-layer override, e.g. 3:decode=hot (repeatable)")


def _layer_executors(specs: list[str]) -> dict:
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


def load_options(args) -> dict:
    return {"dtype": args.dtype, "top_k": args.top_k, "verify": args.verify, "expert_cache": args.expert_cache,
            "cache_policy": args.cache_policy, "prefill_executor": args.prefill_executor,
            "decode_executor": args.decode_executor, "layer_executors": _layer_executors(args.layer_executor),
            "prerouter": False if args.no_prerouter else args.prerouter,
            "prerouter_diagnostics": args.prerouter_diagnostics,
            "lora": False if args.no_lora else args.lora,
            "cache_weights": args.cache_weights, "smoe_window": args.smoe_window, "substitute_alpha": args.substitute_alpha}


def format_stats(s: dict) -> str:
    hit = "n/a" if s.get("expert_hit_rate") is None else f"{100 * s['expert_hit_rate']:.0f}%"
    sub = f", substitutions {s['substitutions']} (lossy)" if s.get("substitutions") else ""
    return (
        f"prompt {s['prompt_tokens']} tok ({s['prefill_tps']:.1f} tok/s prefill), "
        f"generated {s['generation_tokens']} tok ({s['decode_tps']:.1f} tok/s), "
        f"MLX peak {s['peak_memory_bytes'] / 2**20:.1f} MiB, RSS peak {s['peak_rss_bytes'] / 2**20:.0f} MiB, "
        f"experts read {s['expert_bytes_read'] / 2**20:.1f} MiB, cache hits {hit}, "
        f"stall {s.get('stall_ms_per_step', 0):.1f} ms/step{sub}"
    )


def format_layer_stats(st: dict) -> str:
    """Per-layer executor statistics as a table."""
    cols = ("calls", "host_syncs", "loads", "hits", "misses", "bytes_read", "read_amplification",
            "stall_ms", "slot_rewrites", "slot_scatters", "fallbacks", "dropped", "substitutions")
    rows = [" ".join(f"{c:>12}" for c in ("layer",) + cols)]
    for name, s in list(st["layers"].items()) + [("total", st["totals"])]:
        vals = [s[c] for c in cols]
        rows.append(" ".join(f"{v:>12.2f}" if isinstance(v, float) else f"{'-' if v is None else v:>12}" for v in [name, *vals]))
    rows.append(f"stall {st['stall_ms_per_step']:.2f} ms per decode step over {st['decode_steps']} steps")
    pr = st.get("prerouter")
    if pr:
        rows.append(f"pre-router {pr['heads']}: routed by head {pr['routed_by_head']}, by gate {pr['routed_by_gate']}")
        if pr["recall"] is not None:
            rows.append("recall of predicted vs gate routes: " + ", ".join(f"layer {l} {r:.3f}" for l, r in pr["recall"].items()))
    return "\n".join(rows)


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
