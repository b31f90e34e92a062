"""Unmerged LoRA: y = base(x) + (alpha / r) * (x @ A^T) @ B^T, with the (int4) base untouched.

Merging the delta into int4 weights and requantizing erases most of it (the deltas are smaller
than one 4-bit step), so adapters are always served as this parallel low-rank path."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten



class LoRALinear(nn.Module):
    """A frozen Linear/QuantizedLinear plus a trainable low-rank delta."""

    def __init__(self, base: nn.Module, r: int = 16, alpha: float = 32.0):
        super().__init__()
        out_dims, in_dims = base.weight.shape[0], _input_dims(base)
        self.base = base
        self.base.freeze()
        self.scale = alpha / r
        bound = 1 / math.sqrt(in_dims)
        self.lora_a = mx.random.uniform(-bound, bound, (r, in_dims))
        self.lora_b = mx.zeros((out_dims, r))  # the delta starts at zero

    def __call__(self, x):
        delta = (x @ self.lora_a.T.astype(x.dtype)) @ self.lora_b.T.astype(x.dtype)
        return self.base(x) + self.scale * delta


def _input_dims(m) -> int:
    if isinstance(m, nn.QuantizedLinear):
        return m.weight.shape[1] * 32 // m.bits
    return m.weight.shape[1]


# Path components of routers, routed experts, embeddings and the output head: never adapted
# (experts must stay streamable; routers decide the route the pre-router predicts).
_EXCLUDE = {"gate", "router", "shared_expert_gate", "switch_mlp", "experts", "lm_head", "embed_tokens", "word_embeddings"}
_INCLUDE = {"self_attn", "linear_attn", "attention", "shared_expert", "shared_experts", "mlp"}


def candidate_linears(model: nn.Module) -> list[str]:
    """Paths of every Linear/QuantizedLinear that LoRA may adapt: attention and linear-attention
    projections, shared-expert projections and dense MLPs; never routers or routed experts."""
    out = []
    for path, m in model.named_modules():
        parts = set(path.split("."))
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and parts & _INCLUDE and not parts & _EXCLUDE:
            out.append(path)
    return sorted(out)


def resolve_targets(model: nn.Module, targets) -> list[str]:
    """Linear paths matched by `targets` (substrings of module paths). Strict: a target that
    matches no adaptable module is an error."""
    candidates = candidate_linears(model)
    chosen, unmatched = set(), []
    for t in targets:
        hits = [p for p in candidates if t in p.split(".") or p.endswith(t) or f".{t}." in f".{p}."]
        if not hits:
            unmatched.append(t)
        chosen.update(hits)
    if unmatched:
        raise ValueError(f"LoRA targets {unmatched} match no attention, shared-expert or dense-MLP linear of this model")
    return sorted(chosen)


def _get(root, path):
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def apply_lora(model: nn.Module, paths: list[str], r: int, alpha: float) -> dict[str, LoRALinear]:
    """Wrap each path's linear in a LoRALinear (in place); returns them by path."""
    wrapped = {}
    for path in paths:
        parent, name = path.rsplit(".", 1)
        p = _get(model, parent)
        layer = LoRALinear(p[name], r, alpha)
        p[name] = layer
        wrapped[path] = layer
    return wrapped


def lora_tensors(wrapped: dict) -> dict[str, np.ndarray]:
    return {f"{path}.{k}": np.array(v.astype(mx.float32)) for path, m in wrapped.items()
            for k, v in (("lora_a", m.lora_a), ("lora_b", m.lora_b))}


def load_lora_tensors(wrapped: dict, tensors: dict, dtype) -> None:
    for path, m in wrapped.items():
        m.lora_a = mx.array(tensors[f"{path}.lora_a"]).astype(dtype)
        m.lora_b = mx.array(tensors[f"{path}.lora_b"]).astype(dtype)
    mx.eval([m.parameters() for m in wrapped.values()])


def trainable_parameters(model: nn.Module):
    return [k for k, _ in tree_flatten(model.trainable_parameters())]
