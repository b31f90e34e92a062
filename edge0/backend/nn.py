"""Streaming modules that stand in for mlx-lm's expert layers, model assembly from a store, and
the forward/sampling calls the engine uses."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.models.cache import (can_trim_prompt_cache, load_prompt_cache, make_prompt_cache, save_prompt_cache,
                                  trim_prompt_cache)
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import common_prefix_len

from edge0.backend import distributed as bdist
from edge0.backend import io as bio
from edge0.backend.routing import expert_scores, route

__all__ = ["make_prompt_cache", "make_sampler", "can_trim_prompt_cache", "trim_prompt_cache", "common_prefix_len",
           "save_prompt_cache"]


def get_module(root, path: str):
    """The module (or array) at a dotted path, e.g. "model.layers.3.mlp.gate"."""
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def set_module(root, path: str, value) -> None:
    """Replace the module at a dotted path (a top-level name included)."""
    parent, _, name = path.rpartition(".")
    (get_module(root, parent) if parent else root)[name] = value


class StreamingExperts(nn.Module):
    """Stands in for an mlx-lm SwitchGLU/SwitchMLP whose stacked expert tensors stay on disk.

    Per call, `executor(indices, scores)` returns [(tensors of some experts, the route's indices
    mapped into them)]; the original mlx-lm module runs its own math on each and the parts are
    summed; then `executor.done(output)`. `scores` (router scores over all experts, lazy) come
    from a SpecMoEBlock's gate; mlx-lm's own blocks pass none.
    """

    def __init__(self, inner: nn.Module, layer: int):
        super().__init__()
        # Empty placeholders: the module must not keep expert tensors between calls (a whole
        # layer per MoE layer would pile up after a prefill).
        blank = tree_map(lambda _: mx.zeros((0,)), inner.parameters())
        inner.update(blank)
        # Plain attributes, not children: the experts' tensors must not count as resident.
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "blank", blank)
        object.__setattr__(self, "executor", None)  # set by attach_executors
        self.layer = layer

    def __call__(self, x, indices, scores=None):
        y = None
        for params, local in self.executor(indices, scores):  # several parts are summed (hot + misses)
            self.inner.update(params)
            part = self.inner(x, local)
            y = part if y is None else y + part
        self.inner.update(self.blank)  # the lazy graph keeps what it needs
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
            self.capture(np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1]),
                         np.array(inds).reshape(-1, inds.shape[-1]), np.array(probs).reshape(-1, probs.shape[-1]))


def assemble(root: Path, resident_file: str, manifest: dict, config: dict, spec, k: int | None, compute_dtype: str,
             stage: tuple[int, int, list[int]] | None = None):
    """Build the model of a store: resident weights loaded and evaluated, each expert module
    replaced by a StreamingExperts (see attach_executors), and, for spec'd families, each MoE
    block replaced by a SpecMoEBlock serving width `k`.

    `stage` = (rank, ranks, layers per rank, rank 0 first): a pipeline stage that holds only its
    layers (`manifest` lists only their experts), the embedding on the first stage (the last rank)
    and the final norm and head on the last (rank 0); other weights are never read."""
    model = bio.build_model(config, root)
    resident = bio.lazy_load([root / resident_file])
    names = set(resident)
    for layer in manifest["expert_layers"]:
        names.update(f"{layer['module']}.{t}" for t in layer["tensors"])
    q = config.get("quantization")
    if q:
        def predicate(p, m):
            if p in q:
                return q[p]
            return hasattr(m, "to_quantized") and f"{p}.scales" in names

        nn.quantize(model, q["group_size"], q["bits"], mode=q.get("mode", "affine"), class_predicate=predicate)

    dt = getattr(mx, compute_dtype)
    for layer in manifest["expert_layers"]:
        path = layer["module"]
        set_module(model, path, StreamingExperts(get_module(model, path), layer["layer"]))
        if spec is not None:
            block_path = path[: -len(spec.experts) - 1]
            set_module(model, block_path, SpecMoEBlock(get_module(model, block_path), spec, k, layer["layer"]))

    keep = None
    if stage is not None:
        rank, size, split = stage
        skip = bdist.keep_stage_layers(model, rank, size, split, rank == size - 1, rank == 0)
        keep = {n for n, _ in tree_flatten(model.parameters()) if not any(n.startswith(p) for p in skip)}
        missing = keep - set(resident)
        if missing:
            raise ValueError(f"Missing parameters: {', '.join(sorted(missing)[:5])}.")
    cast = getattr(model, "cast_predicate", lambda _: True)
    weights = [
        (n, w.astype(dt) if mx.issubdtype(w.dtype, mx.floating) and cast(n) else w)
        for n, w in resident.items() if keep is None or n in keep
    ]
    model.eval()
    model.load_weights(weights, strict=keep is None)
    if stage is not None:
        bdist.replace_stage_ends(model, rank == size - 1, rank == 0)
    mx.eval(model.parameters())
    return model


def attach_executors(model: nn.Module, executors: dict) -> None:
    """Give every StreamingExperts its executor, by layer."""
    for _, m in model.named_modules():
        if isinstance(m, StreamingExperts):
            object.__setattr__(m, "executor", executors[m.layer])


def moe_blocks(model: nn.Module) -> list[tuple[int, SpecMoEBlock]]:
    """(layer index, block) of every SpecMoEBlock, in layer order."""
    found = [(bio.layer_index(p), m) for p, m in model.named_modules() if isinstance(m, SpecMoEBlock)]
    return sorted(found, key=lambda t: t[0])


def resident_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def cache_offset(cache) -> int:
    """Tokens a prompt cache holds (0 for none)."""
    return int(cache[0].offset) if cache else 0


def forward(model, tokens: list[int], cache) -> mx.array:
    """Run tokens through the model (updating `cache`); returns last-position log-probs [V]."""
    logits = model(mx.array(tokens)[None], cache=cache)[:, -1, :]
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def prefill(model, tokens: list[int], cache, step: int = 2048) -> None:
    """Fill `cache` with `tokens` in chunks, as mlx-lm does before the first decode step."""
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i : i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def prompt_cache_nbytes(cache) -> int:
    """Bytes of the KV arrays a prompt cache holds (about its size on disk)."""
    return sum(v.nbytes for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array))


def read_prompt_cache(path: str):
    """(cache, metadata) from a `save_prompt_cache` file, its arrays read now, so a damaged file
    fails here and not in a later forward."""
    cache, metadata = load_prompt_cache(path, return_metadata=True)
    mx.eval([c.state for c in cache])
    return cache, metadata


def prompt_cache_metadata(path: str) -> dict:
    """The metadata `save_prompt_cache` stored in `path`, from the safetensors header alone."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if not 0 < size < 1 << 30:
            raise ValueError(f"not a safetensors file (header size {size})")
        header = json.loads(fh.read(size))
    metadata = tree_unflatten(list((header.get("__metadata__") or {}).items()))
    if not isinstance(metadata, list) or not metadata or not isinstance(metadata[0], dict):
        raise ValueError("no prompt-cache metadata")
    return metadata[0]


def full_logits(model, tokens: list[int]):
    """Logits of every position for one prompt, without a cache (float32 numpy [T, V])."""
    out = model(mx.array(tokens)[None])[0].astype(mx.float32)
    return np.array(out)


def sample(sampler, logprobs) -> int:
    return sampler(logprobs[None]).item()


def resident_logits_fn(path: Path):
    """Logits of an mlx-lm / Hugging Face model loaded entirely in memory (a reference run)."""
    from mlx_lm.utils import load as mlx_lm_load

    model, _ = mlx_lm_load(str(path))

    def logits(tokens):
        return np.array(model(mx.array(tokens)[None])[0].astype(mx.float32))

    return logits
