"""Where models come from: a store directory, or (with no path) the bundled demo model."""

from __future__ import annotations

from pathlib import Path

from edge0.errors import Edge0Error


def resolve_model(path) -> Path:
    """The store directory to load. `None` means the bundled demo model."""
    if path is None:
        raise Edge0Error("no --model given and no bundled model is installed; pass --model <store dir>")
    return Path(path).expanduser()
