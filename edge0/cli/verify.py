"""`edge0 verify`: check every file of a store against the sizes and sha256 in its manifest."""

from __future__ import annotations

from edge0.cli.common import OneLineParser, run_main
from edge0.store import open_manifest


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 verify", description=__doc__.splitlines()[0])
    p.add_argument("model", help="store directory")
    args = p.parse_args(argv)
    manifest = open_manifest(args.model, verify=True)
    print(f"{args.model}: {len(manifest['files'])} files OK")
    return 0


if __name__ == "__main__":
    run_main(main)
