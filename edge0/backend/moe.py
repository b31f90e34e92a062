"""The MoE modules that stand in for mlx-lm's: StreamingExperts (routed experts streamed from a
store) and SpecMoEBlock (a spec'd family's block with Edge0's routing)."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from edge0.backend.modules import get_module
from edge0.backend.routing import expert_scores, route


class Early(NamedTuple):
    """Experts of a one-token call computed before its route is known (predicted, already in the
    slots), so the device computes them while the host waits for the route: outputs [n, D], of
    which a later `Served` takes the rows the route chose."""

    params: dict
    rows: object  # [n] rows of `params` (device)


class Served(NamedTuple):
    """The (token, k) pairs at flat positions `pairs` (host ints) take rows `at` of the call's
    `Early` outputs."""

    pairs: np.ndarray
    at: np.ndarray


class _Streamed(nn.Module):
    """A module whose tensors stay on disk: `inner` runs on the tensors its executor gives each call."""

    def __init__(self, inner: nn.Module, layer: int):
        super().__init__()
        # Empty placeholders: the module must not keep expert tensors between calls (a whole
        # layer per MoE layer would pile up after a prefill).
        blank = tree_map(lambda _: mx.zeros((0,)), inner.parameters())
        inner.update(blank)
        # Plain attributes, not children: the experts' tensors must not count as resident.
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "blank", blank)
        object.__setattr__(self, "executor", None)  # set by use_executor
        self.layer = layer

    def use_executor(self, executor) -> None:
        """Where this layer's expert tensors come from (a streaming LayerDispatch)."""
        object.__setattr__(self, "executor", executor)


