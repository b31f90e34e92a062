"""Reads one MoE layer ahead during decode: when a layer routes a token on the host, the next MoE
layer's route predicted from this layer's input (edge0/backend/lookahead.py) starts that layer's
predicted misses reading, so they arrive while this layer computes instead of after the next
layer has routed. The next layer takes them where its own route agrees and reads the rest; what
it never routes was read for nothing (counted as wasted). Tokens never change: every layer
still routes with its own gate.

`auto` (the default) reads ahead only for a layer whose predictions lately agreed with its
routes (at least RECALL_FLOOR of its routed experts, averaged over the last few steps): mostly
wrong predictions would take the disk from the reads a step needs. Predictions are still scored
while it does not read, so a layer whose recall comes back reads ahead again. Nor does it read
ahead for a layer whose on-demand reads lately came mostly from the page cache (the reader
thread's `read_bytes`, Linux): those are copies, whose cost is CPU time that overlapping does not
hide (measured: 7-10% slower warm decode on two cores, docs/benchmarks.md)."""

from __future__ import annotations

import numpy as np

MODES = ("auto", "on", "off")
RECALL_FLOOR = 0.5
RECALL_DECAY = 0.8  # a step's weight in the recall halves in about 3 steps
STORAGE_FLOOR = 0.5  # read ahead only for a layer whose on-demand bytes came at least this much from storage


class Lookahead:
    """One MoE layer's read-ahead for the next one (`target`, a staged executor)."""

    def __init__(self, target, mode: str):
        self.target, self.mode = target, mode

    def wanted(self, executor) -> bool:
        """Whether this call should predict: `executor` routes it on the host (one sync, which the
        prediction joins) and the next layer will too (a staged route needs no read-ahead)."""
        return executor.routes_on_host() and self.target.takes_predictions()

    def issue(self, ids: np.ndarray) -> None:
        """The next layer's predicted route (host ids [.., K]): scored there, and read ahead unless
        `auto` finds its recall below the floor."""
        t = self.target
        from_disk = t.storage_share is None or t.storage_share >= STORAGE_FLOOR
        self.target.read_ahead(ids, read=self.mode == "on" or (t.recall >= RECALL_FLOOR and from_disk))


def updated_recall(recall: float, predicted: np.ndarray, routed: np.ndarray) -> float:
    """The recall average after a route `routed` (host ids) that `predicted` foretold."""
    routed = np.unique(routed)
    agreed = np.isin(routed, predicted).sum() / max(1, len(routed))
    return RECALL_DECAY * recall + (1 - RECALL_DECAY) * float(agreed)


def updated_storage_share(share: float | None, from_storage: int, nbytes: int) -> float:
    """The storage share average (None: none yet) after an on-demand read of `nbytes` bytes,
    `from_storage` of them from storage (the rest copied out of the page cache)."""
    now = min(1.0, from_storage / max(1, nbytes))
    return now if share is None else RECALL_DECAY * share + (1 - RECALL_DECAY) * now
