"""Hot executor: a resident hot set per layer (the top-N experts by decayed use counts) computed
from stacked hot tensors; misses go through the exact path and the two parts are added.

Each (token, k) pair is computed by exactly one part; the other part maps it to an all-zero
expert row, whose output is exactly zero, so the sum equals the exact path bit for bit.

The hot set is refreshed at the start of a call, before that call's parts are built: the parts
hand the slot tensors themselves to the layer, so a refresh after building them would run this
call's hot positions (mapped by the old table) on the new slot contents. At that point nothing
launched reads this layer's slots (the engine's invariant, see staged.py), so slots are
rewritten in place.
"""

from __future__ import annotations

import numpy as np

from edge0.backend import core as B
from edge0.streaming.exact import ExactExecutor, with_zero_row
from edge0.streaming.pool import SlotSet


class HotExecutor(ExactExecutor):
    name = "hot"

    def __init__(self, store, layer, compute_dtype, stats, slots: SlotSet, decay: float = 0.95, refresh: int = 8):
        super().__init__(store, layer, compute_dtype, stats)
        self.slots = slots
        self.counts = np.zeros(slots.num_experts)
        self.decay, self.refresh = decay, refresh
        self.hot: set[int] = set()
        self.due = False  # a refresh is due at the start of the next call

    def _refresh_hot(self) -> None:
        """Swap the hot set to the current top-N by decayed counts (only changed slots, in place:
        called only where no launched computation reads this layer's slots)."""
        n = self.slots.n_slots
        want = set(np.argsort(-self.counts, kind="stable")[:n].tolist()) - {
            e for e in range(len(self.counts)) if self.counts[e] == 0
        }
        out, new = sorted(self.hot - want), sorted(want - self.hot)
        slots = self.slots.assign(new, out)
        self.stats.slot_scatters += self.slots.apply(out, new, slots, self.read(new) if new else None, in_place=True)
        self.stats.slot_rewrites += len(new)
        self.hot = want
        self.due = False

    def resize(self, n_slots: int) -> None:
        """Between generations: `n_slots` slots, keeping the hottest of the hot set."""
        keep = sorted(self.hot, key=lambda e: (-self.counts[e], e))[:n_slots]
        self.slots.resize(n_slots, keep)
        self.hot = set(keep)

    def __call__(self, indices, scores=None):
        """The hot set follows its own use counts; router `scores` are not needed."""
        if self.due:  # before this call's parts exist: they read the slots and the table as they are now
            self._refresh_hot()
        ids = self.host_ids(indices)
        uniq = np.unique(ids)
        s = self.stats
        s.calls += 1
        s.bytes_used += len(uniq) * self.expert_nbytes
        s.distinct_experts.update(uniq.tolist())
        self.counts *= self.decay
        self.counts[uniq] += 1
        hit = np.isin(ids, list(self.hot))
        n_hit = len(set(uniq.tolist()) & self.hot)
        s.hits += n_hit
        s.misses += len(uniq) - n_hit
        parts = []
        if hit.any():
            local = np.where(hit, self.slots.table_host[ids], self.slots.zero).astype(np.uint32)
            parts.append((self.slots.params, B.array(local)))
        if not hit.all():
            missed = np.unique(ids[~hit])
            params, _ = self.load(missed)
            local = np.where(hit, len(missed), np.searchsorted(missed, ids)).astype(np.uint32)
            parts.append((with_zero_row(params), B.array(local)))  # hot positions -> the zero row
        self.due = s.calls % self.refresh == 0
        return parts
