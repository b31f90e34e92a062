"""Ways to copy byte ranges of the expert layer files into caller buffers, behind one interface.

A range is (file offset, length, segments): the file bytes from the offset are scattered, in
order, into the segments, each a flat contiguous uint8 array or an int (bytes to skip). So one
read fills one expert's tensors, each into its own array, with the row's padding skipped.

- `mmap`: copy out of a memory map (page faults; slow unless the file is in the page cache);
- `pread`: one `os.preadv` per range straight into the segments, no page faults on the file and
  no buffer per read; the ranges of one call run on a small thread pool (the GIL is released
  during the syscall);
- `direct`: like `pread` on a descriptor that bypasses the page cache (O_DIRECT on Linux,
  F_NOCACHE on macOS), for stores that do not fit in memory. O_DIRECT needs 4 KiB-aligned
  offsets, lengths and buffers, which expert-major layer files give; where the caller cannot
  promise aligned segments (tensors of odd sizes), the range goes through a reused per-thread
  buffer. Where the file system or layout refuses it, that file is read with `pread` and the
  fallback is counted with its reason.

`choose_io` picks one from the store's size and the memory this process can use.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from edge0.backend import memory
from edge0.errors import Edge0Error
from edge0.store.format import ALIGN

STRATEGIES = ("mmap", "pread", "direct")
DEFAULT_QUEUE_DEPTH = 4  # within 15% of the best for one read per expert (docs/benchmarks.md)
# Large reads (whole layers, runs of adjacent experts) are split so several are in flight.
CHUNK = 8 << 20
_PAGE = mmap.PAGESIZE
_F_NOCACHE = 48 if sys.platform == "darwin" else None  # fcntl.h; the fcntl module may lack it


def aligned_empty(nbytes: int, mapped: bool = False) -> np.ndarray:
    """An uninitialised uint8 array of `nbytes` whose data starts 4 KiB-aligned (O_DIRECT needs it).
    `mapped`: in its own anonymous mapping, returned to the OS when the array goes (a whole layer's
    buffer: glibc would otherwise keep it in its heap, where the next, larger one does not fit)."""
    if mapped:
        return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8, count=nbytes)
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + nbytes]


IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_JUNK = aligned_empty(ALIGN)  # padding lands here; nobody reads it, so threads may share it


def split(offset: int, dest: np.ndarray, chunk: int = CHUNK) -> list[tuple[int, int, list]]:
    """One range into a single flat destination, as pieces of at most `chunk` bytes."""
    return [(offset + i, min(chunk, dest.nbytes - i), [dest[i : i + chunk]]) for i in range(0, dest.nbytes, chunk)]


def _iovecs(segments) -> list[np.ndarray]:
    """Buffers for preadv: the arrays themselves, and the shared junk buffer for skipped bytes."""
    out = []
    for s in segments:
        if isinstance(s, int):
            out += [_JUNK[: min(ALIGN, s - i)] for i in range(0, s, ALIGN)]
        else:
            out.append(s)
    return out


class RangeReader:
    """Fills (offset, length, segments) ranges of files under `root`. Thread-safe: each call
    writes only its own buffers; up to `queue_depth` reads of one call are in flight."""

    name = ""

    def __init__(self, root, queue_depth: int = DEFAULT_QUEUE_DEPTH, cold_reads: bool = False, pacer=None):
        self.root = Path(root)
        self.queue_depth = max(1, int(queue_depth))
        self.cold_reads = cold_reads
        self.pacer = pacer  # a StoragePacer: reads as from a slower disk (benchmarks of slow storage)
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.reads = self.bytes_issued = self.in_flight = self.max_in_flight = 0
        self.fallbacks = 0
        self.fallback_reasons: list[str] = []

    def read(self, rel: str, ranges: list[tuple[int, int, list]], aligned: bool = False) -> None:
        """Fill every range's segments from its offset in file `rel` (relative to root).
        `aligned`: the caller promises 4 KiB-aligned offsets, and segments that are all arrays
        with aligned addresses and sizes (direct I/O can then fill them in place)."""
        k = min(self.queue_depth, len(ranges))
        if k <= 1:
            for r in ranges:
                self._timed(rel, *r, aligned)
            return
        it, take = iter(ranges), threading.Lock()

        def drain():
            while True:
                with take:
                    r = next(it, None)
                if r is None:
                    return
                self._timed(rel, *r, aligned)

        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.queue_depth - 1, thread_name_prefix="edge0-io")
        futures = [self._pool.submit(drain) for _ in range(k - 1)]
        try:
            drain()
        finally:
            for f in futures:
                f.result()

    def _timed(self, rel: str, offset: int, n: int, segments: list, aligned: bool) -> None:
        with self._lock:
            self.reads += 1
            self.bytes_issued += n
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.pacer is None:
                self._read(rel, offset, n, segments, aligned)
            else:
                self.pacer.read(lambda: self._read(rel, offset, n, segments, aligned), n)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _read(self, rel: str, offset: int, n: int, segments: list, aligned: bool) -> None:
        raise NotImplementedError

    def stats(self) -> dict:
        """Counters so far: reads, bytes issued, most reads in flight, fallbacks and their reasons."""
        with self._lock:
            return {
                "reader": self.name,
                "queue_depth": self.queue_depth,
                "reads": self.reads,
                "bytes_issued": self.bytes_issued,
                "max_queue_depth": self.max_in_flight,
                "direct_fallbacks": self.fallbacks,
                "direct_fallback_reasons": list(self.fallback_reasons),
                "paced": self.pacer.stats() if self.pacer is not None else None,
            }

    def _fd(self, rel: str) -> int:
        with self._lock:
            if rel not in self._fds:
                self._fds[rel] = os.open(self.root / rel, os.O_RDONLY)
            return self._fds[rel]

    def _pread(self, fd: int, rel: str, offset: int, segments: list) -> None:
        iov = _iovecs(segments)
        while iov:  # preadv may return short counts: drop what was filled and go on
            got = os.preadv(fd, iov[:IOV_MAX], offset)
            if got == 0:
                raise Edge0Error(
                    f"{self.root / rel} ends before byte {offset + sum(len(v) for v in iov)}; "
                    f"the store is damaged: check it with edge0 verify {self.root}"
                )
            offset += got
            while iov and got >= len(iov[0]):
                got -= len(iov.pop(0))
            if got:
                iov[0] = iov[0][got:]

    def _drop(self, rel: str, offset: int, n: int) -> None:
        if self.cold_reads:
            os.posix_fadvise(self._fd(rel), offset, n, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class MmapReader(RangeReader):
    """Copies out of a read-only map of each file, then unmaps the touched pages so they do not
    pile up in this process's RSS (they stay in the page cache, where the kernel can reclaim them)."""

    name = "mmap"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._maps: dict[str, mmap.mmap] = {}

    def _map(self, rel: str) -> mmap.mmap:
        fd = self._fd(rel)
        with self._lock:
            if rel not in self._maps:
                self._maps[rel] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            return self._maps[rel]

    def _read(self, rel, offset, n, segments, aligned):
        mm = self._map(rel)
        pos = offset
        for seg in segments:
            if not isinstance(seg, int):
                seg[:] = np.frombuffer(mm, dtype=np.uint8, count=seg.nbytes, offset=pos)
            pos += seg if isinstance(seg, int) else seg.nbytes
        lo = offset - offset % _PAGE
        mm.madvise(mmap.MADV_DONTNEED, lo, offset + n - lo)
        self._drop(rel, offset, n)

    def close(self):
        with self._lock:
            for m in self._maps.values():
                m.close()
            self._maps.clear()
        super().close()


