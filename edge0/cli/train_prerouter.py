"""`edge0 train-prerouter`: train pre-router heads for a store on your own text."""

from __future__ import annotations

import sys
from pathlib import Path

import edge0
from edge0.cli.common import OneLineParser, read_text, run_main


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 train-prerouter", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="edge0 store (default: the bundled demo model)")
    p.add_argument("--data", required=True, help="training text (.txt) or JSONL with a text field")
    p.add_argument(
        "--out",
        required=True,
        help="heads file to write (put it in the store as prerouter.safetensors to use it by default)",
    )
    p.add_argument("--max-tokens", type=int, default=60000, help="tokens of --data to use (default 60000)")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--steps", type=int, default=600, help="optimizer steps per head")
    p.add_argument("--hidden", type=int, default=64, help="MLP correction width")
    p.add_argument("--listwise", type=float, default=0.5, help="weight of the listwise top-k term")
    p.add_argument("--start-layer", type=int, default=None, help="first owner layer (default: the first MoE layer)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.max_tokens, args.steps, args.hidden) < 1 or args.window < 2:
        p.error("--max-tokens, --steps and --hidden must be >= 1, --window >= 2")
    if not 0 <= args.listwise < float("inf"):
        p.error(f"--listwise {args.listwise}: must be a finite number >= 0")
    from edge0.prerouter.train import train, write

    engine = edge0.load(args.model, prerouter=False, lora=False, decode_executor="exact")
    text = read_text(Path(args.data))
    tensors, meta, report = train(
        engine,
        text,
        data_name=str(args.data),
        window=args.window,
        max_tokens=args.max_tokens,
        hidden=args.hidden,
        steps=args.steps,
        listwise=args.listwise,
        start=args.start_layer,
        seed=args.seed,
    )
    write(args.out, tensors, meta)
    for consumer, r in sorted(report.items()):
        print(
            f"layer {r['owner']:2d} -> {consumer:2d}: recall@K {r['recall_at_k']:.3f} (untrained "
            f"{r['recall_at_k_untrained']:.3f}), "
            f"recall@K/2 {r['recall_at_half_k']:.3f}",
            file=sys.stderr,
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_main(main)
