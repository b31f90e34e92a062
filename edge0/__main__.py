"""`python -m edge0 <verb>`: the same as `edge0 <verb>`."""

from edge0.cli import main

main()
