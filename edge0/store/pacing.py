"""A slower disk in front of the real one: expert reads paced to a fixed bandwidth.

`edge0 bench --read-limit` throttles a cgroup, and the kernel's throttle credits idle time: a
read that follows a pause passes far faster than the limit (128 KB reads measured 265 MB/s under
a 20 MB/s limit with 30 ms pauses, 20 MB/s back to back; docs/benchmarks.md). So a workload that
reads a little between bursts of compute (one sequence decoding) reads faster than one that
reads in larger bursts (a batch), which a disk of that bandwidth would not do. The pacer models
the disk: every read's bytes from storage queue behind the bytes before them, and a read
completes no sooner than `start + bytes / rate`, where `start` is when it was issued or when the
disk finished the reads before it, whichever is later. Idle time earns nothing.

Only bytes that came from storage count: the calling thread's `read_bytes` in
/proc/thread-self/io (Linux), so page-cache hits are free, as they are on a real disk. Where
that file is missing (macOS), every byte a read asks for counts, and `stats()` says so.
"""

from __future__ import annotations

import threading
import time

_IO = "/proc/thread-self/io"


def thread_storage_bytes() -> int | None:
    """Bytes the calling thread has read from storage (Linux `read_bytes`), or None where the
    kernel does not say. Opened per call: a descriptor kept per thread would outlive pool threads."""
    try:
        with open(_IO, "rb") as f:
            text = f.read()
    except OSError:
        return None
    for line in text.split(b"\n"):
        if line.startswith(b"read_bytes:"):
            return int(line.split()[1])
    return None


class StoragePacer:
    """A disk of `rate` bytes/s shared by every reader thread of one store. `clock` and `sleep`
    are injectable so tests check the schedule without waiting."""

    def __init__(self, rate: int, clock=time.monotonic, sleep=time.sleep, measure=thread_storage_bytes):
        if rate <= 0:
            raise ValueError(f"pacing rate {rate}: must be > 0 bytes/s")
        self.rate, self.clock, self.sleep, self.measure = rate, clock, sleep, measure
        self._lock = threading.Lock()
        self._busy_until = 0.0
        self.reads = self.bytes = 0
        self.waited_s = 0.0
        self.measured = True  # every read's bytes came from the kernel's count (else: bytes asked for)

    def read(self, fn, nbytes: int) -> None:
        """Run `fn()` (one read of `nbytes`) and return no sooner than the paced disk would."""
        issued, before = self.clock(), self.measure()
        fn()
        after = self.measure() if before is not None else None
        self.complete(issued, nbytes if after is None else after - before, measured=after is not None)

    def complete(self, issued: float, storage_bytes: int, measured: bool = True) -> float:
        """A read issued at `issued` brought `storage_bytes` from storage: wait until the paced
        disk has delivered them; returns the seconds waited."""
        with self._lock:
            start = max(issued, self._busy_until)
            done = start + storage_bytes / self.rate
            self._busy_until = done
            self.reads += 1
            self.bytes += storage_bytes
            self.measured = self.measured and measured
        wait = done - self.clock()
        if wait <= 0:
            return 0.0
        self.sleep(wait)
        with self._lock:
            self.waited_s += wait
        return wait

    def stats(self) -> dict:
        with self._lock:
            return {
                "rate_bytes_per_s": self.rate,
                "reads": self.reads,
                "storage_bytes": self.bytes,
                "waited_s": self.waited_s,
                "storage_bytes_source": "kernel (read_bytes)" if self.measured else "bytes asked for",
            }
