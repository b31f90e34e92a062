"""Expert-cache policies: which cached experts to evict. Shared by the live expert pool and the
offline simulator, so a policy behaves the same in both."""

from edge0.cache.policy import POLICIES, ExpertCache, LRU, Policy, make_policy

__all__ = ["POLICIES", "ExpertCache", "LRU", "Policy", "make_policy"]
