"""The eviction-policy interface and LRU, the default.

A policy serves one MoE layer. `ExpertCache` owns membership (which experts are cached) and
asks the policy only two things: to observe each step's route, and to pick a victim. The hooks
are called in this order for a step: observe; on_hit for each cached routed expert; then for
each missing one: on_miss, victim + on_evict (when the cache is full), on_insert.

A step's route is always resident while the step runs. When `capacity` is smaller than the route
(a budget below top-k), nothing is evicted during the step; afterwards the cache is trimmed back
to `capacity` and in that trim nothing is protected. See docs/cache-policies.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Sequence

import numpy as np


class Policy(ABC):
    """Eviction policy for one layer's expert cache of `capacity` experts out of `num_experts`."""

    name = "?"
    needs_scores = False  # observe() needs the router scores over all experts at every step

    def __init__(self, capacity: int, num_experts: int):
        self.capacity, self.num_experts = capacity, num_experts

    def observe(self, step: int, routed: Sequence[int], scores: np.ndarray | None) -> None:
        """Called once per step, before lookups, with the layer's routed experts and (when the
        caller has them) the router scores over all experts."""

    def on_hit(self, expert: int) -> None:
        """A routed expert was already cached."""

    def on_miss(self, expert: int) -> None:
        """A routed expert is not cached; called before the victim for it is chosen."""

    def on_insert(self, expert: int) -> None:
        """A routed expert was loaded into the cache."""

    def on_evict(self, expert: int) -> None:
        """`expert` left the cache."""

    @abstractmethod
    def victim(self, cached: set[int], protected: set[int]) -> int:
        """Pick a cached expert to evict; never one in `protected` (the current route)."""

    def resize(self, capacity: int) -> None:
        """The cache holds `capacity` experts from now on (ExpertCache.resize has already
        evicted any excess through `victim`)."""
        self.capacity = capacity


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
        if policy.capacity < 1:
            raise ValueError(f"cache capacity must be >= 1 expert (got {policy.capacity})")
        self.policy = policy
        self.cached: set[int] = set()
        self.hits = self.misses = 0

    def access(self, step: int, routed: Sequence[int], scores: np.ndarray | None = None, keep=()):
        """Route one step through the cache. Returns (hits, loaded, evicted) expert lists;
        `loaded` must be read from storage, `evicted` may be dropped. With a route larger than
        the capacity, `evicted` may include experts of this route (drop them after the step).
        `keep`: cached experts not to evict either (a computation still reads their slots)."""
        routed = list(dict.fromkeys(int(e) for e in routed))
        policy, cached, cap = self.policy, self.cached, self.policy.capacity
        policy.observe(step, routed, scores)
        protected = set(routed) | set(keep)
        hits, loaded, evicted = [], [], []
        for e in routed:
            if e in cached:
                hits.append(e)
                policy.on_hit(e)
            else:
                loaded.append(e)
        # A route wider than the cache cannot fit: hold it for this step, then let the policy
        # keep any `cap` of cached + routed (evicting during the step would force it to drop
        # the unrouted experts first).
        overflow = len(routed) > cap
        for e in loaded:
            policy.on_miss(e)
            if not overflow and len(cached) >= cap:
                evicted.append(self._evict(protected))
            cached.add(e)
            policy.on_insert(e)
        while len(cached) > cap:
            evicted.append(self._evict(set()))
        self.hits += len(hits)
        self.misses += len(loaded)
        return hits, loaded, evicted

    def admit(self, experts: Sequence[int]) -> tuple[list[int], list[int]]:
        """Insert `experts` read ahead of the route that may use them (a prediction), as misses
        would be, without observing a route or counting hits and misses: the route that follows
        counts them. Returns (loaded, evicted): those not cached yet, and the experts they replace
        (never one of `experts`)."""
        experts = list(dict.fromkeys(int(e) for e in experts))
        protected, loaded, evicted = set(experts), [], []
        for e in experts:
            if e in self.cached:
                continue
            if len(self.cached) >= self.policy.capacity and not self.cached - protected:
                break  # every slot holds an expert of this prediction: the rest are read by their call
            self.policy.on_miss(e)
            if len(self.cached) >= self.policy.capacity:
                evicted.append(self._evict(protected))
            self.cached.add(e)
            self.policy.on_insert(e)
            loaded.append(e)
        return loaded, evicted

    def resize(self, capacity: int) -> list[int]:
        """Hold `capacity` experts from now on; when shrinking, the policy picks the experts to
        drop, as it would on a miss. Returns the evicted experts."""
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1 expert (got {capacity})")
        evicted = []
        while len(self.cached) > capacity:
            evicted.append(self._evict(set()))
        self.policy.resize(capacity)
        return evicted

    def _evict(self, protected: set[int]) -> int:
        v = self.policy.victim(self.cached, protected)
        if v not in self.cached or v in protected:
            raise RuntimeError(f"{self.policy.name}: victim {v} is not an evictable cached expert")
        self.cached.remove(v)
        self.policy.on_evict(v)
        return v

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


POLICIES: dict[str, type[Policy]] = {"lru": LRU}


def make_policy(name: str, capacity: int, num_experts: int, **kwargs) -> Policy:
    """Instantiate a registered policy by name (see POLICIES). Options by policy: smoe
    `window`; flashmoe `weights` (file or loaded model); belady `future` (every step's route)."""
    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    return POLICIES[name](capacity, num_experts, **kwargs)
