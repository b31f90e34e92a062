"""What layer-major prefill needs to know about a model, learnt once at load from the model's own
forward: how its model calls each decoder layer (extra arguments, tuple returns) and whether the
layer adds its MoE block's output to the residual stream.

The probe feeds two tokens through the model twice, each time into a fresh cache, with every MoE
block replaced by a stub (no expert is read): first the stub returns zeros and each layer's
input is recorded; then each layer gets its recorded input again and the stub returns a fixed z.
A layer passes when its outputs differ by exactly z. The decoder layers are called by the
model's own loop, with whatever arguments it gives them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import _BaseCache, make_prompt_cache
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from edge0.backend.io import decoder_layers
from edge0.backend.moe import StreamingExpertList, StreamingExperts

STREAMED = (StreamingExperts, StreamingExpertList)
EXPERTS = (*STREAMED, SwitchGLU, SwitchMLP)  # streamed, or mlx-lm's own (a model built from a config)
PROBE_TOKENS = [1, 2]


@dataclass(frozen=True)
class LayerCall:
    """One decoder layer as its model calls it."""

    moe: str | None  # the layer's child that holds its streamed experts (its MoE block)
    residual: bool  # the layer adds that child's output to its residual stream (out = h + moe(...))
    cuttable: bool  # its arguments besides the hidden states are masks (or None): a span cuts them by query


@dataclass(frozen=True)
class Probe:
    """The probe's findings: `calls` per decoder layer, or `why_not` (the model is then prefilled
    by mlx-lm's chunked forward)."""

    calls: tuple[LayerCall, ...] = ()
    why_not: str | None = None
    hidden: int = 0  # the hidden size entering the first decoder layer

    @property
    def whole_span(self) -> bool:
        """A layer takes arguments a span cannot cut by query: its attention runs over the span at once."""
        return any(c.moe is not None and not c.cuttable for c in self.calls)


def _holds_experts(m) -> bool:
    if isinstance(m, EXPERTS):
        return True
    if not isinstance(m, nn.Module):
        return False
    return isinstance(m.get("experts"), list) or any(isinstance(c, EXPERTS) for _, c in m.named_modules())


def moe_child(layer: nn.Module) -> str | None:
    """The name of the layer's direct child that holds its routed experts (its MoE block), or None."""
    return next((name for name, child in layer.items() if _holds_experts(child)), None)


def streamed_experts(block: nn.Module):
    """The StreamingExperts (or StreamingExpertList) inside a MoE block."""
    if isinstance(block, STREAMED):
        return block
    return next(m for _, m in block.named_modules() if isinstance(m, STREAMED))


def is_cache(a) -> bool:
    return isinstance(a, _BaseCache)


def mask_kind(a, span: int) -> str | None:
    """The kind of mask `a` is: "attention" for a [.., queries, keys] mask of a `span`-token
    call, "tokens" for a [B, T] padding mask (recurrent layers), None for anything else."""
    if not isinstance(a, mx.array):
        return None
    if a.ndim >= 2 and a.shape[-2] == span and a.shape[-1] >= span:
        return "attention"
    if a.ndim == 2 and a.shape[-1] == span:
        return "tokens"
    return None


def cuttable(args, kwargs, span: int) -> bool:
    """Whether every argument besides the hidden states is None, a string mask, a cache or a
    mask the span's query chunks can cut."""
    rest = list(args[1:]) + list(kwargs.values())
    return all(a is None or isinstance(a, str) or is_cache(a) or mask_kind(a, span) is not None for a in rest)


def first(out):
    """The hidden states of a layer's output (some layers return a tuple)."""
    return out[0] if isinstance(out, (tuple, list)) else out


class Stub(nn.Module):
    """Stands in for a MoE block: records the arguments of each call and returns `value(x)`."""

    def __init__(self, value):
        super().__init__()
        object.__setattr__(self, "calls", [])
        object.__setattr__(self, "value", value)

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.value(args[0])


def run_stubbed(layer: nn.Module, name: str, stub: Stub, args, kwargs):
    block = layer[name]
    layer[name] = stub
    try:
        return layer(*args, **kwargs)
    finally:
        layer[name] = block


