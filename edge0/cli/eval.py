"""`edge0 eval`: perplexity on held-out text and next-token agreement with a reference run.

How windows, perplexity, agreement and KL are computed: edge0/engine/evaluate.py. `--decode` runs one
decode step per token through the KV cache and the expert cache (slower; the mode in which cache
policies and substitution act). The reference is another edge0 store (gate routing, no adapter)
or an mlx-lm / Hugging Face directory run resident by mlx-lm.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import edge0
from edge0.cli.common import OneLineParser, add_model_options, load_options, read_utf8, run_main
from edge0.engine.evaluate import evaluate
from edge0.errors import Edge0Error
from edge0.store.format import MANIFEST


def reference_fn(path: str, options):
    """Logits function for --reference: an edge0 store (loaded with `options`), or an mlx-lm / HF
    model run resident."""
    p = Path(path).expanduser()
    if (p / MANIFEST).is_file():
        return edge0.load(p, **options).logits
    from edge0.backend.forward import resident_logits_fn

    return resident_logits_fn(p)


def check_reference(path: str) -> None:
    """Before anything loads: --reference must be a store or a model directory with a config.json."""
    from edge0.backend import io as bio

    p = Path(path).expanduser()
    fix = "pass an edge0 store or an mlx-lm / Hugging Face model directory"
    if not p.is_dir():
        raise Edge0Error(f"--reference {path}: no such directory; {fix}")
    if not (p / MANIFEST).is_file():
        bio.read_config(p, fix)


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 eval", description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--data", required=True, help="held-out text file (UTF-8)")
    p.add_argument(
        "--reference",
        default=None,
        help="edge0 store (run with gate routing, no adapter) or mlx-lm/HF model directory to compare with",
    )
    p.add_argument("--window", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows")
    p.add_argument(
        "--decode",
        action="store_true",
        help="token by token through the KV cache and the expert cache, as decoding runs (slower); "
        "needed to measure --cache-policy and --substitute-alpha, which act on decode steps",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    if args.window < 2:
        p.error(f"--window {args.window}: must be >= 2 (a window's last token predicts nothing)")
    if args.max_windows is not None and args.max_windows < 1:
        p.error(f"--max-windows {args.max_windows}: must be >= 1")
    data = Path(args.data)
    text = read_utf8(data)
    if args.reference:
        check_reference(args.reference)
    engine = edge0.load(args.model, **load_options(args))
    print(engine.describe(), file=sys.stderr)
    tokens = engine.encode(text)
    # the reference is the plain model: gate routing, no adapter
    ref = (
        reference_fn(args.reference, {"dtype": args.dtype, "prerouter": False, "lora": False})
        if args.reference
        else None
    )
    # With a pre-router, every position is routed as decoding would route it.
    logits = engine.decode_logits if args.decode else engine.prerouted_logits
    result = evaluate(logits, tokens, args.window, args.max_windows, ref, progress=True)
    st = engine.stats()
    processed = result["tokens"] + result["windows"]  # a window's last token predicts nothing
    result.update(
        {
            "model": engine.model_id,
            "data": str(data),
            "top_k": engine.k,
            "prerouter": str(engine.heads_path) if engine.heads_path else None,
            "decode": args.decode,
            "cache_policy": st["cache_policy"],
            "substitute_alpha": st["substitute_alpha"],
            "expert_bytes_per_token": st["totals"]["bytes_read"] / processed,
            "expert_hit_rate": st["totals"]["hit_rate"],
            "substitutions": st["totals"]["substitutions"],
        }
    )
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        line = (
            f"perplexity {result['perplexity']:.3f} over {result['tokens']} tokens "
            f"({result['windows']} windows of {args.window})"
        )
        if ref is not None:
            line += f", agreement {100 * result['agreement']:.2f}%, KL {result['kl_to_reference']:.4f} nats/token"
        hit = result["expert_hit_rate"]
        line += (
            f"; experts read {result['expert_bytes_per_token'] / 2**20:.3f} MiB/token"
            + (f", cache hits {100 * hit:.1f}%" if hit is not None else "")
            + (f", substitutions {result['substitutions']} (lossy)" if result["substitutions"] else "")
        )
        print(line)
    return 0


if __name__ == "__main__":
    run_main(main)
