"""Layer-major prefill: a prompt span goes through the model one decoder layer at a time, so each
MoE layer's routed experts are in memory once for the whole span, not once per chunk.

The family's own mlx-lm code runs. The model's forward is called once on the span with its
decoder layers swapped for `SpanLayer`s; each runs its layer in two passes:

  A. per query chunk, the layer with its MoE block replaced by a stub that records the block's
     input and returns zeros: the output is the post-attention residual, and the layer's KV cache
     (or recurrent state) advances chunk by chunk, in order, so the score matrix stays bounded;
  B. the MoE block over the recorded inputs in token chunks, inside the experts' `span` (the
     executor holds the layer's experts across the chunks), its output added to the residual.

Pass B relies on the decoder layer adding its MoE block's output to the residual stream
(`out = h + moe(norm(h))`, true of every mlx-lm MoE family checked); a probe checks it once per
layer class, and a model whose layers fail it (or whose caches cannot be fed in chunks, such as a
rotating window cache) is prefilled chunk by chunk instead, which the caller counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from edge0.backend.moe import StreamingExperts

# The caches a span can be fed to in chunks with the span's mask sliced per chunk. A rotating
# window cache drops keys as it goes, so the span's mask would not describe its chunks.
CHUNKABLE_CACHES = (KVCache, QuantizedKVCache, ArraysCache)
SCORE_BYTES = 64 << 20  # bound on one attention chunk's score matrix (heads x queries x keys x 4)
_residual_verdicts: dict[type, bool] = {}  # per decoder layer class: does out = h + moe(...)?


class PrefillCancelled(Exception):
    """`should_stop()` said so between two layers or chunks; the KV cache holds part of the span."""


@dataclass
class SpanPlan:
    """How a span is cut: `moe_chunk` tokens per MoE call, attention chunks sized so one score
    matrix stays under `score_bytes` (16 to `moe_chunk` queries), and `should_stop` checked
    between layers and chunks."""

    moe_chunk: int = 512
    heads: int = 32
    should_stop: Callable[[], bool] | None = None
    score_bytes: int = SCORE_BYTES

    def attention_chunk(self, keys: int) -> int:
        return max(16, min(self.moe_chunk, self.score_bytes // max(1, 4 * self.heads * keys)))

    def check(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise PrefillCancelled


def model_dims(model) -> tuple[int, int]:
    """(hidden size, attention heads) from the model's config (a text_config included); hidden 0
    when the config does not say (the model is then prefilled chunk by chunk)."""
    args = getattr(model, "args", None)
    cfg = dict(vars(args)) if args is not None else {}
    if isinstance(cfg.get("text_config"), dict):
        cfg.update(cfg["text_config"])
    return int(cfg.get("hidden_size") or 0), int(cfg.get("num_attention_heads") or 32)


def decoder_layers(model) -> tuple[nn.Module, str, list] | None:
    """(owner module, attribute, list) of the model's decoder layers, or None."""
    layers = getattr(model, "layers", None)
    if not layers:
        return None
    for _, m in model.named_modules():
        for key, value in m.items():
            if isinstance(value, list) and value and value[0] is layers[0]:
                return m, key, value
    return None


def moe_child(layer: nn.Module) -> str | None:
    """The name of the layer's direct child that holds its streamed experts (its MoE block), or None."""
    for name, child in layer.items():
        if isinstance(child, StreamingExperts):
            return name
        if isinstance(child, nn.Module) and any(isinstance(m, StreamingExperts) for _, m in child.named_modules()):
            return name
    return None


def streamed_experts(block: nn.Module) -> StreamingExperts:
    if isinstance(block, StreamingExperts):
        return block
    return next(m for _, m in block.named_modules() if isinstance(m, StreamingExperts))


class _Stub(nn.Module):
    """Stands in for a MoE block in pass A: records its input and returns `value(x)`."""

    def __init__(self, value):
        super().__init__()
        object.__setattr__(self, "inputs", [])
        object.__setattr__(self, "value", value)

    def __call__(self, x):
        self.inputs.append(x)
        return self.value(x)


def _run_stubbed(layer: nn.Module, name: str, stub: _Stub, x, mask, cache):
    block = layer[name]
    layer[name] = stub
    try:
        return layer(x, mask=mask, cache=cache)
    finally:
        layer[name] = block


