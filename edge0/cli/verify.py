"""`edge0 verify`: check every file of a store against the sizes and sha256 in its manifest, and
the manifest against its own checksum; every problem is reported, not only the first."""

from __future__ import annotations

import sys

from edge0.cli.common import OneLineParser, run_main
from edge0.errors import Edge0Error
from edge0.store.format import verify_store


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 verify", description=__doc__.splitlines()[0])
    p.add_argument("model", help="store directory")
    args = p.parse_args(argv)
    manifest, problems = verify_store(args.model)
    if len(problems) == 1:
        raise Edge0Error(problems[0])
    for line in problems:
        print(f"edge0: error: {line}", file=sys.stderr)
    if problems:
        raise Edge0Error(
            f"{args.model}: {len(problems)} problems in {len(manifest['files'])} files and the manifest (above)"
        )
    print(f"{args.model}: {len(manifest['files'])} files and the manifest OK")
    return 0


if __name__ == "__main__":
    run_main(main)
