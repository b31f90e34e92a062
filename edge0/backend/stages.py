"""The pipeline setup of an mlx-lm model for one stage (edge0.distributed): which layers,
embedding, norm and head a stage holds, SkipLayers standing in for the other stages' layers of a
family mlx-lm does not pipeline, the runs of layers one stage must hold together, and where a
family's stages pass on more than the hidden state (backend/stage_messages.py)."""

from __future__ import annotations

import importlib
import inspect
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.models.pipeline import PipelineMixin

from edge0.backend.quantized_batch import BatchQuantizedKVCache
from edge0.backend.stage_messages import boundary, message
from edge0.errors import Edge0Error


# -- the pipeline setup of an mlx-lm model ---------------------------------------------------------
class _Ranks:
    """What PipelineMixin.pipeline reads from a group."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class StageEmbedding(nn.Module):
    """The embedding position of a pipeline stage. The first stage embeds token ids; the others
    return the hidden state `source(inputs)` from the previous stage. `as_linear` is the tied
    head on the last stage and passes the hidden state through elsewhere."""

    def __init__(self, embedding, embeds: bool, heads: bool, source):
        super().__init__()
        if embeds or heads:
            self.embedding = embedding
        object.__setattr__(self, "embeds", embeds)
        object.__setattr__(self, "heads", heads)
        object.__setattr__(self, "source", source)

    def __call__(self, inputs, **kwargs):
        if self.embeds:  # kwargs: an n-gram embedding's cache of earlier tokens (longcat_flash_ngram)
            return self.embedding(inputs, **kwargs)
        object.__setattr__(self, "received", self.source(inputs))  # for a StageInput layer
        return self.received

    def as_linear(self, x):
        return self.embedding.as_linear(x) if self.heads else x


class PassThrough(nn.Module):
    """Stands in for the final norm and the head on a stage that is not the last: its output is
    the hidden state for the next stage."""

    def __call__(self, x):
        return x


class SkipLayer(nn.Module):
    """A decoder layer that another stage runs, in a family mlx-lm does not pipeline: the hidden
    state passes through, and the layer's cache is fed placeholder keys one wide (a quantized
    cache: one group wide), so its offset, ring position and masks stay rank 0's (a family's mask
    comes from whichever layer's cache it names). Attributes a family reads from its layers
    (which kind of attention, for its caches) come from the layer it stands for, whose weights are
    never loaded."""

    def __init__(self, layer: nn.Module, extras=None):
        super().__init__()
        names = [n for n in inspect.signature(type(layer).__call__).parameters if n != "self"]
        object.__setattr__(self, "stands_for", layer)
        object.__setattr__(self, "cache_at", names.index("cache") - 1 if "cache" in names else None)
        # what the family's layers return beside the hidden state (_SKIPPED_RETURNS), or None
        object.__setattr__(self, "extras", extras)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "stands_for"), name)

    def __call__(self, x, *args, **kwargs):
        at = self.cache_at
        cache = kwargs.get("cache", args[at] if at is not None and at < len(args) else None)
        # a CacheList's caches each count tokens; a recurrent state counts none and stays empty
        for c in cache.caches if isinstance(cache, CacheList) else [cache] if cache is not None else []:
            if isinstance(c, _SKIPPABLE):
                width = c.group_size if isinstance(c, (QuantizedKVCache, BatchQuantizedKVCache)) else 1
                z = mx.zeros((x.shape[0], 1, x.shape[1], width), dtype=x.dtype)
                c.update_and_fetch(z, z)
        return x if self.extras is None else (x, *self.extras(kwargs))


# the caches a SkipLayer keeps in step (each keeps its offset from the keys it is fed), one
# sequence's or a batch's rows
_SKIPPABLE = (KVCache, RotatingKVCache, ChunkedKVCache, QuantizedKVCache, BatchKVCache, BatchRotatingKVCache)
# what a SkipLayer returns beside the hidden state, for families whose layers return more:
# hunyuan's (hidden, the KV its group's next layer reuses) and gemma4's (hidden, KV, offset), None
# here since the layers that read them sit on the same stage (layer_groups); kimi_k3's (hidden,
# attention-residual blocks), whose blocks pass on to the stage's next layer
_SKIPPED_RETURNS = {
    "hunyuan": lambda kwargs: (None,),
    "gemma4": lambda kwargs: (None, None),
    "gemma4_text": lambda kwargs: (None, None),
    "kimi_k3": lambda kwargs: (kwargs.get("blocks"),),
}


def layer_groups(model) -> tuple[int, ...] | None:
    """Sizes, in layer order, of the runs of layers that must stay on one stage together (None:
    every cut is allowed). A layer that attends with the KV an earlier layer computed must sit
    with it, and with every layer between: hunyuan's cross-layer attention shares each group's
    first layer's KV with the rest of the group (`cla_share_factor`); gemma4's KV-shared layers
    reuse the KV of the last earlier layer of their kind (mlx-lm's `previous_kvs`)."""
    inner = _pipeline_module(model)[1]
    n = len(inner[_names(inner, in_head=True)[1]])
    args = getattr(model, "args", None)
    together = []  # (first, last) layers of a run that must not be cut
    if getattr(model, "model_type", None) == "hunyuan" and getattr(args, "use_cla", False):
        g = int(args.cla_share_factor)
        together += [(i, min(i + g, n) - 1) for i in range(0, n, g)]
    together += [(p, j) for j, p in enumerate(getattr(inner, "previous_kvs", None) or []) if p != j]
    if not together:
        return None
    uncut = {b for first, last in together for b in range(first + 1, last + 1)}  # b: the cut before layer b
    cuts = [0, *(b for b in range(1, n) if b not in uncut), n]
    return tuple(b - a for a, b in zip(cuts, cuts[1:]))


# what the families call the embedding, the decoder layers and the final norm of their model
_EMBED = ("embed_tokens", "word_embeddings", "wte", "embeddings", "ngram_embeddings", "embd")  # phixtral: embd
_LAYERS = ("layers", "blocks", "h")  # phixtral: h
_NORM = ("norm", "norm_f", "final_layernorm", "embedding_norm")  # lfm2: embedding_norm


def _names(module, in_head: bool = False) -> tuple[str, str, str | None] | None:
    """(embedding, layers, final norm) attribute names of `module`, or None when it lacks one (or
    its layers are not a list); with `in_head`, the final norm may be missing (None): it is inside
    the model's untied head, which a stage that is not the last replaces whole."""
    found = [next((n for n in names if n in module), None) for names in (_EMBED, _LAYERS, _NORM)]
    if None in found[:2] or (found[2] is None and not in_head) or not isinstance(module[found[1]], list):
        return None
    return tuple(found)


def _pipeline_module(model) -> tuple[str, nn.Module]:
    """The module holding the decoder layers: mlx-lm's PipelineMixin model, or, for a family mlx-lm
    does not pipeline, the one module with an embedding, a list of layers and a final norm (Edge0
    runs a stage by standing SkipLayers in for the other stages' layers); failing that, the one
    with an embedding and a list of layers beside an untied head that holds the final norm
    (phixtral's lm_head.ln)."""
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, PipelineMixin)]
    if not found:
        found = [(p, m) for p, m in model.named_modules() if _names(m) is not None]
    if not found:
        modules = dict(model.named_modules())
        found = [
            (p, m)
            for p, m in modules.items()
            if _names(m, in_head=True) is not None and "lm_head" in modules.get(p.rpartition(".")[0], model)
        ]
    if len(found) != 1 or _names(found[0][1], in_head=True) is None:
        raise Edge0Error(
            f"model_type {getattr(model, 'model_type', '?')!r}: no module with an embedding, a list of "
            "layers and a final norm to split across ranks; run it in one process"
        )
    return found[0]


