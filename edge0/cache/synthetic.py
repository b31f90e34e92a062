"""Synthetic MoE routing: a seeded stochastic process with per-expert popularity skew and temporal
locality, fitted to published expert-cache statistics of Qwen3-30B-A3B. Numpy only.

The model, per layer and token: each expert's logit is the sum of a fixed popularity (set once
per layer), a drifting topic (an AR(1) process per expert), a repeat term for the experts the
previous token routed (positive: sticky; negative: refractory) and independent Gumbel noise. The
route is the top-k of these logits, i.e. k experts sampled without replacement from their softmax.
The router scores are the softmax of the same logits at a temperature, so the routed experts are
always the top-k of the scores. See docs/synthetic-routing.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True)
class RoutingParams:
    """Parameters of the process, in units of the Gumbel noise scale (1 nat)."""

    popularity: float  # std of the fixed per-expert logit (global skew)
    topic: float  # stationary std of the drifting per-expert logit
    topic_halflife: float  # tokens for the topic's correlation to fall to 1/2
    repeat: float  # logit added to the previous token's experts (>0 sticky, <0 refractory)
    temperature: float = 1.0  # softmax temperature of the scores; does not change the routes


# Fitted by scripts/fit_synthetic_routing.py at E=128, K=8 (see docs/synthetic-routing.md).
QWEN3_LIKE = RoutingParams(popularity=2.59375, topic=1.6875, topic_halflife=8.724061861322062, repeat=-1.3125)


class RouteSource:
    """Routes one token at a time for `layers` layers: `next()` -> int64 [layers, top_k], sorted
    by descending score; `step()` also returns the scores, float32 [layers, num_experts].
    Deterministic for a seed: call n (from 0) gives `generate(..., seed)`'s routes[:, n] and
    scores[:, n]; `next()` and `step()` may be mixed, each advances one token."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        layers: int,
        seed: int,
        params: RoutingParams = QWEN3_LIKE,
        text_seed: int | None = None,
    ):
        """`seed` fixes the model (which experts are popular in each layer); `text_seed`, when
        given, draws the token-by-token process separately: another text through the same model."""
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts} (got {top_k})")
        if layers < 1:
            raise ValueError(f"layers must be >= 1 (got {layers})")
        if params.topic_halflife <= 0 or params.temperature <= 0:
            raise ValueError(f"invalid routing parameters: {params}")
        self.num_experts, self.top_k, self.layers, self.params = num_experts, top_k, layers, params
        self._rng = np.random.default_rng(seed)
        shape = (layers, num_experts)
        # Evenly spaced normal quantiles in a random order per layer: every layer has the same
        # skew, so hit rates vary less between layers and seeds than with drawn popularities.
        quantiles = np.array([NormalDist().inv_cdf((i + 0.5) / num_experts) for i in range(num_experts)])
        self._popularity = params.popularity * self._rng.permuted(np.tile(quantiles, (layers, 1)), axis=1)
        if text_seed is not None:
            self._rng = np.random.default_rng([seed, text_seed])
        # Start the topic from its stationary distribution, so the process has no warm-up drift.
        self._topic = params.topic * self._rng.standard_normal(shape)
        self._rho = 0.5 ** (1.0 / params.topic_halflife)
        self._innovation = params.topic * np.sqrt(1.0 - self._rho**2)
        self._previous = np.zeros(shape, dtype=bool)
        self._rows = np.arange(layers)[:, None]

    def step(self) -> tuple[np.ndarray, np.ndarray]:
        """Advance one token: (routes int64 [layers, top_k], scores float32 [layers, num_experts])."""
        p, rng, k = self.params, self._rng, self.top_k
        # In place, as this runs once per token for every layer: -log of a standard exponential
        # is Gumbel noise (numpy draws it ~3x faster than rng.gumbel).
        logits = rng.standard_exponential(self._topic.shape)
        np.log(logits, out=logits)
        np.negative(logits, out=logits)
        logits += self._popularity
        logits += self._topic
        np.add(logits, p.repeat, out=logits, where=self._previous)
        top = np.argpartition(logits, -k, axis=1)[:, -k:]
        routes = np.take_along_axis(top, np.argsort(-logits[self._rows, top], axis=1), axis=1)
        scores = logits / p.temperature
        scores -= scores.max(axis=1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=1, keepdims=True)
        self._topic *= self._rho
        self._topic += self._innovation * rng.standard_normal(self._topic.shape)
        self._previous[:] = False
        self._previous[self._rows, routes] = True
        return routes.astype(np.int64), scores.astype(np.float32)

    def next(self) -> np.ndarray:
        """Advance one token: the routes, int64 [layers, top_k]."""
        return self.step()[0]


def generate(
    num_experts: int,
    top_k: int,
    layers: int,
    steps: int,
    seed: int,
    params: RoutingParams = QWEN3_LIKE,
    text_seed: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`steps` tokens of routing: (routes int64 [layers, steps, top_k], scores float32
    [layers, steps, num_experts]); the same as `steps` calls of RouteSource(...).step()."""
    src = RouteSource(num_experts, top_k, layers, seed, params, text_seed)
    routes = np.empty((layers, steps, top_k), dtype=np.int64)
    scores = np.empty((layers, steps, num_experts), dtype=np.float32)
    for t in range(steps):
        routes[:, t], scores[:, t] = src.step()
    return routes, scores


def synthetic_trace(
    num_experts: int,
    top_k: int,
    layers: list[int],
    expert_bytes: list[int],
    steps: int,
    seed: int,
    meta: dict | None = None,
    params: RoutingParams = QWEN3_LIKE,
    text_seed: int | None = None,
):
    """A routing trace (edge0.cache.tracefile) of `steps` generated tokens for a model of this
    shape, for the simulator and the planner: one prompt, every step marked as generated."""
    from edge0.cache.tracefile import Trace

    routes, scores = generate(num_experts, top_k, len(layers), steps, seed, params, text_seed)
    info = {
        "num_experts": num_experts,
        "top_k": top_k,
        "layers": list(layers),
        "expert_bytes": list(expert_bytes),
        "score_kind": "softmax",
        "source": {"routing": "qwen3-like", "seed": seed, "text_seed": text_seed, "params": asdict(params)},
    }
    return Trace(
        routes,
        scores.astype(np.float16),
        np.zeros(steps, np.int32),
        np.ones(steps, np.uint8),
        np.zeros(1, np.int64),
        {**(meta or {}), **info},
    )
