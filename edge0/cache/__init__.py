"""Expert-cache policies: which cached experts to evict. Shared by the live expert pool and the
offline simulator, so a policy behaves the same in both. See docs/cache-policies.md."""

from edge0.cache.arc import ARC
from edge0.cache.belady import Belady
from edge0.cache.flashmoe import FlashMoE
from edge0.cache.lfu import LFU
from edge0.cache.policy import LRU, POLICIES, ExpertCache, Policy, make_policy
from edge0.cache.smoe import SMoE
from edge0.cache.substitute import substitute

# Registered here, not in policy.py, so policy.py has no imports of its subclasses; importing
# edge0.cache.policy always runs this file first, so POLICIES is complete for every importer.
POLICIES.update({p.name: p for p in (LFU, ARC, SMoE, FlashMoE, Belady)})

# Policies that need the future: offline only (simulator, training labels).
OFFLINE = {"belady"}
# What the live expert cache can run, in POLICIES order.
LIVE_POLICIES = tuple(p for p in POLICIES if p not in OFFLINE)

__all__ = [
    "POLICIES",
    "OFFLINE",
    "LIVE_POLICIES",
    "ExpertCache",
    "LRU",
    "LFU",
    "ARC",
    "SMoE",
    "FlashMoE",
    "Belady",
    "Policy",
    "make_policy",
    "substitute",
]
