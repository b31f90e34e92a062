"""User-facing errors: one line that names the file or field and says how to fix it."""


class Edge0Error(Exception):
    """An expected failure (bad input, bad store). CLIs print it on one line and exit 2."""