class PreadReader(RangeReader):
    name = "pread"

    def _read(self, rel, offset, n, segments, aligned):
        self._pread(self._fd(rel), rel, offset, segments)
        self._drop(rel, offset, n)


class DirectReader(RangeReader):
    """Page-cache bypass per file; a file whose descriptor or ranges refuse it is read with pread."""

    name = "direct"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._direct: dict[str, int | None] = {}  # None: this file fell back to pread
        self._local = threading.local()
        self._retired: list[int] = []  # closed only in close(): another thread may still read one

    def _fall_back(self, rel: str, reason: str) -> None:
        with self._lock:
            if self._direct.get(rel, -1) is None:
                return  # another thread already did
            fd, self._direct[rel] = self._direct.get(rel), None
            if fd is not None:
                self._retired.append(fd)
            self.fallbacks += 1
            if reason not in self.fallback_reasons:
                self.fallback_reasons.append(reason)

    def _direct_fd(self, rel: str) -> int | None:
        with self._lock:
            if rel in self._direct:
                return self._direct[rel]
        path = self.root / rel
        reason, fd = "", None
        try:
            if hasattr(os, "O_DIRECT"):
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            elif _F_NOCACHE is not None:
                import fcntl

                fd = os.open(path, os.O_RDONLY)
                fcntl.fcntl(fd, _F_NOCACHE, 1)
            else:
                reason = f"no O_DIRECT or F_NOCACHE on {sys.platform}"
        except OSError as e:
            if fd is not None:
                os.close(fd)
                fd = None
            reason = f"{path.parent}: page-cache bypass refused ({errno.errorcode.get(e.errno, e.errno)} on open)"
        if fd is None:
            self._fall_back(rel, reason)
            return None
        with self._lock:
            if rel in self._direct:  # opened twice by racing threads: keep the first
                os.close(fd)
                return self._direct[rel]
            self._direct[rel] = fd
            return fd

    def _bounce(self, n: int) -> np.ndarray:
        """This thread's aligned buffer of at least `n` bytes (kept for its next reads)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < n:
            buf = self._local.buf = aligned_empty(n)
        return buf[:n]

    def _read(self, rel, offset, n, segments, aligned):
        fd = self._direct_fd(rel)
        if fd is not None and (offset % ALIGN or n % ALIGN):
            self._fall_back(rel, "ranges not 4 KiB-aligned (tensor-major layout)")
            fd = None
        if fd is not None:
            try:
                if aligned:
                    return self._pread(fd, rel, offset, segments)
                # padding or odd-sized tensors: read the aligned range whole, then scatter it
                buf, pos = self._bounce(n), 0
                self._pread(fd, rel, offset, [buf])
                for s in segments:
                    if not isinstance(s, int):
                        s[:] = buf[pos : pos + s.nbytes]
                    pos += s if isinstance(s, int) else s.nbytes
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._fall_back(rel, f"{(self.root / rel).parent}: O_DIRECT read refused (EINVAL)")
        self._pread(self._fd(rel), rel, offset, segments)
        self._drop(rel, offset, n)

    def close(self):
        with self._lock:
            for fd in [*self._direct.values(), *self._retired]:
                if fd is not None:
                    os.close(fd)
            self._direct.clear()
            self._retired.clear()
        super().close()


READERS = {r.name: r for r in (MmapReader, PreadReader, DirectReader)}


def choose_io(store_bytes: int, available: tuple[int, str] | None = None) -> tuple[str, str]:
    """(strategy, reason): experts that fit in half the usable memory stay in the page cache and
    are read with pread; larger stores bypass the page cache (direct), where it would only churn."""
    avail, source = available or memory.available()
    fits = store_bytes <= avail // 2
    return (
        "pread" if fits else "direct",
        f"auto: {store_bytes / 1e9:.2f} GB of experts {'fit in' if fits else 'exceed'} half of "
        f"{avail / 1e9:.2f} GB available ({source})",
    )


def make_reader(strategy: str, root, queue_depth: int, cold_reads: bool, pacer=None) -> RangeReader:
    """The reader for `strategy` ("mmap", "pread" or "direct") over the files under `root`,
    paced by `pacer` (a StoragePacer) if given."""
    if strategy not in READERS:
        raise Edge0Error(f"expert reader io={strategy!r}: choose one of auto, {', '.join(STRATEGIES)}")
    return READERS[strategy](root, queue_depth, cold_reads, pacer)
