"""Offline replay of a routing trace through expert caches: hit rates per policy and budget.
Layers are independent caches, as in the live pool; pure numpy/python."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from edge0.cache import OFFLINE, ExpertCache, make_policy, substitute
from edge0.errors import Edge0Error
from edge0.units import parse_size

# The policies in the order tables list them; Belady last, as the bound.
ORDER = ["lru", "lfu", "arc", "smoe", "flashmoe", "belady"]


@dataclass(frozen=True)
class Budget:
    label: str  # as the user wrote it
    capacity: int  # experts cached per layer


def parse_budgets(text: str, num_experts: int, field_name: str = "--budget") -> list[Budget]:
    """'1/8,1/4,0.5,12' -> fractions of the experts per layer, or counts (plain integers)."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            value = Fraction(part)
        except (ValueError, ZeroDivisionError):
            raise Edge0Error(
                f"{field_name}: {part!r} is not a fraction or a count; use e.g. 1/8,1/4,3/8 or 4,8"
            ) from None
        # A plain integer is a count of experts; anything with '/' or '.' is a fraction of them.
        cap = int(value) if part.isdigit() else round(value * num_experts)
        if not 1 <= cap <= num_experts:
            raise Edge0Error(f"{field_name}: {part!r} is {cap} experts per layer; it must be 1..{num_experts}")
        out.append(Budget(part, cap))
    if not out:
        raise Edge0Error(f"{field_name}: no budgets given; use e.g. 1/8,1/4,3/8")
    return out


def parse_byte_budgets(text: str, expert_bytes: list[int], num_experts: int) -> list[Budget]:
    """'64MiB,1GB' -> total cache bytes over all MoE layers; the same count in every layer."""
    per_expert_all_layers = sum(expert_bytes)
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        cap = parse_size(part, "--budget-bytes") // per_expert_all_layers
        if cap < 1:
            raise Edge0Error(
                f"--budget-bytes: {part} holds no expert per layer (one expert in every layer is "
                f"{per_expert_all_layers} bytes)"
            )
        out.append(Budget(part, min(cap, num_experts)))
    return out


@dataclass
class Result:
    policy: str
    budget: Budget
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    substitutions: int = 0
    layers: dict = field(default_factory=dict)  # layer -> hit rate

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def replay_layer(routes: np.ndarray, scores: np.ndarray | None, policy, alpha: float = 0.0) -> tuple[ExpertCache, int]:
    """Run one layer's routes [T, K] (and scores [T, E]) through a cache with `policy`; with
    `alpha` > 0 each route first goes through SMoE substitution against the cached set.
    Returns the cache and the number of substitutions."""
    cache = ExpertCache(policy)
    subs = 0
    for step, r in enumerate(routes.tolist()):
        s = None if scores is None else scores[step]
        if alpha:
            r, n = substitute(s, r, cache.cached, alpha)
            subs += n
        cache.access(step, r, s)
    return cache, subs


def simulate(
    trace, policies: list[str], budgets: list[Budget], options: dict | None = None, alpha: float = 0.0
) -> list[Result]:
    """Hit rates of every policy at every budget. `options[name]` are extra keyword arguments of
    a policy (e.g. {"smoe": {"window": 16}, "flashmoe": {"weights": model}}). With `alpha` > 0
    routes are substituted first; the trace's later routes do not reflect the changed outputs,
    so read savings are an estimate, and Belady (which knows only the original routes) is no
    longer a bound."""
    options = options or {}
    results = {(p, b): Result(p, b) for p in policies for b in budgets}
    for li, layer in enumerate(trace.layers):
        routes = np.asarray(trace.routes[li], dtype=np.int64)
        scores = np.asarray(trace.scores[li], dtype=np.float32)
        future = routes.tolist()
        for name in policies:
            kw = dict(options.get(name, {}))
            if name in OFFLINE:
                kw["future"] = future
            if name == "flashmoe":
                kw["layer"] = layer
            for b in budgets:
                cache, subs = replay_layer(
                    routes,
                    scores if name == "smoe" or alpha else None,
                    make_policy(name, b.capacity, trace.num_experts, **kw),
                    alpha,
                )
                r = results[(name, b)]
                r.hits += cache.hits
                r.misses += cache.misses
                r.substitutions += subs
                r.bytes_read += cache.misses * trace.expert_bytes[li]
                r.layers[layer] = cache.hit_rate
    return list(results.values())


def format_table(results, budgets, num_experts: int, steps: int) -> str:
    """Markdown table: one row per policy, one column per budget; hit rate and MiB read/token."""
    head = "| policy | " + " | ".join(f"{b.label} ({b.capacity}/{num_experts})" for b in budgets) + " |"
    lines = [head, "|---" * (len(budgets) + 1) + "|"]
    by = {(r.policy, r.budget): r for r in results}
    for p in dict.fromkeys(r.policy for r in results):
        cells = [f"{100 * by[(p, b)].hit_rate:.1f}% ({by[(p, b)].bytes_read / steps / 2**20:.2f})" for b in budgets]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