def num_layers(model) -> int:
    """Decoder layers of a model a stage can hold (an Edge0Error for others): what its stages
    pass on is a hidden state or a boundary Edge0 carries (`_boundary`), and some layer's cache
    counts the tokens it holds (the offset the stage exchange keeps in step across ranks; the
    recurrent state of linear-attention or SSM layers follows from the same forwards); a family
    mlx-lm does not pipeline also needs caches a SkipLayer keeps in step."""
    inner = _pipeline_module(model)[1]
    n = len(inner[_names(inner, in_head=True)[1]])
    boundary(model, inner)
    leaves = [leaf for c in make_prompt_cache(model) for leaf in _leaves(c)]
    odd = sorted({type(c).__name__ for c in leaves if not isinstance(c, (*_SKIPPABLE, ArraysCache))})
    if not isinstance(inner, PipelineMixin) and odd:
        raise Edge0Error(
            f"model_type {getattr(model, 'model_type', '?')!r}: its layers keep {', '.join(odd)} caches, which "
            "a stage cannot keep in step for the layers other ranks run; run it in one process"
        )
    if not any(hasattr(c, "offset") for c in leaves):  # the exchange keeps caches in step by their token counts
        raise Edge0Error(
            f"model_type {getattr(model, 'model_type', '?')!r}: no layer keeps a KV cache that counts its tokens "
            "(only recurrent state), which the stage exchange needs to keep the ranks in step; run it in one process"
        )
    if getattr(inner, "hidden_size_per_layer_input", None):  # gemma4's 2B/4B models
        raise Edge0Error(
            f"model_type {getattr(model, 'model_type', '?')!r}: its layers read per-layer inputs computed from the "
            "token ids and their embedding, which only the first stage holds (hidden_size_per_layer_input "
            f"{inner.hidden_size_per_layer_input}); run it in one process"
        )
    return n


