"""Exact executor: per MoE layer and step, read only the selected experts (deduplicated) through
mmap and run them. Correct for any route; one host sync of the routing indices per layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge0.backend import core as B
from edge0.store.reader import ExpertStore


@dataclass
class LayerStats:
    calls: int = 0
    host_syncs: int = 0
    experts_loaded: int = 0
    bytes_read: int = 0
    distinct_experts: set = field(default_factory=set)


@dataclass
class ExecutorStats:
    layers: dict = field(default_factory=dict)

    def layer(self, n: int) -> LayerStats:
        return self.layers.setdefault(n, LayerStats())

    def totals(self) -> dict:
        keys = ("calls", "host_syncs", "experts_loaded", "bytes_read")
        out = {k: sum(getattr(s, k) for s in self.layers.values()) for k in keys}
        out["distinct_experts"] = sum(len(s.distinct_experts) for s in self.layers.values())
        return out


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


class ExactExecutor:
    def __init__(self, store: ExpertStore, layer: int, compute_dtype: str, stats: ExecutorStats):
        self.store, self.layer, self.dtype = store, layer, compute_dtype
        self.stats = stats.layer(layer)

    def __call__(self, indices):
        ids = B.to_numpy(indices)  # the host sync: which experts to read
        uniq, inv = np.unique(ids, return_inverse=True)
        raw = self.store.read(self.layer, uniq)
        s = self.stats
        s.calls += 1
        s.host_syncs += 1
        s.experts_loaded += len(uniq)
        s.distinct_experts.update(uniq.tolist())
        s.bytes_read += sum(b.nbytes for b, _, _ in raw.values())
        # np.unique sorts, so local ids keep the route's order and mlx-lm's sort path is unchanged.
        return to_device(raw, len(uniq), self.dtype), B.array(inv.reshape(ids.shape).astype(np.uint32))