class _Recorder:
    """Pass 1 of the probe: the layer with its MoE block returning zeros; records its input,
    output and how it was called."""

    def __init__(self, layer):
        self.layer, self.moe = layer, moe_child(layer)
        self.input = self.output = self.cuttable = None

    def __getattr__(self, name):  # the model's loop may read layer attributes (is_linear, ...)
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs):
        self.input = args[0]
        if self.moe is None:
            out = self.layer(*args, **kwargs)
        else:
            out = run_stubbed(self.layer, self.moe, Stub(mx.zeros_like), args, kwargs)
        rest_none = not isinstance(out, (tuple, list)) or all(o is None for o in out[1:])
        self.cuttable = cuttable(args, kwargs, args[0].shape[1]) and rest_none
        self.output = first(out)
        mx.eval(self.output)
        return out


class _Checker:
    """Pass 2: the recorded input again, the MoE block returning z; `residual` when the output moved by z."""

    def __init__(self, recorder: _Recorder, seed: int):
        self.recorder, self.seed = recorder, seed
        self.residual = None

    def __getattr__(self, name):
        return getattr(self.recorder.layer, name)

    def __call__(self, *args, **kwargs):
        r = self.recorder
        if r.moe is None:
            return r.layer(*args, **kwargs)
        args = (r.input, *args[1:])
        z = mx.random.normal(r.input.shape, key=mx.random.key(self.seed)).astype(r.input.dtype)
        out = run_stubbed(r.layer, r.moe, Stub(lambda x: z if x.shape == z.shape else mx.zeros_like(x)), args, kwargs)
        moved = first(out) - r.output
        if moved.shape != z.shape:
            self.residual = False
        else:
            scale = 1.0 + mx.abs(r.output).max()
            tol = 1e-3 if r.output.dtype == mx.float32 else 3e-2
            self.residual = bool((mx.abs(moved - z).max() <= tol * scale).item())
        return out


class _NoExperts:
    """A decoder layer with its MoE block returning zeros (nothing evaluated, no expert read)."""

    def __init__(self, layer):
        self.layer, self.moe = layer, moe_child(layer)

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs):
        if self.moe is None:
            return self.layer(*args, **kwargs)
        return run_stubbed(self.layer, self.moe, Stub(mx.zeros_like), args, kwargs)


def forward_without_experts(model, tokens: list[int], cache) -> None:
    """Feed `tokens` into `cache` lazily, every MoE block returning zeros: the cache's arrays get
    their shapes, and nothing is computed unless the caller evaluates them (the KV footprint)."""
    owner, key, layers = decoder_layers(model)
    owner[key] = [layer if layer is None else _NoExperts(layer) for layer in layers]
    try:
        model(mx.array([tokens]), cache=cache)
    finally:
        owner[key] = layers


def probe(model) -> Probe:
    """Learn how `model`'s decoder layers are called (see the module docstring). Never raises: a
    model the probe cannot run is reported in `why_not`."""
    found = decoder_layers(model)
    if found is None:
        return Probe(why_not="the model has no list of decoder layers")
    owner, key, layers = found
    held = [layer for layer in layers if layer is not None]  # None: another stage's (decoder_layers)
    recorders = [_Recorder(layer) for layer in held]
    checkers = [_Checker(r, i + 1) for i, r in enumerate(recorders)]
    try:
        for wrappers in (recorders, checkers):
            it = iter(wrappers)
            owner[key] = [None if layer is None else next(it) for layer in layers]
            mx.eval(model(mx.array([PROBE_TOKENS]), cache=make_prompt_cache(model)))
    except Exception as e:  # any failure means "not layer by layer", said by the caller
        return Probe(why_not=f"its layers could not be probed ({type(e).__name__}: {e})")
    finally:
        owner[key] = layers
    calls = []
    for i, (r, c) in enumerate(zip(recorders, checkers)):
        if r.cuttable is None:
            return Probe(why_not=f"decoder layer {i} is not called by the model's forward")
        if r.moe is not None and not c.residual:
            name = type(r.layer).__name__
            return Probe(why_not=f"decoder layer {i} ({name}) does not add its MoE output to its residual stream")
        calls.append(LayerCall(r.moe, r.moe is None or bool(c.residual), r.cuttable))
    return Probe(calls=tuple(calls), hidden=int(recorders[0].input.shape[-1]))


def model_config(model) -> dict:
    """The model's arguments as a plain dict, a nested text_config (a dict or a dataclass) as a dict."""
    args = getattr(model, "args", None)
    if args is None:
        return {}
    return {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in vars(args).items()}
