"""Files a cache directory owns, handled so that nothing else is touched: regular files only,
never through a link nor from a FIFO, private modes, a folder of this user's only
(store/promptcache.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from edge0.errors import Edge0Error


def read_regular(path: Path) -> bytes:
    """A regular file's bytes, never through a link nor from a FIFO (which would block)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)


def unlink_regular(path: Path) -> None:
    """Remove `path` if it is a regular file (a temporary the cache wrote), else leave it."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


def make_private(path, st: os.stat_result, mode: int) -> None:
    """Give an entry the cache owns `mode` (0700 folders, 0600 files): conversations are private
    whatever the umask, or an older edge0, left. Another user's entry is left as it is."""
    if stat.S_IMODE(st.st_mode) != mode and st.st_uid == os.getuid():
        os.chmod(path, mode)


def check_owner(path, st: os.stat_result) -> None:
    """A folder the cache writes in must be this user's and writable by no one else: there, another
    user could plant a link that redirects a write, or a cache file that answers a prompt."""
    if st.st_uid != os.geteuid():
        raise Edge0Error(f"--prompt-cache-dir: {path} belongs to another user; pass a directory of your own")
    if st.st_mode & 0o022:
        raise Edge0Error(f"--prompt-cache-dir: {path} is writable by other users; chmod 700 it, or pass another")


def file_version(st: os.stat_result) -> tuple:
    """Which file a name holds: one written again since (renamed into place) differs."""
    return st.st_ino, st.st_size, st.st_mtime_ns
