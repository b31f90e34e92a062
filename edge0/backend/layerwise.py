"""Layer-major prefill: a prompt span goes through the model one decoder layer at a time, so each
MoE layer's routed experts are in memory once for the whole span, not once per chunk.

The family's own mlx-lm code runs. The model's forward is called once on the span with its
decoder layers swapped for `SpanLayer`s, which its loop calls as it calls its layers (extra
arguments, tuple returns); each runs its layer in two passes:

  A. the layer with its MoE block replaced by a stub that records the block's arguments and
     returns zeros: the output is the post-attention residual, and the layer's KV cache (or
     recurrent state) advances. Per query chunk, in order, so the score matrix stays bounded,
     when the layer's other arguments are masks the chunks can cut and its caches take a span in
     pieces (KV, quantized KV, recurrent state); otherwise over the whole span in one call, as
     mlx-lm's own forward would (a rotating window cache, an offset or shared KV argument);
  B. the MoE block over the recorded arguments in token chunks, inside the experts' `span` (the
     executor holds the layer's experts across the chunks), its output added to the residual.

Pass B relies on the decoder layer adding its MoE block's output to the residual stream; the
load-time probe (layer_probe.py) checks it, and a model whose layers fail it is prefilled chunk
by chunk instead, which the caller says and counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from edge0.backend import layer_probe as lp

# Caches a span can be fed in query chunks with the span's mask cut per chunk; others (a rotating
# window drops keys as it goes) take the span in one call.
CHUNKABLE_CACHES = (KVCache, QuantizedKVCache, ArraysCache)
SCORE_BYTES = 64 << 20  # bound on one attention chunk's score matrix (heads x queries x keys x 4)

__all__ = ["PrefillCancelled", "SpanPlan", "SpanLayer", "probe", "prefill_layerwise", "chunks", "whole_span"]
probe = lp.probe


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
    # the last layer computes its cache alone (SpanLayer); off while something watches every
    # layer's routes (a trace), which must see the last layer's too
    skip_last: bool = True

    def attention_chunk(self, keys: int) -> int:
        return max(16, min(self.moe_chunk, self.score_bytes // max(1, 4 * self.heads * keys)))

    def check(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise PrefillCancelled


def whole_span(found: lp.Probe, cache) -> bool:
    """Whether some layer's attention must take each span in one call (see the module docstring)."""
    return found.whole_span or not all(isinstance(c, CHUNKABLE_CACHES) for c in cache)


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) bounds of `size`-token chunks of n tokens, a last chunk of one token joined to
    the one before: the MoE block takes a one-token call for a decode step (the pre-router's)."""
    bounds = [[c, min(n, c + size)] for c in range(0, n, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        last = bounds.pop()
        bounds[-1][1] = last[1]
    return [tuple(b) for b in bounds]


def _cut(a, c0: int, c1: int, span: int):
    """An argument of a `span`-token layer call, cut to queries [c0, c1) (and the keys they see)."""
    kind = lp.mask_kind(a, span)
    if kind == "attention":  # [.., queries, keys]: keys up to the chunk's last query
        return a[..., c0:c1, : a.shape[-1] - (span - c1)]
    if kind == "tokens":  # a recurrent layer's [B, T] padding mask
        return a[..., c0:c1]
    return a  # None, "causal" (aligned to the last key, so it holds for any chunk), a cache


def _token_slice(args, x, c0: int, c1: int) -> tuple:
    """A MoE block's recorded arguments cut to tokens [c0, c1) on the token axis of its input `x`
    ([B, T, D] or [T, D]; other arrays aligned to it from the right)."""
    axis = x.ndim - 2

    def cut(a):
        at = a.ndim - (x.ndim - axis)
        return a[(slice(None),) * at + (slice(c0, c1),)] if isinstance(a, mx.array) and a.ndim > axis else a

    return tuple(cut(a) for a in args)


def _state_arrays(args) -> list:
    """The arrays of the caches among a layer call's arguments (evaluated after each chunk)."""
    return [a for c in args if lp.is_cache(c) for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]


def _keys_held(args) -> int:
    return max((int(getattr(c, "offset", 0) or 0) for c in args if lp.is_cache(c)), default=0)


def _joined(calls: list, axis_of) -> tuple:
    """The MoE block's arguments over the whole span: each chunk's arrays joined on the token axis."""
    if len(calls) == 1:
        return calls[0][0]
    out = []
    for i, a in enumerate(calls[0][0]):
        out.append(mx.concatenate([c[0][i] for c in calls], axis=axis_of(a)) if isinstance(a, mx.array) else a)
    return tuple(out)


class SpanLayer:
    """A decoder layer run over a whole span in the two passes above (callable as the layer)."""

    def __init__(
        self, layer: nn.Module, call: lp.LayerCall, plan: SpanPlan, whole: bool, last: bool = False, tail: bool = False
    ):
        self.layer, self.call, self.plan, self.whole = layer, call, plan, whole
        # The last layer's output feeds only the logits, which a prefill never needs: its keys and
        # values (its cache) are all it must compute, as mlx-lm's prefill does by evaluating the
        # caches alone; its attention and its experts (reads included) are skipped.
        self.last = last
        # ... unless the span's last position's logits are wanted (`tail`, the prompt's last token
        # fed in its span): then that position alone goes through its experts and on to the head
        self.tail = tail

    def __getattr__(self, name):  # the model's loop may read layer attributes (is_linear, ...)
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs):
        # args[0] [B, T, ...]: the span's hidden states entering this layer
        self.plan.check()
        stage_input = self.layer.stage_embedding if getattr(self.layer, "takes_received", False) else None
        if stage_input is not None:  # a pipeline stage's first layer: the span as received (stages.StageInput)
            args = (stage_input.received, *args[1:])
        if self.tail:
            out = self._tail(args, kwargs)
        elif self.last:
            stub = lp.Stub(mx.zeros_like) if self.call.moe is not None else None
            out = self._attention(args, kwargs, stub, state_only=True)
        else:
            out = self._whole(args, kwargs)
        if getattr(self.layer, "sends", False):  # a stage's last layer: the span's output goes on (stages.StageOutput)
            object.__setattr__(self.layer, "sent", out)
        return out

    def _tail(self, args, kwargs):
        """The model's last layer when the span's last position's logits are wanted: its cache over
        the span, and its output at that position only ([B, 1, D]; the model's norm and head then
        see one position). With `last` (nothing watches every route) only that position goes
        through the experts: the one token's route, read as a decode step reads it."""
        if not self.last or self.call.moe is None:
            out = self._whole(args, kwargs)
            h = lp.first(out)[:, -1:]
            return (h, *out[1:]) if isinstance(out, (tuple, list)) else h
        stub = lp.Stub(mx.zeros_like)
        out = self._attention(args, kwargs, stub, state_only=True, tail=True)
        (x, *rest), kw = stub.calls[-1]
        axis = x.ndim - 2  # the token axis: [B, T, D] or [T, D]
        t = x.shape[axis]
        y = self.layer[self.call.moe](*_token_slice((x, *rest), x, t - 1, t), **kw)
        h = lp.first(out)[:, -1:] + y
        mx.eval(h)
        return (h, *out[1:]) if isinstance(out, (tuple, list)) else h

    def _whole(self, args, kwargs):
        """The layer over the span: pass A, then its MoE block over the span in chunks (pass B)."""
        if self.call.moe is None:
            return self._attention(args, kwargs, None)
        block = self.layer[self.call.moe]
        executor = lp.streamed_experts(block).executor
        executor.begin_span(args[0].shape[1])  # a whole-layer read starts now, behind the attention
        try:
            stub = lp.Stub(mx.zeros_like)
            out = self._attention(args, kwargs, stub)
            y = self._moe(block, stub.calls)
            del stub
        finally:
            executor.end_span()
        h = lp.first(out) + y
        mx.eval(h)
        return (h, *out[1:]) if isinstance(out, (tuple, list)) else h

    def _attention(self, args, kwargs, stub, state_only: bool = False, tail: bool = False):
        """Pass A: the layer over query chunks, or the whole span (its MoE block stubbed when
        `stub` is given); returns its output, the hidden states joined over the chunks (left
        unevaluated with `state_only`: only the caches are computed). `tail`: only the last
        chunk's output is computed and returned; where the span can be cut, that chunk is the last
        token alone (its attention output is all the logits need)."""
        plan, span = self.plan, args[0].shape[1]
        held = _keys_held(list(args) + list(kwargs.values()))
        whole = self.whole or not self.call.cuttable
        chunk = span if whole else plan.attention_chunk(held + span)
        bounds = [(c0, min(span, c0 + chunk)) for c0 in range(0, span, chunk)]
        if tail and not whole and span > 1:
            bounds = [(c0, min(span - 1, c0 + chunk)) for c0 in range(0, span - 1, chunk)] + [(span - 1, span)]
        parts, out = [], None
        stage_input = self.layer.stage_embedding if getattr(self.layer, "takes_received", False) else None
        for c0, c1 in bounds:
            plan.check()
            a = (args[0][:, c0:c1], *(_cut(x, c0, c1, span) for x in args[1:]))
            kw = {k: _cut(v, c0, c1, span) for k, v in kwargs.items()}
            if stage_input is not None:  # the layer reads its input there (stages.StageInput): this chunk's
                object.__setattr__(stage_input, "received", a[0])
            out = self.layer(*a, **kw) if stub is None else lp.run_stubbed(self.layer, self.call.moe, stub, a, kw)
            states = _state_arrays(list(a) + list(kw.values()))
            if state_only and not (tail and c1 == span):
                mx.eval(*states)
            else:
                recorded = [x for x in stub.calls[-1][0] if isinstance(x, mx.array)] if stub is not None else []
                mx.eval(lp.first(out), *recorded, *states)
            parts.append(lp.first(out))
        if tail:
            parts = parts[-1:]
        h = mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        return (h, *out[1:]) if isinstance(out, (tuple, list)) else h

    def _moe(self, block, calls: list):
        """Pass B: the MoE block over the span's recorded arguments, in token chunks."""
        x = calls[0][0][0]
        axis = x.ndim - 2  # the token axis: [B, T, D] or [T, D]

        def axis_of(a):
            return a.ndim - (x.ndim - axis)

        args = _joined(calls, axis_of)
        kwargs = calls[0][1]
        tokens = args[0].shape[axis]
        ys = []
        for c0, c1 in chunks(tokens, self.plan.moe_chunk):
            self.plan.check()
            y = block(*_token_slice(args, x, c0, c1), **kwargs)
            mx.eval(y)
            ys.append(y)
        return mx.concatenate(ys, axis=axis) if len(ys) > 1 else ys[0]


def prefill_layerwise(
    model, tokens, cache, plan: SpanPlan, found: lp.Probe, logits: bool = False, output: bool = False
):
    """Feed `tokens` (one span: token ids, or a pipeline stage's input [1, T, D] as received) into
    `cache` layer by layer (see the module docstring), with the probe's findings `found`; raises
    PrefillCancelled when `plan.should_stop()` says so (the cache then holds part of the span).
    `logits`: returns the log-probs [1, V] after the span's last token (computed for that position
    alone), as a decode step feeding it would; `output`: returns the model's output over the span
    (a pipeline stage's, for the next stage); else None."""
    owner, key, layers = lp.decoder_layers(model)
    held = [layer for layer in layers if layer is not None]  # None: another stage's (decoder_layers)
    whole = whole_span(found, cache)
    last = len(held) - 1 if plan.skip_last else -1
    tail = len(held) - 1 if logits else -1
    spans = iter(
        [
            SpanLayer(layer, call, plan, whole, i == last, i == tail)
            for i, (layer, call) in enumerate(zip(held, found.calls))
        ]
    )
    owner[key] = [None if layer is None else next(spans) for layer in layers]
    try:
        inputs = tokens if isinstance(tokens, mx.array) else mx.array(tokens)[None]
        out = model(inputs, cache=cache)  # without `logits` or `output`, never evaluated
    finally:
        owner[key] = layers
    if output:
        mx.eval(out, [c.state for c in cache])
        return out
    mx.eval([c.state for c in cache])
    if not logits:
        return None
    last_logits = out[:, -1, :]
    logprobs = last_logits - mx.logsumexp(last_logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    return logprobs
