"""User-facing errors: one line that names the file or field and says how to fix it."""


class Edge0Error(Exception):
    """An expected failure (bad input, bad store). CLIs print it on one line and exit 2."""


class PeerLost(Edge0Error):
    """A rank of a distributed engine is gone (it exited, or its machine is unreachable): this
    process cannot go on either, so a server stops with it rather than failing every request."""


class ImagesRefused(Edge0Error):
    """A request's images cannot be taken: the model has no vision tower, an image is not one, or
    the prompt's image placeholders do not match them. `index`: the image at fault (None: all)."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index
