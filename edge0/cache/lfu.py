"""LFU: evict the least frequently used expert; ties go to the least recently used."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from edge0.cache.policy import Policy


class LFU(Policy):
    """Frequency is the number of steps in which the expert was routed since the cache was
    created, kept across evictions ("perfect" LFU): an expert that comes back keeps its history,
    which suits MoE routing, where expert popularity is stable. Among the least frequent, the one
    whose last use is oldest is evicted."""

    name = "lfu"

    def __init__(self, capacity: int, num_experts: int):
        super().__init__(capacity, num_experts)
        self.count = np.zeros(num_experts, dtype=np.int64)
        self.last = np.full(num_experts, -1, dtype=np.int64)

    def observe(self, step: int, routed: Sequence[int], scores) -> None:
        self.count[routed] += 1
        self.last[routed] = step

    def victim(self, cached: set[int], protected: set[int]) -> int:
        return min((e for e in cached if e not in protected), key=lambda e: (self.count[e], self.last[e]))
