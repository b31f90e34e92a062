"""The staged executor's pieces (streaming/staged.py) as types: the next step's stage until its
swap, experts read ahead of the call that may route them, a call's own read, and the deferred
part that computes a call's misses once their bytes are in."""

from __future__ import annotations

from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Callable, Literal

import numpy as np

from edge0.store.pacing import thread_storage_bytes
from edge0.streaming.exact import raw_nbytes


@dataclass(frozen=True)
class Staged:
    """The next step's experts, already planned into the slots and read in the background, kept
    until the step boundary writes them (a step in flight never sees the next step's set)."""

    evicted: list[int]
    loaded: list[int]  # they take `slots`, from the bytes `read` returns
    slots: list[int]
    read: Future | None  # None when every expert was cached
    alias: dict[int, int]  # {routed: substitute} for that step only
    one_row: bool  # one sequence's route, which the step may trust; a batch's union it may not


@dataclass(frozen=True)
class ReadAhead:
    """Experts read before the call that may route them: a batch's staged union beyond the slots
    ("batch") or the layer before's prediction ("lookahead"). That call takes those it routes;
    the others were read for nothing."""

    ids: np.ndarray
    read: Future
    kind: Literal["batch", "lookahead"]

    @classmethod
    def start(cls, reader: Executor, store, layer: int, ids: list[int], kind) -> ReadAhead:
        """Start reading experts `ids` of `layer` on `reader`."""
        return cls(np.array(ids), reader.submit(store.read, layer, ids), kind)

    def count_use(self, stats, want, expert_nbytes: int) -> None:
        """Count how many of these experts the call that took them routes (`want`), and for a
        prediction the bytes of the others (wasted)."""
        used = int(np.isin(self.ids, want).sum())
        if self.kind == "lookahead":
            stats.lookahead_used += used
            stats.lookahead_wasted_bytes += (len(self.ids) - used) * expert_nbytes
        else:
            stats.beyond_ahead_used += used


@dataclass(frozen=True)
class CallRead:
    """A call's store bytes as read, not yet counted (a reader thread makes it, the executor
    counts it): a read ahead's, and those of the experts it lacked, read now."""

    ahead: ReadAhead | None
    ahead_raw: dict | None  # the read ahead's bytes
    missing: np.ndarray  # the experts the read ahead lacked
    more: dict | None  # their bytes, read now (None if none)
    from_storage: int | None  # bytes of `more` that came from storage, not the page cache (None: unknown)

    def count(self, stats, want, expert_nbytes: int) -> None:
        """Count the experts and bytes read, and the read ahead's use by the call's `want`."""
        if self.ahead is not None:
            stats.loads += len(self.ahead.ids)
            stats.bytes_read += raw_nbytes(self.ahead_raw)
            self.ahead.count_use(stats, want, expert_nbytes)
        if self.more is not None:
            stats.loads += len(self.missing)
            stats.bytes_read += raw_nbytes(self.more)

    def bytes_of(self, want) -> dict | None:
        """The store bytes of experts `want`, in that order (None if none)."""
        if not len(want):
            return None
        if self.ahead is None:
            return self.more
        ids, raw = self.ahead.ids, self.ahead_raw
        if len(self.missing):
            ids = np.concatenate([ids, self.missing])
            raw = {n: (np.concatenate([b, self.more[n][0]]), d, shape) for n, (b, d, shape) in raw.items()}
        at = {int(e): i for i, e in enumerate(ids)}
        pick = np.array([at[int(e)] for e in want])
        return {n: (b[pick], d, shape) for n, (b, d, shape) in raw.items()}


def read_call(store, layer: int, want, ahead: ReadAhead | None) -> CallRead:
    """Wait for the read ahead `ahead` and read the experts of `want` it lacks; no bookkeeping, so
    it may run on a reader thread."""
    raw = None if ahead is None else ahead.read.result()
    missing = np.asarray(want, dtype=np.int64)
    if ahead is not None:
        missing = missing[~np.isin(missing, ahead.ids)]
    if not len(missing):
        return CallRead(ahead, raw, missing, None, None)
    before = thread_storage_bytes()
    more = store.read(layer, missing)
    after = thread_storage_bytes()
    return CallRead(ahead, raw, missing, more, None if before is None or after is None else after - before)


@dataclass(eq=False)
class DeferredPart:
    """A call's misses part, handed to the layer after the call's other parts so their compute
    overlaps this read: called, it waits for the bytes and makes its part, once."""

    misses: list[int]  # the experts `read` returns: `loaded` first, then any read for this call only
    evicted: list[int]
    loaded: list[int]  # they take `slots`
    slots: list[int]
    read: Future  # of a CallRead of `misses`
    part_of: Callable[[dict], tuple]  # the misses' store bytes -> the part
    # the executor's: write `loaded` into their slots and make the part (`route`: run its route hook)
    land: Callable[[DeferredPart, bool], tuple]
    made: tuple | None = field(default=None, init=False)

    def __call__(self, route: bool = True) -> tuple:
        if self.made is None:
            self.made = self.land(self, route)
        return self.made
