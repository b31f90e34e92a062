"""The eviction-policy interface and LRU, the default.

A policy serves one MoE layer. `ExpertCache` owns membership (which experts are cached) and
asks the policy only two things: to observe each step's route, and to pick a victim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Sequence

import numpy as np


class Policy(ABC):
    """Eviction policy for one layer's expert cache of `capacity` experts out of `num_experts`."""

    name = "?"

    def __init__(self, capacity: int, num_experts: int):
        self.capacity, self.num_experts = capacity, num_experts

    def observe(self, step: int, routed: Sequence[int], scores: np.ndarray | None) -> None:
        """Called once per step, before lookups, with the layer's routed experts and (when the
        caller has them) the router scores over all experts."""

    def on_hit(self, expert: int) -> None:
        """A routed expert was already cached."""

    def on_insert(self, expert: int) -> None:
        """A routed expert was loaded into the cache."""

    def on_evict(self, expert: int) -> None:
        """`expert` left the cache."""

    @abstractmethod
    def victim(self, cached: set[int], protected: set[int]) -> int:
        """Pick a cached expert to evict; never one in `protected` (the current route)."""


class LRU(Policy):
    """Evict the least recently used expert."""

    name = "lru"

    def __init__(self, capacity: int, num_experts: int):
        super().__init__(capacity, num_experts)
        self.order: OrderedDict[int, None] = OrderedDict()

    def on_hit(self, expert: int) -> None:
        self.order.move_to_end(expert)

    def on_insert(self, expert: int) -> None:
        self.order[expert] = None

    def on_evict(self, expert: int) -> None:
        self.order.pop(expert, None)

    def victim(self, cached: set[int], protected: set[int]) -> int:
        return next(e for e in self.order if e not in protected)


class ExpertCache:
    """Membership of one layer's cache; the policy picks victims. Counts hits and misses."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.cached: set[int] = set()
        self.hits = self.misses = 0

    def access(self, step: int, routed: Sequence[int], scores: np.ndarray | None = None):
        """Route one step through the cache. Returns (hits, loaded, evicted) expert lists;
        `loaded` must be read from storage, `evicted` may be dropped."""
        routed = list(dict.fromkeys(int(e) for e in routed))
        if len(routed) > self.policy.capacity:
            raise ValueError(f"route needs {len(routed)} experts but the cache holds {self.policy.capacity}")
        self.policy.observe(step, routed, scores)
        protected = set(routed)
        hits, loaded, evicted = [], [], []
        for e in routed:
            if e in self.cached:
                hits.append(e)
                self.policy.on_hit(e)
            else:
                loaded.append(e)
        for e in loaded:
            if len(self.cached) >= self.policy.capacity:
                v = self.policy.victim(self.cached, protected)
                self.cached.remove(v)
                self.policy.on_evict(v)
                evicted.append(v)
            self.cached.add(e)
            self.policy.on_insert(e)
        self.hits += len(hits)
        self.misses += len(loaded)
        return hits, loaded, evicted


POLICIES: dict[str, type[Policy]] = {"lru": LRU}


def make_policy(name: str, capacity: int, num_experts: int, **kwargs) -> Policy:
    """Instantiate a registered policy by name (see POLICIES)."""
    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    return POLICIES[name](capacity, num_experts, **kwargs)
