"""`edge0 convert`: a Hugging Face or mlx-lm checkpoint -> an edge0 store."""

from __future__ import annotations

from edge0.cli.common import STRIPE_HELP, OneLineParser, run_main
from edge0.store.convert import convert


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 convert", description=__doc__.splitlines()[0])
    p.add_argument("--hf-path", required=True, help="Hugging Face repo id or local model directory")
    p.add_argument("-o", "--out", required=True, help="output store directory (must not exist)")
    p.add_argument(
        "--dtype",
        choices=["float16", "bfloat16", "float32"],
        default=None,
        help="dtype of unquantized tensors (default: the checkpoint's torch_dtype)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="load a tokenizer that is Python code shipped with the model (Kimi's): it runs with your rights",
    )
    p.add_argument("--stripe", action="append", metavar="DIR", help=STRIPE_HELP)
    args = p.parse_args(argv)
    convert(args.hf_path, args.out, dtype=args.dtype, trust_remote_code=args.trust_remote_code, stripes=args.stripe)
    return 0


if __name__ == "__main__":
    run_main(main)
