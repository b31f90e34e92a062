"""Evicting files from the OS page cache, to measure cold reads honestly (no root needed)."""

from __future__ import annotations

import os


def evict(paths) -> int | None:
    """Drop `paths` from the page cache with posix_fadvise(DONTNEED); returns the bytes evicted,
    or None where the OS has no posix_fadvise (macOS)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    n = 0
    for f in paths:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # DONTNEED leaves dirty pages cached: a file just written must reach the disk first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return n
