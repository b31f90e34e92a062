"""The staged executor's pieces (streaming/staged.py) as types: the next step's stage until its
swap, experts read ahead of the call that may route them, a call's own read, and the deferred
part that computes a call's misses once their bytes are in."""

from __future__ import annotations

from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

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
    """A batch's staged union beyond the slots, read before the step's call, which takes those it
    routes; the others were read for nothing."""

    ids: np.ndarray
    read: Future

    @classmethod
    def start(cls, reader: Executor, store, layer: int, ids: list[int]) -> ReadAhead:
        """Start reading experts `ids` of `layer` on `reader`."""
        return cls(np.array(ids), reader.submit(store.read, layer, ids))

    def count_use(self, stats, want) -> None:
        """Count how many of these experts the call that took them routes (`want`)."""
        stats.beyond_ahead_used += int(np.isin(self.ids, want).sum())


@dataclass(frozen=True)
class SlottedAhead:
    """The layer before's prediction of a call's experts, admitted into the slots and written
    there by a reader thread while the layer before computes (`read_into_slots`): the call finds
    them cached. What it routes of them is used; the rest were read for nothing."""

    loaded: list[int]  # they take `slots`
    evicted: list[int]
    slots: list[int]
    read: Future  # of read_into_slots: (bytes read, None if written into the slots, else the bytes)

    @classmethod
    def start(cls, reader: Executor, store, slotset, layer: int, ids: list[int]) -> SlottedAhead | None:
        """Admit experts `ids` of `layer` into `slotset` and start reading those it lacked into their
        slots; None if it lacked none."""
        loaded, evicted, slots = slotset.admit(ids)
        if not loaded:
            return None
        return cls(loaded, evicted, slots, reader.submit(read_into_slots, store, slotset, layer, loaded, slots))

    def count_use(self, stats, want, expert_nbytes: int) -> int:
        """Count how many of these experts the call routes (`want`, its experts), and the bytes of
        the others (wasted); returns the number used."""
        routed = set(np.reshape(want, -1).tolist())
        used = sum(e in routed for e in self.loaded)
        stats.lookahead_used += used
        stats.lookahead_wasted_bytes += (len(self.loaded) - used) * expert_nbytes
        return used


def read_into_slots(store, slotset, layer: int, ids: list[int], slots: list[int]) -> tuple[int, dict | None]:
    """Read experts `ids` of `layer` into `slots` of `slotset`: the tensors stored as their values
    straight into the slot rows, the others widened there (SlotSet.write); no bookkeeping, so it
    runs on a reader thread. Returns (bytes read, None; or the bytes where a tensor has no host
    view, for the caller to scatter)."""
    raw = store.read(layer, ids, slotset.direct_rows(slots))
    return len(ids) * store.expert_nbytes(layer), None if slotset.write(slots, raw) else raw


@dataclass(frozen=True)
class CallRead:
    """A call's store bytes as read, not yet counted (a reader thread makes it, the executor
    counts it): a read ahead's, and those of the experts it lacked, read now."""

    ahead: ReadAhead | None
    ahead_raw: dict | None  # the read ahead's bytes
    missing: np.ndarray  # the experts the read ahead lacked
    more: dict | None  # their bytes, read now (None if none)

    def count(self, stats, want) -> None:
        """Count the experts and bytes read, and the read ahead's use by the call's `want`."""
        if self.ahead is not None:
            stats.loads += len(self.ahead.ids)
            stats.bytes_read += raw_nbytes(self.ahead_raw)
            self.ahead.count_use(stats, want)
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
        return CallRead(ahead, raw, missing, None)
    return CallRead(ahead, raw, missing, store.read(layer, missing))


@dataclass(eq=False)
class DeferredPart:
    """A call's misses part, handed to the layer after the call's other parts so their compute
    overlaps this read: called, it waits for the bytes and makes its part, once."""

    misses: list[int]  # the experts `read` returns: the plan's `loaded` first, then any read for this call only
    # () -> (evicted, loaded, slots): the call's plan, made when the part is called (a token's
    # bookkeeping waits until its hits compute) or before
    plan: Callable[[], tuple[list[int], list[int], list[int]]]
    read: Callable[[], CallRead]  # reads `misses` (read_call), on the caller's thread
    # no read ahead to take: when every miss takes a slot, they are read straight into their slots
    # (read_into_slots), with no block of fresh bytes to allocate and copy from
    direct: bool
    part_of: Callable[[dict, list[int]], tuple]  # (the misses' store bytes, the plan's loaded) -> the part
    # the executor's: write `loaded` into their slots and make the part (`route`: run its route hook)
    land: Callable[[DeferredPart, bool], tuple]
    made: tuple | None = field(default=None, init=False)

    def __call__(self, route: bool = True) -> tuple:
        if self.made is None:
            self.made = self.land(self, route)
        return self.made
