"""Synthetic routing for benchmarks (`--routing qwen3-like`): every spec'd MoE layer computes with
routes from edge0.cache.synthetic (fitted to Qwen3-30B-A3B's published cache statistics) instead
of its gate, through the plumbing the pre-router uses to hand a route to a layer. Reads, slot
rewrites, stalls and compute are all real; only the choice of experts is synthetic, so tokens
differ from the model's own. With `lookahead`, the staged executors read step t+1's experts while
step t computes, as the pre-router does: it knows the route one step ahead by construction."""

from __future__ import annotations

from collections import deque

import numpy as np

from edge0.backend import assemble as bas
from edge0.backend import core as B
from edge0.cache.synthetic import RouteSource
from edge0.engine.hooks import StepHooks
from edge0.errors import Edge0Error


class SyntheticRoutes:
    """The route of every MoE layer, token by token, from a seeded RouteSource. The first MoE
    layer of a forward pass of T tokens takes the next T tokens' routes; the others share them."""

    def __init__(self, layers: list[int], num_experts: int, k: int, seed: int):
        self.layers = sorted(layers)
        self.row = {l: i for i, l in enumerate(self.layers)}
        self.num_experts, self.k, self.seed = num_experts, k, seed
        self.restart()

    def restart(self) -> None:
        """Start the route sequence over: every generation sees the same routes, token by token."""
        self.source = RouteSource(self.num_experts, self.k, len(self.layers), self.seed)
        self.ahead: deque = deque()  # generated tokens not yet used: (routes [L, K], weights [L, K])
        self.current = None  # this pass's (routes [L, T, K], weights [L, T, K])

    def keep(self, position: int) -> None:
        """A speculative verify kept its tokens up to `position`: the routes of the rejected
        positions go back to the front, for the tokens that take those positions next."""
        routes, weights = self.current
        for j in range(routes.shape[1] - 1, position, -1):
            self.ahead.appendleft((routes[:, j], weights[:, j]))

    def peek(self):
        """The next token's routes and weights, without using them (the stager reads ahead)."""
        if not self.ahead:
            routes, scores = self.source.step()
            weights = np.take_along_axis(scores, routes, axis=1)
            self.ahead.append((routes.astype(np.uint32), weights / weights.sum(axis=1, keepdims=True)))
        return self.ahead[0]

    def _take(self, t: int):
        rows = []
        for _ in range(t):
            rows.append(self.peek())
            self.ahead.popleft()
        return np.stack([r for r, _ in rows], axis=1), np.stack([w for _, w in rows], axis=1)

    # -- the MoE block's hooks (see SpecMoEBlock) ---------------------------------------------
    def predicted(self, block, x):
        if block.layer == self.layers[0]:
            self.current = self._take(x.shape[-2])
        routes, weights = self.current
        i = self.row[block.layer]
        return B.array(routes[i][None]), B.array(weights[i][None]).astype(x.dtype)

    def teacher_forced(self, layer: int, inds, scores):
        return inds, scores

    def predict(self, layer: int, x) -> None:
        """The routes come from the source, not from heads."""


class SyntheticHooks(StepHooks):
    """Every generation starts the route sequence over (runs are repeatable), and a speculative
    verify's rejected positions give their routes back (each token position keeps its route)."""

    def __init__(self, routes: SyntheticRoutes):
        self.routes = routes

    def start(self, engine) -> None:
        self.routes.restart()

    def kept(self, engine, step: int, position: int) -> None:
        self.routes.keep(position)


class LookaheadStager(SyntheticHooks):
    """Stages step t+1's synthetic route in every staged layer once step t's graph is launched,
    and swaps it in at the boundary (the pre-router's stager, with a perfect prediction)."""

    def __init__(self, routes: SyntheticRoutes, staged: dict):
        super().__init__(routes)
        self.staged = staged

    def after_forward(self, engine, step: int, launched) -> None:
        B.async_eval(launched)
        nxt, _ = self.routes.peek()
        for layer, ex in self.staged.items():
            ex.stage(nxt[self.routes.row[layer]])

    def before_step(self, engine, step: int) -> None:
        for ex in self.staged.values():
            ex.swap()

    def finish(self, engine) -> None:
        for ex in self.staged.values():
            ex.settle()


def use_synthetic_routing(engine, seed: int = 0, lookahead: bool = False) -> SyntheticRoutes:
    """Route every MoE layer of `engine` with qwen3-like synthetic routes (benchmarks only)."""
    if engine.spec is None:
        raise Edge0Error(
            f"--routing qwen3-like: {engine.model_id} is served at the universal level; synthetic routes "
            "need a spec'd family"
        )
    if engine.prerouting is not None or engine.lora_path is not None:
        raise Edge0Error(
            "--routing qwen3-like replaces the routing: load the model with prerouter=False and lora=False"
        )
    blocks = bas.moe_blocks(engine.model)
    routes = SyntheticRoutes([l for l, _ in blocks], engine.spec.num_experts, engine.k, seed)
    for _, block in blocks:
        block.use_prerouting(routes)
    hooks = LookaheadStager(routes, engine.streaming.staged()) if lookahead else SyntheticHooks(routes)
    engine.use_prerouter(routes, hooks, None, {"routing": "qwen3-like", "seed": seed, "lookahead": lookahead})
    return routes
