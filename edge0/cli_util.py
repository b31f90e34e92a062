"""Shared CLI plumbing: expected failures print one line and exit 2, without a traceback."""

from __future__ import annotations

import sys

from edge0.errors import Edge0Error


def run_main(main, argv=None) -> None:
    """Run a verb's main(); Edge0Error -> 'edge0: error: ...' on stderr and exit code 2."""
    try:
        code = main(argv)
    except Edge0Error as e:
        print(f"edge0: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("edge0: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code or 0)