def _leaves(cache) -> list:
    """A layer's cache, or the caches a CacheList holds."""
    return list(cache.caches) if isinstance(cache, CacheList) else [cache]


def _ends(model):
    """(the PipelineMixin module, the module that holds lm_head, their parameter-name prefixes,
    whether the head is tied to the embedding)."""
    path, inner = _pipeline_module(model)
    parent = path.rpartition(".")[0]
    owner = dict(model.named_modules())[parent] if parent else model
    return inner, owner, (f"{path}." if path else ""), (f"{parent}." if parent else ""), "lm_head" not in owner


def keep_stage_layers(model, rank: int, size: int, split: list[int], first: bool, last: bool) -> set[str]:
    """Keep the layers of `rank` with mlx-lm's PipelineMixin bookkeeping (rank 0 runs the last
    `split[0]` layers; a family's own adjustments run too), with mlx-lm's exchange off: the stage
    exchange replaces it. Returns the parameter-name prefixes of the ends this stage does not
    hold (embedding, final norm, head), whose weights are not loaded."""
    inner, _, pre, head_pre, tied = _ends(model)
    embed, layers, norm = _names(inner, in_head=True)
    if isinstance(inner, PipelineMixin):
        inner.pipeline(_Ranks(rank, size), split)
        inner.pipeline_rank, inner.pipeline_size = 0, 1
    else:  # mlx-lm's order: rank r runs the layers after those of ranks r + 1 ... size - 1
        start, held = sum(split[rank + 1 :]), inner[layers]
        extras = _SKIPPED_RETURNS.get(getattr(model, "model_type", None))
        for i in [i for i in range(len(held)) if not start <= i < start + split[rank]]:
            held[i] = SkipLayer(held[i], extras)
    skip = set()
    if not first and not (last and tied):
        skip.add(f"{pre}{embed}.")
    if not last:
        if norm is not None:  # else it is inside the head (_pipeline_module)
            skip.add(f"{pre}{norm}.")
        if not tied:
            skip.add(f"{head_pre}lm_head.")
    return skip


def replace_stage_ends(model, first: bool, last: bool) -> None:
    """After loading: give the stage its StageEmbedding (taking the hidden state as the model's
    input until `set_stage_source`), and a PassThrough for the final norm and head unless it is
    the last stage. A family whose stages pass on more than the hidden state runs its stage's
    forward from `_BOUNDARIES` (the message it sends and receives stands where the hidden state
    does)."""
    inner, owner, _, _, tied = _ends(model)
    embed, _, norm = _names(inner, in_head=True)
    inner[embed] = StageEmbedding(inner[embed], first, last and tied, lambda h: h)
    if not last:
        if norm is not None:  # else it is inside the head, replaced below
            inner[norm] = PassThrough()
        if not tied:
            owner.lm_head = PassThrough()
    if not isinstance(inner, PipelineMixin):
        _mark_stage_layers(inner, first, last, message(model, inner))
    staged = boundary(model, inner)
    if staged is not None:
        module = importlib.import_module(type(inner).__module__)
        inner.__class__ = type(f"Staged{type(inner).__name__}", (staged, type(inner)), {})
        object.__setattr__(inner, "stage_ends", (first, last))
        object.__setattr__(inner, "family_module", module)
        # what the layers of later stages read from this stage's and earlier ones (received here,
        # sent on), as mlx-lm's pipeline() computes it
        crossing = (module._crossing(inner.args, inner.start_idx), module._crossing(inner.args, inner.end_idx))
        object.__setattr__(inner, "crossing", crossing)