class StreamingExperts(_Streamed):
    """Stands in for an mlx-lm SwitchGLU/SwitchMLP whose stacked expert tensors stay on disk.

    Per call, `executor(indices, scores)` returns parts, each one of:
    - (tensors of some experts, the route's indices mapped into them): every (token, k) pair is
      computed, pairs another part owns pointing at a zero expert; such parts are summed;
    - (tensors, rows [N], pairs [N]): only the N (token, k) pairs at flat positions `pairs` (host
      ints) are computed, with expert rows `rows`; such parts together cover every pair once;
    - `Early` and `Served` (one token): experts computed before the route is known, and the pairs
      that then take their outputs; they count as pair parts;
    - a callable returning one of those, or a list of them: its experts are still being read, or
      its route is not on the host yet, so the parts before it start computing first.
    The original mlx-lm module runs its own math on each; then `executor.done(output)`. `scores`
    (router scores over all experts, lazy) come from a SpecMoEBlock's gate; mlx-lm's own blocks
    pass none. With a lookahead (backend/lookahead.py), the executor may ask for the next MoE
    layer's route predicted from this layer's input.
    """

    lookahead = None  # fn(x) -> the next MoE layer's predicted ids (lazy) or None; set by use_lookahead

    def use_lookahead(self, fn) -> None:
        object.__setattr__(self, "lookahead", fn)

    def __call__(self, x, indices, scores=None):
        # T tokens (any leading shape), K routed each, D hidden, N pairs of a part
        summed, picked = None, []  # the summed parts' total; (pairs, outputs [N, D]) of pair parts
        early = None  # an Early part's outputs [n, D]
        fn = self.lookahead
        try:
            parts = list(
                self.executor(indices, scores) if fn is None else self.executor(indices, scores, ahead=lambda: fn(x))
            )
            while parts:
                part = parts.pop(0)
                if callable(part):
                    launched = [y for _, y in picked] + [a for a in (summed, early) if a is not None]
                    mx.async_eval(launched)
                    part = part()
                    parts[:0] = part if isinstance(part, list) else [part]
                    continue
                if isinstance(part, Served):
                    picked.append((part.pairs, early[mx.array(part.at)]))
                    continue
                self.inner.update(part[0])
                if isinstance(part, Early):
                    n = part.rows.shape[0]
                    xs = mx.broadcast_to(x.reshape(1, x.shape[-1]), (n, x.shape[-1]))
                    early = self.inner(xs, part.rows.reshape(-1, 1)).reshape(n, -1)  # [n, D]
                elif len(part) == 2:
                    y = self.inner(x, part[1])
                    summed = y if summed is None else summed + y
                else:
                    _, rows, pairs = part
                    tokens = mx.array(pairs // indices.shape[-1])
                    y = self.inner(x.reshape(-1, x.shape[-1])[tokens], rows.reshape(-1, 1))  # [N, 1, D]
                    picked.append((pairs, y.reshape(len(pairs), -1)))
        finally:
            self.inner.update(self.blank)  # the lazy graph keeps what it needs
        if picked and summed is not None:
            raise RuntimeError("an executor returned both pair parts and whole parts for one call")
        y = summed if not picked else self._assemble(picked, indices.shape)
        self.executor.done(y)
        return y

    @staticmethod
    def _assemble(picked, shape):
        """Pair parts' outputs back in (token, k) order: [..., T, K, D]."""
        order = np.concatenate([pairs for pairs, _ in picked])
        if sorted(order.tolist()) != list(range(int(np.prod(shape)))):
            raise RuntimeError("an executor's pair parts must cover every (token, k) pair once")
        y = mx.concatenate([y for _, y in picked])[mx.array(np.argsort(order))]
        return y.reshape(*shape, y.shape[-1])


class StreamingExpertList(_Streamed):
    """Stands in for a list of per-expert modules (DBRX's `experts`), whose tensors the store holds
    stacked like a SwitchGLU's. The family's block calls `experts[e](x)`; each call asks the
    executor for expert e (a route of one expert) and runs `inner`, a copy of one expert's module
    (quantized like the stored tensors by the caller), on its tensors."""

    def __getitem__(self, key):
        if isinstance(key, int):  # the block's `self.experts[e]`; string keys are the module's own
            return lambda x: self.expert(key, x)
        return super().__getitem__(key)

    def expert(self, e: int, x):
        y = None
        for part in self.executor(mx.array([[e]]), None):  # no lookahead here: never Early/Served parts
            params, local = part() if callable(part) else part  # a deferred part: its expert is being read
            row = local.reshape(-1)[0]  # where expert e sits in this part's tensors (a zero row if elsewhere)
            self.inner.update(tree_map(lambda v: v[row], params))
            part = self.inner(x)
            y = part if y is None else y + part
        self.inner.update(self.blank)
        self.executor.done(y)
        return y


class SpecMoEBlock(nn.Module):
    """A spec'd family's MoE block with Edge0's routing: router -> top-k -> experts -> weighted
    sum (+ shared experts). Keeps the original block's children so weight names are unchanged.

    `prerouting`, when set (by the pre-router), supplies routes predicted one token earlier:
    `predicted(block, x)` -> (indices, weights) or None for the gate; `teacher_forced(layer,
    indices, weights)` for a full-sequence pass routed as decoding would; `predict(layer, x)`
    after routing, where this layer owns a head."""

    def __init__(self, block: nn.Module, spec, k: int, layer: int):
        super().__init__()
        for name, child in block.items():
            self[name] = child
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "observer", None)  # fn(indices [T, K], scores [T, E]) or None
        object.__setattr__(self, "capture", None)  # fn(x [T, D], inds [T, K], scores [T, E]): pre-router traces
        object.__setattr__(self, "prerouting", None)
        self.k = k
        self.layer = layer

    # Plain attributes, not children, so they never enter the parameter tree.
    def use_prerouting(self, prerouting) -> None:
        """Take routes from `prerouting` (the pre-router, or a bench's synthetic routes); None: the gate."""
        object.__setattr__(self, "prerouting", prerouting)

    def use_observer(self, fn) -> None:
        """fn(indices [T, K], scores [T, E]) on every forward (a host sync each; traces only); None stops."""
        object.__setattr__(self, "observer", fn)

    def use_capture(self, fn) -> None:
        """fn(x [T, D], indices [T, K], scores [T, E]) on every forward (pre-router training data); None stops."""
        object.__setattr__(self, "capture", fn)

    def router_logits(self, x):
        router = get_module(self, self.spec.router)
        return router(x) if isinstance(router, nn.Module) else x @ router.T

    def router_bias(self):
        """The score-correction bias added before selection, or None."""
        return get_module(self, self.spec.router_bias) if self.spec.router_bias else None

    def router_weight(self) -> mx.array:
        """The router as a float32 [E, D] matrix (dequantized if quantized)."""
        r = get_module(self, self.spec.router)
        if isinstance(r, nn.QuantizedLinear):
            return mx.dequantize(r.weight, r.scales, r.biases, group_size=r.group_size, bits=r.bits).astype(mx.float32)
        return (r.weight if isinstance(r, nn.Linear) else r).astype(mx.float32)

    def gate_route(self, x):
        """(indices, weights, logits) from this layer's own router."""
        logits = self.router_logits(x)  # [.., T, E]
        inds, scores = route(logits, self.spec.routing, self.k, self.router_bias())  # [.., T, K]
        return inds, scores, logits

    def __call__(self, x):
        # T tokens, E experts, K active, D hidden
        spec, pr = self.spec, self.prerouting
        predicted = pr.predicted(self, x) if pr is not None else None
        probs = None  # router scores over all experts, for the expert cache (lazy: free if unused)
        if predicted is not None:  # the route was predicted at the previous token
            inds, scores = predicted
            if self.observer is not None:  # a trace records the routes used, with the router's scores
                self._observe(x, inds, expert_scores(self.router_logits(x), spec.routing))
        else:
            inds, scores, logits = self.gate_route(x)
            probs = expert_scores(logits, spec.routing)
            if pr is not None:
                inds, scores = pr.teacher_forced(self.layer, inds, scores)
            self._observe(x, inds, probs)
        if pr is not None:
            pr.predict(self.layer, x)
        y = self[spec.experts](x, inds, scores=probs)  # [.., T, K, D]
        y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)  # [.., T, D]
        shared = spec.shared
        if shared.kind == "plain":
            y = y + self[shared.module](x)
        elif shared.kind == "gated":
            y = y + mx.sigmoid(self[shared.gate](x)) * self[shared.module](x)
        return y

    def _observe(self, x, inds, probs) -> None:
        """Trace hooks; each costs a host sync, so they are for traces only."""
        if self.observer is not None:
            self.observer(np.array(inds).reshape(-1, inds.shape[-1]), np.array(probs).reshape(-1, probs.shape[-1]))
        if self.capture is not None:
            self.capture(
                np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1]),
                np.array(inds).reshape(-1, inds.shape[-1]),
                np.array(probs).reshape(-1, probs.shape[-1]),
            )
