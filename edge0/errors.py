"""User-facing errors: one line that names the file or field and says how to fix it."""


class Edge0Error(Exception):
    """An expected failure (bad input, bad store). CLIs print it on one line and exit 2."""


class PeerLost(Edge0Error):
    """A rank of a distributed engine is gone (it exited, or its machine is unreachable): this
    process cannot go on either, so a server stops with it rather than failing every request."""
