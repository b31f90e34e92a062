"""`python -m edge0.bench`: the same as `edge0 bench`."""

from edge0.bench.cli import main
from edge0.cli_util import run_main

if __name__ == "__main__":
    run_main(main)