def residual_moe(layer: nn.Module, name: str, dim: int, dtype) -> bool:
    """Whether the layer adds its MoE block's output to the residual stream: one token through
    the layer (no cache) with the block returning 0, then a fixed z; the outputs must differ by z."""
    cls = type(layer)
    if cls not in _residual_verdicts:
        dt = getattr(mx, dtype) if isinstance(dtype, str) else dtype
        x = mx.random.normal((1, 1, dim), key=mx.random.key(0)).astype(dt)
        z = mx.random.normal((1, 1, dim), key=mx.random.key(1)).astype(dt)
        base = _run_stubbed(layer, name, _Stub(mx.zeros_like), x, None, None)
        with_z = _run_stubbed(layer, name, _Stub(lambda _: z), x, None, None)
        _residual_verdicts[cls] = bool(mx.allclose(with_z - base, z, rtol=1e-3, atol=1e-3).item())
    return _residual_verdicts[cls]


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) bounds of `size`-token chunks of n tokens, a last chunk of one token joined to
    the one before: the MoE block takes a one-token call for a decode step (the pre-router's)."""
    bounds = [[c, min(n, c + size)] for c in range(0, n, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        last = bounds.pop()
        bounds[-1][1] = last[1]
    return [tuple(b) for b in bounds]


def _chunk_mask(mask, c0: int, c1: int, span: int):
    """The span's mask cut to queries [c0, c1) and the keys they see."""
    if mask is None or isinstance(mask, str):
        return mask  # "causal" is aligned to the last key, so it holds for any chunk
    if mask.ndim >= 2 and mask.shape[-2] == span:  # attention: [.., queries, keys]
        return mask[..., c0:c1, : mask.shape[-1] - (span - c1)]
    return mask[..., c0:c1]  # a recurrent layer's [B, T] padding mask


def _state_arrays(cache) -> list:
    if cache is None:
        return []
    state = cache.state
    items = state if isinstance(state, (list, tuple)) else [state]
    flat = []
    for s in items:
        flat.extend(s if isinstance(s, (list, tuple)) else [s])
    return [a for a in flat if isinstance(a, mx.array)]


def _keys_held(cache) -> int:
    return int(getattr(cache, "offset", 0) or 0)


class SpanLayer:
    """A decoder layer run over a whole span in the two passes above (callable as the layer)."""

    def __init__(self, layer: nn.Module, plan: SpanPlan):
        self.layer, self.plan = layer, plan
        self.moe = moe_child(layer)

    def __getattr__(self, name):  # the model's loop may read layer attributes (is_linear, ...)
        return getattr(self.layer, name)

    def __call__(self, x, mask=None, cache=None):
        # x [1, T, D]: the span's hidden states entering this layer
        self.plan.check()
        if self.moe is None:
            return self._attention(x, mask, cache, None)
        block = self.layer[self.moe]
        executor = streamed_experts(block).executor
        executor.begin_span(x.shape[1])  # a whole-layer read starts now, behind the attention
        try:
            stub = _Stub(mx.zeros_like)
            h = self._attention(x, mask, cache, stub)
            moe_in = mx.concatenate(stub.inputs, axis=1) if len(stub.inputs) > 1 else stub.inputs[0]
            del stub
            y = self._moe(block, moe_in)
        finally:
            executor.end_span()
        out = h + y
        mx.eval(out)
        return out

    def _attention(self, x, mask, cache, stub):
        """Pass A: the layer over query chunks (its MoE block stubbed when `stub` is given)."""
        plan, layer, span = self.plan, self.layer, x.shape[1]
        chunk = plan.attention_chunk(_keys_held(cache) + span)
        parts = []
        for c0 in range(0, span, chunk):
            plan.check()
            c1 = min(span, c0 + chunk)
            m, xc = _chunk_mask(mask, c0, c1, span), x[:, c0:c1]
            if stub is None:
                out = layer(xc, mask=m, cache=cache)
            else:
                out = _run_stubbed(layer, self.moe, stub, xc, m, cache)
            mx.eval(out, *(stub.inputs[-1:] if stub is not None else []), *_state_arrays(cache))
            parts.append(out)
        return mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    def _moe(self, block, moe_in):
        """Pass B: the MoE block over the span's recorded inputs, in token chunks."""
        ys = []
        for c0, c1 in chunks(moe_in.shape[1], self.plan.moe_chunk):
            self.plan.check()
            y = block(moe_in[:, c0:c1])
            mx.eval(y)
            ys.append(y)
        return mx.concatenate(ys, axis=1) if len(ys) > 1 else ys[0]


def layerwise_ready(model, cache, dim: int, dtype) -> bool:
    """Whether `prefill_layerwise` can run this model and cache: chunkable caches, and every
    decoder layer with streamed experts adds their output to its residual stream."""
    found = decoder_layers(model)
    if not dim or found is None or not all(isinstance(c, CHUNKABLE_CACHES) for c in cache):
        return False
    for layer in found[2]:
        name = moe_child(layer)
        if name is not None and not residual_moe(layer, name, dim, dtype):
            return False
    return True


def prefill_layerwise(model, tokens: list[int], cache, plan: SpanPlan) -> None:
    """Feed `tokens` (one span) into `cache` layer by layer (see the module docstring); raises
    PrefillCancelled when `plan.should_stop()` says so (the cache then holds part of the span)."""
    owner, key, layers = decoder_layers(model)
    owner[key] = [SpanLayer(layer, plan) for layer in layers]
    try:
        model(mx.array(tokens)[None], cache=cache)  # the logits are never evaluated
    finally:
        owner[key] = layers
    mx.eval([c.state for c in cache])
