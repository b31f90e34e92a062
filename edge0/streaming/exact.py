"""Exact executor: per MoE layer and call, read only the selected experts (deduplicated) through
the store's reader (pread, direct or mmap: one read per expert-major row) and run them. Correct
for any route; one host sync of the routing indices per call."""

from __future__ import annotations

import time

import numpy as np

from edge0.backend import core as B
from edge0.store.reader import ExpertStore
from edge0.streaming.stats import ExecutorStats


def to_device(raw: dict, n: int, compute_dtype: str) -> dict:
    """Store bytes -> nested {projection: {part: array [n, ...]}}, floats in the compute dtype."""
    params: dict = {}
    for name, (buf, st_dtype, shape) in raw.items():
        a = B.from_raw(buf, st_dtype, (n, *shape))
        if st_dtype in ("F32", "F16", "BF16"):
            a = a.astype(B.dtype(compute_dtype))
        proj, part = name.rsplit(".", 1)
        params.setdefault(proj, {})[part] = a
    return params


def with_zero_row(params: dict) -> dict:
    """`params` [n, ...] with one more all-zero expert at index n: positions another part
    computes point there, and a zero expert's output is exactly zero."""
    return {
        p: {k: B.concatenate([v, B.zeros((1, *v.shape[1:]), v.dtype)]) for k, v in parts.items()}
        for p, parts in params.items()
    }


def raw_nbytes(raw: dict) -> int:
    return sum(b.nbytes for b, _, _ in raw.values())


class ExactExecutor:
    """The reference streaming path. `__call__(indices)` -> [(params, local indices)]."""

    name = "exact"

    def __init__(self, store: ExpertStore, layer: int, compute_dtype: str, stats: ExecutorStats):
        self.store, self.layer, self.dtype = store, layer, compute_dtype
        self.stats = stats.layer(layer)
        self.expert_nbytes = store.expert_nbytes(layer)
        self._start_early = False  # this call synced one token's route: start its output at `done`

    def routes_on_host(self) -> bool:
        """Whether the next call copies its route to the host (every call does here)."""
        return True

    def host_ids(self, indices) -> np.ndarray:
        self._synced(indices)
        return B.to_numpy(indices)

    def _synced(self, indices) -> None:
        """This call copies its route to the host: one sync; one token's output starts at `done`."""
        self.stats.host_syncs += 1
        self._start_early = indices.size <= indices.shape[-1]

    def read(self, ids) -> dict:
        """Read experts `ids` from storage (timed as stall); returns the store's bytes."""
        t0 = time.perf_counter()
        raw = self.store.read(self.layer, ids)
        s = self.stats
        s.stall_s += time.perf_counter() - t0
        s.loads += len(ids)
        s.bytes_read += raw_nbytes(raw)
        return raw

    def load(self, ids) -> tuple[dict, int]:
        """Read experts `ids` as device params (the conversion counts as stall); returns (params, bytes)."""
        raw = self.read(ids)
        t0 = time.perf_counter()
        params = to_device(raw, len(ids), self.dtype)
        self.stats.stall_s += time.perf_counter() - t0
        return params, raw_nbytes(raw)

    def run(self, ids: np.ndarray):
        uniq, inv = np.unique(ids, return_inverse=True)
        params, _ = self.load(uniq)
        s = self.stats
        s.calls += 1
        s.misses += len(uniq)
        s.bytes_used += len(uniq) * self.expert_nbytes
        s.distinct_experts.update(uniq.tolist())
        # np.unique sorts, so local ids keep the route's order and mlx-lm's sort path is unchanged.
        return [(params, B.array(inv.reshape(ids.shape).astype(np.uint32)))]

    def __call__(self, indices, scores=None):
        """`scores` (router scores) are for cache policies; the exact path has no cache."""
        return self.run(self.host_ids(indices))

    def done(self, y) -> None:
        """Called with the layer's output once its graph is built. After one token's host-routed
        call the layer's experts start computing now, while the host builds the next layer's graph
        up to its route (the next sync): otherwise the compute would wait for that graph."""
        if self._start_early:
            self._start_early = False
            B.async_eval(y)
