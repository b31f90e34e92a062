"""Belady's MIN: evict the cached expert whose next use is farthest in the future. Offline
only (it reads the future); the upper bound every online policy is measured against."""

from __future__ import annotations

import math
from typing import Sequence

from edge0.cache.policy import Policy


class Belady(Policy):
    """`future[s]` is the route of step s (the same sequence the cache will be given). An expert
    never used again has next use +inf; ties are broken by the lowest expert id."""

    name = "belady"

    def __init__(self, capacity: int, num_experts: int, future: Sequence[Sequence[int]] = None):
        super().__init__(capacity, num_experts)
        if future is None:
            raise ValueError("belady needs the future: make_policy('belady', ..., future=routes)")
        self.uses: list[list[int]] = [[] for _ in range(num_experts)]
        for s, route in enumerate(future):
            for e in set(int(x) for x in route):
                self.uses[e].append(s)
        self.ptr = [0] * num_experts
        self.next_use = [math.inf] * num_experts
        self.step = -1

    def observe(self, step: int, routed: Sequence[int], scores) -> None:
        self.step = step
        # Only routed experts' next use changes: everyone else's next use is still ahead.
        for e in routed:
            uses, i = self.uses[e], self.ptr[e]
            while i < len(uses) and uses[i] <= step:
                i += 1
            self.ptr[e] = i
            self.next_use[e] = uses[i] if i < len(uses) else math.inf

    def victim(self, cached: set[int], protected: set[int]) -> int:
        return max((e for e in cached if e not in protected), key=lambda e: (self.next_use[e], -e))
