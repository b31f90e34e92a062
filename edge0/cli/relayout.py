"""`edge0 relayout`: rewrite a store's expert files in the current layout (one read per expert),
cut over several disks with --stripe, or joined back into one directory without it."""

from __future__ import annotations

from edge0.cli.common import STRIPE_HELP, OneLineParser, run_main
from edge0.store.relayout import relayout_store


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 relayout", description=__doc__.splitlines()[0])
    p.add_argument("src", help="an edge0 store (format version 1 or 2)")
    p.add_argument("out", help="output store directory (must not exist)")
    p.add_argument("--stripe", action="append", metavar="DIR", help=STRIPE_HELP)
    args = p.parse_args(argv)
    print(f"wrote {relayout_store(args.src, args.out, stripes=args.stripe)}")
    return 0


if __name__ == "__main__":
    run_main(main)
