"""`python -m edge0.serve`: the same as `edge0 serve` (a thin shim for that documented form)."""

import sys

from edge0.cli import main

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]])
