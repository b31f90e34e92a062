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
        self._used = None

    def __call__(self, indices, scores=None):
        """Reads the whole layer; router `scores` are not needed."""
        t0 = time.perf_counter()
        raw = self.prefetcher.take(self.layer)
        s = self.stats
        s.stall_s += time.perf_counter() - t0
        num = self.store.layers[self.layer]["num_experts"]
        params = to_device(raw, num, self.dtype)
        s.calls += 1
        s.loads += num
        s.bytes_read += raw_nbytes(raw)
        # Distinct experts used, counted on the device and read with the layer's output.
        self._used = (B.zeros((num,)).at[indices.flatten()].add(1.0) > 0).sum()
        return [(params, indices)]

    def done(self, y) -> None:
        """Compute the layer now, so its experts can be released before the next layer."""
        B.eval(y, self._used)
        self.stats.bytes_used += int(self._used.item()) * self.expert_nbytes
        self._used = None
