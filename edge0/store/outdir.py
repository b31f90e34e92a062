"""An output directory that one process at a time writes atomically: the writer holds a lock
beside it, writes `.NAME.partial-PID` and renames it at the end; partial directories that killed
writers left are removed by the next run; SIGTERM/SIGHUP unwind so the partial is removed.
Used by `edge0 convert` and `edge0 relayout`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from edge0.errors import Edge0Error


def partial_dir(out: Path, pid: int | str = "") -> Path:
    """The directory process `pid` writes before renaming it to `out` (no `pid`: the common
    prefix of such directories)."""
    return out.parent / f".{out.name}.partial-{pid}"


def remove_stale_partials(out: Path, quiet: bool) -> None:
    """Remove the partial directories that killed writers of `out` left (their process is gone);
    each run writes its own, named by its PID, so without this they would pile up."""
    prefix = partial_dir(out).name
    for p in out.parent.iterdir():
        pid = p.name[len(prefix) :]
        if p.name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            if not quiet:
                print(f"edge0: removing {p}, left by an interrupted run", file=sys.stderr)
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def output_lock(out: Path, wait: bool, quiet: bool):
    """Hold an exclusive flock on `.NAME.lock` beside `out` while writing `out`. A run
    that finds it held fails (`wait` False) or waits. The holder deletes the file before
    unlocking, so a waiter that then holds a deleted file locks the new one instead."""
    path = out.parent / f".{out.name}.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                _flock(fd, out, wait, quiet)
            except BaseException:
                os.close(fd)
                raise
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)
    except OSError as e:
        raise Edge0Error(
            f"-o {out}: cannot write in {out.parent} ({e.strerror}); choose a writable directory"
        ) from None
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            yield
        except Exception as e:
            if disk_full(e):  # the partial directory is gone by now (convert and relayout remove it)
                raise Edge0Error(
                    f"-o {out}: no space left on {out.parent} ({shutil.disk_usage(out.parent).free} bytes free; "
                    f"{type(e).__name__}: {e}); free some space or choose another output directory"
                ) from None
            raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def disk_full(e: BaseException) -> bool:
    """A write refused for want of space (or quota): OSError's errno, or the message of a library
    that reports it its own way (the tokenizers library raises a plain Exception)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    return any(text in str(e) for text in ("No space left on device", "Disk quota exceeded"))


def _flock(fd: int, out: Path, wait: bool, quiet: bool) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    if not wait:
        raise Edge0Error(
            f"-o {out}: another conversion (pid {holder}) is writing it; wait for it to finish, "
            "or choose another output directory"
        )
    if not quiet:
        print(f"edge0: waiting for another process (pid {holder}) converting into {out}", file=sys.stderr)
    fcntl.flock(fd, fcntl.LOCK_EX)


@contextlib.contextmanager
def unwind_on_termination():
    """SIGTERM and SIGHUP kill a process without unwinding by default; while converting they
    raise SystemExit instead, so the partial directory is removed. A handler the application
    installed is left alone, and Python runs handlers only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s, handler in previous.items():
        if handler == signal.SIG_DFL:
            signal.signal(s, _exit_on_signal)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)
