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
from edge0.streaming.staged import follow_routes


class SyntheticRoutes:
    """The route of every MoE layer, token by token, from seeded RouteSources. The first MoE
    layer of a forward pass of B rows x T tokens takes each row's next T tokens' routes; the other
    layers share them. Row r draws text `first_text + r` through the same model (the same popular
    experts, its own token-by-token process; text 0 is the seed's own stream): B sequences of a
    batch route as B different texts do. A batch's row index is its stream (a row that moves up
    when another leaves continues the stream of its new index), which keeps each stream's
    statistics; `first_text` gives one-after-another runs the same texts, generation by generation.
    With `tokens_as_rows` (the concurrency bench's B-token step) a pass of one row x T tokens takes
    token j's route from stream j, where it stands, as a batch's row j does (a batch's prompts are
    prefilled on stream 0), so the step reads what a batch of T rows' step reads."""

    def __init__(self, layers: list[int], num_experts: int, k: int, seed: int):
        self.layers = sorted(layers)
        self.row = {l: i for i, l in enumerate(self.layers)}
        self.num_experts, self.k, self.seed = num_experts, k, seed
        self.first_text = 0
        self.restart()

    def restart(self) -> None:
        """Start the route sequences over: every generation sees the same routes, token by token."""
        self.sources: list[RouteSource] = []
        self.ahead: list[deque] = []  # per row, generated tokens not yet used: (routes [L, K], weights [L, K])
        self.current = None  # this pass's (routes [L, B, T, K], weights [L, B, T, K])
        self.tokens_as_rows = False

    def _stream(self, row: int) -> tuple[RouteSource, deque]:
        while len(self.sources) <= row:
            text = self.first_text + len(self.sources)
            self.sources.append(
                RouteSource(self.num_experts, self.k, len(self.layers), self.seed, text_seed=text or None)
            )
            self.ahead.append(deque())
        return self.sources[row], self.ahead[row]

    def route_tokens_as_rows(self) -> None:
        """From the next pass on, one sequence's T tokens route as T rows of a batch (token j from
        stream j); `restart` ends it."""
        self.tokens_as_rows = True

    def staged_rows(self) -> int:
        """The rows whose next token a read-ahead stages after this pass."""
        routes = self.current[0]  # [L, B, T, K]
        return routes.shape[2] if self.tokens_as_rows and routes.shape[1] == 1 else routes.shape[1]

    def keep(self, position: int) -> None:
        """A speculative verify (one sequence) kept its tokens up to `position`: the routes of the
        rejected positions go back to the front, for the tokens that take those positions next."""
        routes, weights = self.current
        _, ahead = self._stream(0)
        for j in range(routes.shape[2] - 1, position, -1):
            ahead.appendleft((routes[:, 0, j], weights[:, 0, j]))

    def peek(self, row: int = 0):
        """Row `row`'s next token's routes and weights, without using them (the stager reads ahead)."""
        source, ahead = self._stream(row)
        if not ahead:
            routes, scores = source.step()
            weights = np.take_along_axis(scores, routes, axis=1)
            ahead.append((routes.astype(np.uint32), weights / weights.sum(axis=1, keepdims=True)))
        return ahead[0]

    def _take(self, row: int, t: int):
        took = []
        for _ in range(t):
            took.append(self.peek(row))
            self.ahead[row].popleft()
        return np.stack([r for r, _ in took], axis=1), np.stack([w for _, w in took], axis=1)

    def _tokens_as_rows(self, t: int):
        """One row of `t` tokens, token j routed by stream j's next token."""
        tokens = [self._take(j, 1) for j in range(t)]  # each ([L, 1, K], [L, 1, K])
        return tuple(np.concatenate(parts, axis=1)[:, None] for parts in zip(*tokens))

    # -- the MoE block's hooks (see SpecMoEBlock) ---------------------------------------------
    def predicted(self, block, x):
        # x: [B, T, hidden] (B rows of a batch, or one sequence)
        if block.layer == self.layers[0]:
            if self.tokens_as_rows and x.shape[0] == 1:
                self.current = self._tokens_as_rows(x.shape[-2])
            else:
                rows = [self._take(r, x.shape[-2]) for r in range(x.shape[0])]
                self.current = tuple(np.stack(parts, axis=1) for parts in zip(*rows))
        routes, weights = self.current
        i = self.row[block.layer]
        return B.array(routes[i]), B.array(weights[i]).astype(x.dtype)

    def teacher_forced(self, layer: int, inds, scores):
        return inds, scores

    def predict(self, layer: int, x) -> None:
        """The routes come from the source, not from heads."""


class SyntheticHooks(StepHooks):
    """Every generation starts the route sequence over (runs are repeatable), and a speculative
    verify's rejected positions give their routes back (each token position keeps its route)."""

    sees_first_forward = True

    def __init__(self, routes: SyntheticRoutes):
        self.routes = routes

    def start(self) -> None:
        self.routes.restart()

    def kept(self, step: int, position: int) -> None:
        self.routes.keep(position)


class LookaheadStager(SyntheticHooks):
    """Stages step t+1's synthetic route in every staged layer once step t's graph is launched,
    and swaps it in at the boundary (the pre-router's stager, with a perfect prediction)."""

    def __init__(self, routes: SyntheticRoutes, staged: dict):
        super().__init__(routes)
        self.staged = staged

    def start(self) -> None:
        super().start()
        self.last, self.ending = False, []
        self.early, self.nxt = set(), None  # layers staged during the forward; the next routes [L, B, K]

    def last_step(self, step: int, rows: list[int] | None = None) -> None:
        if rows is None:
            self.last = True  # no step follows: nothing to stage
        else:
            self.ending = rows  # these rows' last token: their next routes are not staged

    def before_forward(self, step: int) -> None:
        self.early, self.nxt = set(), None
        if not self.last:
            follow_routes(self.staged.values(), self._stage_early)

    def _stage_early(self, layer: int) -> None:
        """A layer routed on the host during the forward (a batch's rows): its next step's reads
        start now, as the pre-router's stager does."""
        self._stage_layer(layer)
        self.early.add(layer)

    def _stage_layer(self, layer: int) -> None:
        routes = self.routes
        rows = routes.staged_rows()  # this pass's rows: each one's next token is staged
        if self.nxt is None:
            # the rows after an ending one move up and continue the stream of their new index
            self.nxt = np.stack([routes.peek(r)[0] for r in range(rows - len(self.ending))], axis=1)  # [L, B, K]
        i = routes.row[layer]
        self.staged[layer].stage(self.nxt[i, 0] if rows == 1 else self.nxt[i])

    def after_forward(self, step: int, launched) -> None:
        B.async_eval(launched)
        follow_routes(self.staged.values(), None)
        if not self.last:
            for layer in self.staged:
                if layer not in self.early:
                    self._stage_layer(layer)
        self.last, self.ending = False, []

    def before_step(self, step: int) -> None:
        for ex in self.staged.values():
            ex.swap()

    def finish(self) -> None:
        follow_routes(self.staged.values(), None)  # a forward that raised never reached after_forward
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
