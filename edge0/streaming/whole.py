"""Whole-layer executor (prefill): a layer's experts arrive in large sequential reads of its
expert-major file (8 MiB pieces, several in flight), layer N+1 is read on a background thread while
layer N computes, and each layer is released once computed, so peak memory stays at two layers."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from edge0.backend import core as B
from edge0.streaming.exact import ExactExecutor, raw_nbytes, to_device


class LayerPrefetcher:
    """Reads whole layers ahead, one at a time, on a background thread."""

    def __init__(self, store, order: list[int], reader: ThreadPoolExecutor):
        self.store, self.order, self.reader = store, order, reader
        self.pending = {}

    def start(self, layer: int) -> None:
        if layer not in self.pending:
            self.pending[layer] = self.reader.submit(self.store.read_layer, layer)

    def take(self, layer: int):
        """The layer's raw tensors (waiting for the read if needed); prefetches the next layer."""
        self.start(layer)
        raw = self.pending.pop(layer).result()
        i = self.order.index(layer)
        if i + 1 < len(self.order):
            self.start(self.order[i + 1])
        return raw

    def cancel(self) -> None:
        for f in self.pending.values():
            f.cancel()
        self.pending.clear()


class WholeLayerExecutor(ExactExecutor):
    name = "whole"

    def __init__(self, store, layer, compute_dtype, stats, prefetcher: LayerPrefetcher):
        super().__init__(store, layer, compute_dtype, stats)
        self.prefetcher = prefetcher
        self.num_experts = int(store.layers[layer]["num_experts"])
        self._used = None  # device mask of the experts the call (or the held span) used
        self.holding = False
        self._params = None
        # fn(params, routes): each whole layer read, once computed, with its last call's host route
        # [.., K] (the decode slots fill from it: StagedExecutor.fill)
        self.on_read = None
        self._call = None  # (params, route) of the call in progress, until its `done`
        self._last = None  # ... of a held span's last computed call, until `release`

    def hold(self) -> None:
        """Start reading the layer, and keep its experts from the first call until `release` (a
        layer-major prefill span computes its MoE in several token chunks over one read)."""
        self.prefetcher.start(self.layer)
        self.holding = True

    def release(self) -> None:
        """Count the experts the held span used and let its tensors go."""
        if self._used is not None:
            self._count_used()
        failed = self._call is not None  # a call that never reached `done`: nothing to hand on
        last, self._last, self._call = self._last, None, None
        if not failed:
            self._hand_read(last)
        self.holding, self._params = False, None

    def _load(self) -> dict:
        t0 = time.perf_counter()
        raw = self.prefetcher.take(self.layer)
        s = self.stats
        s.stall_s += time.perf_counter() - t0
        s.calls += 1
        s.loads += self.num_experts
        s.bytes_read += raw_nbytes(raw)
        return to_device(raw, self.num_experts, self.dtype)

    def __call__(self, indices, scores=None):
        """Reads the whole layer (once per held span); router `scores` are not needed."""
        self._call = None  # a failed call's, released before this one loads
        params = self._params if self.holding and self._params is not None else self._load()
        if self.holding:
            self._params = params
        used = B.zeros((self.num_experts,)).at[indices.flatten()].add(1.0) > 0
        self._used = used if self._used is None else (self._used | used)
        if self.on_read is not None:
            self._call = (params, indices)
        return [(params, indices)]

    def done(self, y) -> None:
        """Compute the layer now, so its experts can be released before the next layer."""
        B.eval(y, self._used)
        computed, self._call = self._call, None
        if self.holding:
            self._last = computed
        else:
            self._count_used()
            self._hand_read(computed)

    def _hand_read(self, call) -> None:
        """A computed call's experts and route (evaluated with its output) to `on_read`."""
        if call is not None:
            self.on_read(call[0], B.to_numpy(call[1]))

    def _count_used(self) -> None:
        self.stats.bytes_used += int(self._used.sum().item()) * self.expert_nbytes
        self._used = None
