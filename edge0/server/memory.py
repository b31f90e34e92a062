"""Memory pressure while serving: when the memory the machine has left (MemAvailable, or the
process's cgroup limit where tighter) falls below `--memory-low`, shrink the expert cache between
requests, down to one route's worth of slots (top-k per MoE layer); grow it back, up to the size
it was loaded with, once memory is free again. Outputs do not change: an expert that left the
cache is read again when a route needs it.

A thread polls the reading every `--memory-poll-s` seconds; resizing runs on the engine thread
(Scheduler.run_between and after every request), so never while a generation is in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from edge0.backend.memory import available as memory_available
from edge0.units import format_size

log = logging.getLogger("edge0.server")

DEFAULT_POLL_S = 2.0
DEFAULT_LOW_SHARE = 0.10  # of the memory available when the server starts
DEFAULT_LOW_CAP = 2 * 10**9


def default_memory_low(available: int) -> int:
    """The default threshold: 10% of the memory available at start, at most 2 GB."""
    return min(DEFAULT_LOW_CAP, int(available * DEFAULT_LOW_SHARE))


class MemoryWatcher:
    """Resizes `engine`'s expert cache from readings of `read()` -> (bytes available, source)."""

    def __init__(
        self, engine, low: int, poll_s: float = DEFAULT_POLL_S, read: Callable[[], tuple[int, str]] = memory_available
    ):
        self.engine, self.low, self.poll_s, self.read = engine, low, poll_s, read
        self.slot_bytes = engine.expert_cache()["slot_bytes"]
        # A shrink aims for `high` available and a grow must leave `high`: the gap (a quarter of
        # `low`, at least one slot) keeps one resize from triggering the opposite one.
        self.high = low + max(low // 4, self.slot_bytes)
        self.shrinks = self.grows = self.low_at_floor = self.prompt_cache_frees = 0
        self.reading: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def target(self, available: int) -> int:
        """Slots per MoE layer wanted with `available` bytes of memory left."""
        info = self.engine.expert_cache()
        n = info["slots_per_layer"]
        if available < self.low:
            return max(info["min_slots"], n - -(-(self.high - available) // self.slot_bytes))
        if available > self.high + self.slot_bytes and n < info["configured_slots"]:
            return min(info["configured_slots"], n + (available - self.high) // self.slot_bytes)
        return n

    def check(self) -> bool:
        """Read memory now; True when the expert cache should be resized, or memory is low while
        other conversations' KV caches are held (they go first)."""
        available, source = self.read()
        self.reading = {"available_bytes": available, "source": source, "at": time.time()}
        if available < self.low and self.engine.prompt_caches_held() > 0:
            return True
        return self.target(available) != self.engine.expert_cache()["slots_per_layer"]

    def apply(self) -> None:
        """On the engine thread, between requests: read memory; when it is low, other
        conversations' KV caches kept in memory go first (to disk), then the expert cache shrinks if
        that was not enough; when it is back, both may grow again."""
        due = self.check()
        available = self.reading["available_bytes"]
        if available < self.low:
            freed = self.engine.free_prompt_caches(self.high - available)
            if freed:
                self.prompt_cache_frees += 1
                log.info(
                    "memory %s available: %s of other conversations' KV caches moved out of memory",
                    format_size(available),
                    format_size(freed),
                )
                due = self.check()
        elif available > self.high:
            self.engine.restore_prompt_caches()
        info = self.engine.expert_cache()
        n, available = info["slots_per_layer"], self.reading["available_bytes"]
        if available < self.low and n == info["min_slots"]:
            self.low_at_floor += 1
            if self.low_at_floor == 1:
                log.warning(
                    "memory low (%s available, --memory-low %s) and the expert cache is at its floor "
                    "(%d slots per layer: one route)",
                    format_size(available),
                    format_size(self.low),
                    n,
                )
        if not due:
            return
        want = self.target(available)
        self.engine.resize_expert_cache(want)
        if want < n:
            self.shrinks += 1
        else:
            self.grows += 1
        log.info(
            "memory %s available (%s): expert cache %d -> %d slots per layer (%s)",
            format_size(available),
            self.reading["source"],
            n,
            want,
            format_size(self.engine.expert_cache()["budget_bytes"]),
        )

    def start(self, run_between: Callable[[Callable[[], None]], None]) -> None:
        """Poll in a daemon thread; hand `apply` to `run_between` (the engine thread) when due."""

        def loop():
            while not self._stop.wait(self.poll_s):
                try:
                    if self.check():
                        run_between(self.apply)
                except Exception:  # a failed reading must not end the watch
                    log.exception("memory watcher: reading memory failed")

        self._thread = threading.Thread(target=loop, name="edge0-memory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict:
        """Thresholds, the cache's size now, resizes so far, and the last reading."""
        info = self.engine.expert_cache()
        return {
            "low_bytes": self.low,
            "high_bytes": self.high,
            "poll_s": self.poll_s,
            "budget_bytes": info["budget_bytes"],
            "slots_per_layer": info["slots_per_layer"],
            "min_slots": info["min_slots"],
            "configured_slots": info["configured_slots"],
            "shrinks": self.shrinks,
            "grows": self.grows,
            "low_at_floor": self.low_at_floor,
            "prompt_cache_frees": self.prompt_cache_frees,
            "last_reading": self.reading,
        }
