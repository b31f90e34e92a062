"""Reads one MoE layer ahead during decode: when a layer routes a token on the host, the next MoE
layer's route predicted from this layer's input (edge0/backend/lookahead.py) admits that layer's
predicted misses into its slots, and a reader thread writes them there while this layer computes
(StagedExecutor.read_ahead), instead of after the next layer has routed. The next layer finds
those it routes cached and reads the rest; what it never routes was read for nothing (counted as
wasted). Tokens never change: every layer still routes with its own gate.

`auto` (the default) reads ahead only for a layer whose predictions lately agreed with its
routes (at least RECALL_FLOOR of its routed experts, averaged over the last few steps): mostly
wrong predictions would take the disk from the reads a step needs, and their experts would take
slots from cached ones. A layer's first prediction is only scored, not read: a process's first
decode step would otherwise read a whole route per layer on faith (120 MB on the full bench model
for routes no hidden state predicts, docs/benchmarks.md). Its average starts at the floor, so one
agreeing first prediction starts the reads and one mostly wrong keeps them off. While a layer does not read, one
call in PROBE_EVERY still predicts and is scored, so a layer whose recall comes back reads ahead
again: a prediction costs a small matmul and a host copy each call, 2% of decode where
predictions never agree (docs/benchmarks.md). Reads out of the
page cache are read ahead too: the copy into the slots runs on the reader thread, off the
layer's critical path (docs/benchmarks.md)."""

from __future__ import annotations

import time

import numpy as np

from edge0.streaming.early import early_experts
from edge0.streaming.parts import SlottedAhead

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
        t = self.target
        t.read_ahead(ids, read=self.mode == "on" or (t.scored and t.recall >= RECALL_FLOOR))


class Prediction:
    """The layer before's prediction of a staged layer's next call (host ids: one token's best
    first, `ranked`; a batch's a sorted set): scored when that call routes (`recall`), and its
    experts, admitted into the layer's slots and written there by a reader thread (`read`), until
    the call lands them (`land`) and counts their use (`took`)."""

    def __init__(self, slots, stats, expert_nbytes: int):
        self.slots, self.stats, self.expert_nbytes = slots, stats, expert_nbytes
        self.ids: np.ndarray | None = None
        self.ranked = False  # `ids` are one token's, best first
        # how well predictions agreed lately (recall_after); at the floor to start with, so one
        # step of wrong predictions stops `auto` reading ahead (each costs a slot)
        self.recall = RECALL_FLOOR
        self.scored = False  # a prediction was scored: `auto` reads none ahead before
        self.slotted: SlottedAhead | None = None  # being written into the slots until `land`
        self.landed: SlottedAhead | None = None  # landed, until the call counts its use (`took`)

    def predict(self, ids: np.ndarray) -> None:
        """The next call's predicted route (host ids [.., K]): one token's keeps its order (best
        score first), a batch's is a set; ids past the layer's experts (a router's zero experts,
        LongCat) are dropped."""
        ids = np.asarray(ids)
        self.ranked = ids.size == ids.shape[-1]
        ids = ids.reshape(-1) if self.ranked else np.unique(ids)
        self.ids = ids[ids < self.slots.num_experts]

    def read(self, reader, store, layer: int) -> None:
        """Admit the whole prediction into the slots (those already cached are not evicted for
        the others) and start writing the experts it lacked there on `reader`."""
        # in id order: the store merges adjacent experts into one read
        self.slotted = SlottedAhead.start(reader, store, self.slots, layer, sorted(self.ids.tolist()))
        self.stats.lookahead_reads += 0 if self.slotted is None else len(self.slotted.loaded)

    def early(self, k: int, n: int) -> list[int]:
        """The experts a token's call (top-`k`) computes before its route (streaming/early.py)."""
        ids = self.ids if self.ranked else None
        return early_experts(ids, self.slots.slot_of, self.recall, self.slots.n_slots, k, n)

    def land(self) -> None:
        """The read's rows are in their slots (written by the reader, or scattered here when a
        tensor has no host view): point the table at them. If the read failed, the cache forgets
        the experts it admitted."""
        ahead, self.slotted = self.slotted, None
        if ahead is None:
            return
        t0 = time.perf_counter()
        try:
            nbytes, raw = ahead.read.result()
        except BaseException:
            self.slots.forget(ahead.evicted, ahead.loaded)
            raise
        finally:
            self.stats.stall_s += time.perf_counter() - t0
        s = self.stats
        s.loads += len(ahead.loaded)
        s.bytes_read += nbytes
        s.slot_rewrites += len(ahead.loaded)
        s.slot_scatters += self.slots.apply(ahead.evicted, ahead.loaded, ahead.slots, raw, in_place=True)
        self.landed = ahead

    def took(self, routed, keep=()) -> int:
        """Count the landed experts' use by the call routing `routed` (host ids), and drop those it
        does not route from the cache (but `keep`), before the call plans: a wrong prediction
        frees its slot for the call's misses instead of keeping a cached expert out. Returns how
        many of the routed were read ahead (the plan finds them cached, but they were misses)."""
        landed, self.landed = self.landed, None
        if landed is None:
            return 0
        routed_set = set(np.reshape(routed, -1).tolist()) | set(keep)
        self.slots.drop([e for e in landed.loaded if e not in routed_set])
        return landed.count_use(self.stats, routed, self.expert_nbytes)

    def score(self, routed: np.ndarray) -> None:
        """The call's route (host ids) against the prediction, into the recall; the prediction is
        spent."""
        if self.ids is None:
            return
        n, agreed = agreement(self.ids, routed)
        self.stats.lookahead_predicted += n
        self.stats.lookahead_agreed += agreed
        self.recall, self.ids, self.scored = recall_after(self.recall, n, agreed), None, True


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
