"""Next-layer route prediction for decode reads: layer l's MoE input put through layer l+1's router
predicts l+1's route before l+1's attention has run, so its misses can be read while layer l
computes (edge0/streaming/lookahead.py decides whether to read them). Only a prediction: layer
l+1 still routes with its own gate on its own input, so tokens never change.

A spec'd family predicts with the next block's own routing (bias, groups and all); any other
family with the next block's router matrix (the module whose output is one logit per expert) and
a plain top-k of its logits, since softmax and sigmoid keep the order."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from edge0.backend.modules import get_module
from edge0.backend.moe import SpecMoEBlock, StreamingExperts

ROUTER_NAMES = ("gate", "router")  # what mlx-lm's MoE blocks call their router (or a parent of it)


def _out_in(m) -> tuple[int, int] | None:
    """(outputs, inputs) of a linear map held by module `m`, or None."""
    w = getattr(m, "weight", None) if isinstance(m, nn.Module) else None
    if not isinstance(w, mx.array) or w.ndim != 2:
        return None
    if isinstance(m, nn.QuantizedLinear):
        return w.shape[0], w.shape[1] * 32 // m.bits
    return w.shape


def router_of(block: nn.Module, experts_path: str, num_experts: int) -> tuple[str, nn.Module] | None:
    """(path, module) of the router in an mlx-lm MoE `block`: a module named like a router, or
    under one (`gate.gate_proj`), not under the experts at `experts_path` nor a shared expert's,
    holding a matrix with one output per expert (or more: LongCat's zero experts follow its E)."""
    found = []
    for path, m in block.named_modules():
        parts = path.split(".")
        if not path or path.startswith(experts_path) or any("shared" in p for p in parts):
            continue
        shape = _out_in(m)
        if shape is not None and shape[0] >= num_experts and any(n in p for p in parts for n in ROUTER_NAMES):
            found.append((shape[0] != num_experts, len(parts), path, m))
    return min(found, key=lambda f: f[:3])[2:] if found else None


def predictor(block: nn.Module, experts_path: str, num_experts: int, k: int) -> Callable | None:
    """x [.., D] (the MoE input of the layer before) -> predicted expert ids [.., k] (lazy) of
    `block`'s route, highest score first, or None when no router is found. Inputs of another
    width predict nothing; ids past the stored experts (zero experts) are dropped by the reader."""
    if isinstance(block, SpecMoEBlock):

        def ranked(x):
            inds, scores, _ = block.gate_route(x)
            return mx.take_along_axis(inds, mx.argsort(-scores, axis=-1), axis=-1)

        return ranked
    found = router_of(block, experts_path, num_experts)
    if found is None:
        return None
    m = found[1]
    width = _out_in(m)[1]
    call = m if isinstance(m, (nn.Linear, nn.QuantizedLinear)) else (lambda x: x @ m.weight.T)

    def predict(x):
        if x.shape[-1] != width:
            return None
        logits = call(x)
        return mx.stop_gradient(mx.argsort(-logits, axis=-1)[..., :k])

    return predict


def attach_lookahead(model: nn.Module, shapes: dict[int, tuple[int, int]]) -> list[int]:
    """Give each StreamingExperts the predictor of the next MoE layer's route (`shapes`: experts
    and top-k per MoE layer); returns the layers that got one (the next layer's router found)."""
    streamed = sorted(
        ((m.layer, path) for path, m in model.named_modules() if isinstance(m, StreamingExperts)), key=lambda t: t[0]
    )
    attached = []
    for (layer, path), (nxt, nxt_path) in zip(streamed, streamed[1:]):
        num_experts, k = shapes[nxt]
        block_path, _, experts_name = nxt_path.rpartition(".")
        fn = predictor(get_module(model, block_path), experts_name, num_experts, k)
        if fn is None and "." in block_path:  # experts nested one level deeper in their block
            outer, _, inner = block_path.rpartition(".")
            fn = predictor(get_module(model, outer), f"{inner}.{experts_name}", num_experts, k)
        get_module(model, path).use_lookahead(fn)
        if fn is not None:
            attached.append(layer)
    return attached
