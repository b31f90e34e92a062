"""Hot executor: a resident hot set per layer (the top-N experts by decayed use counts) computed
from stacked hot tensors; misses go through the exact path and the two parts are added.

Each (token, k) pair is computed by exactly one part; the other part maps it to an all-zero
expert row, whose output is exactly zero, so the sum equals the exact path bit for bit.
"""

from __future__ import annotations

import numpy as np

from edge0.backend import core as B
from edge0.streaming.exact import ExactExecutor
from edge0.streaming.pool import SlotSet


class HotExecutor(ExactExecutor):
    name = "hot"

    def __init__(self, store, layer, compute_dtype, stats, slots: SlotSet, decay: float = 0.95, refresh: int = 8):
        super().__init__(store, layer, compute_dtype, stats)
        self.slots = slots
        self.counts = np.zeros(slots.num_experts)
        self.decay, self.refresh = decay, refresh
        self.hot: set[int] = set()

    def _refresh_hot(self) -> None:
        """Swap the hot set to the current top-N by decayed counts (only changed slots)."""
        n = self.slots.n_slots
        want = set(np.argsort(-self.counts, kind="stable")[:n].tolist()) - {e for e in range(len(self.counts)) if self.counts[e] == 0}
        out, new = sorted(self.hot - want), sorted(want - self.hot)
        slots = self.slots.assign(new, out)
        # called while this step's graph, which reads the slots, is still unevaluated: scatter
        self.stats.slot_scatters += self.slots.apply(out, new, slots, self.read(new) if new else None)
        self.stats.slot_rewrites += len(new)
        self.hot = want

    def __call__(self, indices, scores=None):
        """The hot set follows its own use counts; router `scores` are not needed."""
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
            zero = len(missed)  # one extra all-zero row for the hot positions
            params = {p: {k: B.concatenate([v, B.zeros((1, *v.shape[1:]), v.dtype)]) for k, v in parts_.items()}
                      for p, parts_ in params.items()}
            local = np.where(hit, zero, np.searchsorted(missed, ids)).astype(np.uint32)
            parts.append((params, B.array(local)))
        if s.calls % self.refresh == 0:
            self._refresh_hot()
        return parts
