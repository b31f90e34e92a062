"""Reads one MoE layer ahead during decode: when a layer routes a token on the host, the next MoE
layer's route predicted from this layer's input (edge0/backend/lookahead.py) admits that layer's
predicted misses into its slots, and a reader thread writes them there while this layer computes
(StagedExecutor.read_ahead), instead of after the next layer has routed. The next layer finds
those it routes cached and reads the rest; what it never routes was read for nothing (counted as
wasted). Tokens never change: every layer still routes with its own gate.

`auto` (the default) reads ahead only for a layer whose predictions lately agreed with its
routes (at least RECALL_FLOOR of its routed experts, averaged over the last few steps): mostly
wrong predictions would take the disk from the reads a step needs, and their experts would take
slots from cached ones. A layer's average starts at the floor, so its first prediction is read
ahead and one step in which most of it is wrong stops the next. While a layer does not read, one
call in PROBE_EVERY still predicts and is scored, so a layer whose recall comes back reads ahead
again: a prediction costs a small matmul and a host copy each call, 2% of decode where
predictions never agree (docs/benchmarks.md). Reads out of the
page cache are read ahead too: the copy into the slots runs on the reader thread, off the
layer's critical path (docs/benchmarks.md)."""

from __future__ import annotations

import numpy as np

MODES = ("auto", "on", "off")
RECALL_FLOOR = 0.5
RECALL_DECAY = 0.8  # a step's weight in the recall halves in about 3 steps
PROBE_EVERY = 8  # below the floor, `auto` predicts one call in this many (to score it)


class Lookahead:
    """One MoE layer's read-ahead for the next one (`target`, a staged executor)."""

    def __init__(self, target, mode: str):
        self.target, self.mode = target, mode
        self.skipped = 0  # calls not predicted since the last prediction (auto, below the floor)

    def wanted(self, executor) -> bool:
        """Whether this call should predict: `executor` routes it on the host (one sync, which the
        prediction joins) and the next layer will too (a staged route needs no read-ahead), and
        the prediction would be read ahead, or it is `auto`'s probe below the floor."""
        if not (executor.routes_on_host() and self.target.takes_predictions()):
            return False
        if self.mode == "on" or self.target.recall >= RECALL_FLOOR or self.skipped >= PROBE_EVERY - 1:
            self.skipped = 0
            return True
        self.skipped += 1
        return False

    def issue(self, ids: np.ndarray) -> None:
        """The next layer's predicted route (host ids [.., K]): scored there, and read ahead unless
        `auto` finds its recall below the floor."""
        self.target.read_ahead(ids, read=self.mode == "on" or self.target.recall >= RECALL_FLOOR)


def agreement(predicted: np.ndarray, routed: np.ndarray) -> tuple[int, int]:
    """(distinct experts of a route `routed`, how many of them `predicted` foretold); host ids."""
    routed = set(np.reshape(routed, -1).tolist())  # sets: np.isin costs ~0.1 ms a call here
    return len(routed), len(routed & set(np.reshape(predicted, -1).tolist()))


def recall_after(recall: float, routed: int, agreed: int) -> float:
    """The recall average after a route of `routed` distinct experts, `agreed` of them predicted."""
    return RECALL_DECAY * recall + (1 - RECALL_DECAY) * agreed / max(1, routed)


def updated_recall(recall: float, predicted: np.ndarray, routed: np.ndarray) -> float:
    """The recall average after a route `routed` (host ids) that `predicted` foretold."""
    return recall_after(recall, *agreement(predicted, routed))