class StageInput:
    """Mixed into a stage's first layer (a family mlx-lm does not pipeline, not the first stage):
    its input is the hidden state the previous stage sent, as received, whatever the family's
    forward did to its embedding's output (granitemoe multiplies it, afmoe scales it); where the
    family's stages hand on more (`stage_message`), that is unpacked here."""

    takes_received = True  # a layer-major span (backend/layerwise.py) hands it each chunk there

    def __call__(self, x, *args, **kwargs):
        x = self.stage_embedding.received
        if self.stage_message is not None:
            x = self.stage_message.receive(x, kwargs)
        return super().__call__(x, *args, **kwargs)


class StageOutput:
    """Mixed into a stage's last layer (not the last stage): its output is what the stage sends on,
    before anything the family's forward does after its layers (granitemoe divides its logits)."""

    sends = True  # a layer-major span (backend/layerwise.py) sets `sent` to the whole span's output

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        object.__setattr__(self, "sent", out)
        return out


def _mark_stage_layers(inner, first: bool, last: bool, message) -> None:
    """StageInput and StageOutput mixed into the stage's first and last layers (their parameter
    names stay the same); `message`: how the family packs what its stages hand on (_message)."""
    embed, layers, _ = _names(inner, in_head=True)
    held = [layer for layer in inner[layers] if not isinstance(layer, SkipLayer)]
    for layer, mixin, needed in ((held[0], StageInput, not first), (held[-1], StageOutput, not last)):
        if needed:
            layer.__class__ = type(f"{mixin.__name__}{type(layer).__name__}", (mixin, type(layer)), {})
    object.__setattr__(held[0], "stage_embedding", inner[embed])
    object.__setattr__(held[0], "stage_message", message)
    object.__setattr__(inner, "stage_output", held[-1] if not last else None)
    object.__setattr__(inner, "stage_message", message)


def stage_output(model, out):
    """What a stage that is not the last sends on after `model(...)` returned `out`: its last
    layer's output (a family mlx-lm does not pipeline), else `out`."""
    inner = _pipeline_module(model)[1]
    layer = getattr(inner, "stage_output", None)
    if layer is None:
        return out
    if inner.stage_message is not None:
        return inner.stage_message.send(layer.sent)
    return layer.sent[0] if isinstance(layer.sent, tuple) else layer.sent  # hunyuan's (hidden, shared KV), ...


def set_stage_source(model, source) -> None:
    """Where a stage that does not embed gets its hidden state: `source(inputs)`, called when the
    model runs (rank 0 receives it from the previous stage there)."""
    inner = _pipeline_module(model)[1]
    object.__setattr__(inner[_names(inner, in_head=True)[0]], "source", source)


@contextmanager
def probe_input(model, hidden: int, dtype):
    """While the block runs, a stage that does not embed takes zeros [B, T, hidden] for its input
    (the layer probe feeds token ids; such a stage's layers take a hidden state)."""
    inner = _pipeline_module(model)[1]
    embedding = inner[_names(inner, in_head=True)[0]]
    if not isinstance(embedding, StageEmbedding) or embedding.embeds:
        yield
        return
    source = embedding.source
    object.__setattr__(embedding, "source", lambda ids: mx.zeros((*ids.shape, hidden), dtype=dtype))
    try:
        yield
    finally:
        object.__setattr__(embedding, "source", source)


class CacheWatch:
    """Mixed into rank 0's model: hands each forward's prompt cache to `cache_seen` before it runs
    (the stage exchange names that cache in the forward's message to the other ranks)."""

    def __call__(self, *args, **kwargs):
        self.cache_seen(kwargs.get("cache"))
        return super().__call__(*args, **kwargs)


def watch_forwards(model, fn) -> None:
    """`fn(cache)` hears of the prompt cache of each forward of `model` (rank 0 of a pipeline)."""
    model.__class__ = type(f"Watched{type(model).__name__}", (CacheWatch, type(model)), {})
    object.__setattr__(model, "cache_seen", fn)
