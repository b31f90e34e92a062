"""Unmerged LoRA: y = base(x) + (alpha / r) * (x @ A^T) @ B^T, with the (int4) base untouched.

Merging the delta into int4 weights and requantizing erases most of it (the deltas are smaller
than one 4-bit step), so adapters are always served as this parallel low-rank path."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from edge0.backend.modules import get_module, set_module
from edge0.errors import Edge0Error


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
        a, b = self.lora_a, self.lora_b
        if a.dtype != x.dtype:  # float32 master weights under a bf16/fp16 compute dtype
            a, b = a.astype(x.dtype), b.astype(x.dtype)
        # one fused op for scale * (x A^T) B^T + base(x): fewer graph nodes per decode step
        return mx.addmm(self.base(x), x @ a.T, b.T, alpha=self.scale)


def _input_dims(m) -> int:
    if isinstance(m, nn.QuantizedLinear):
        return m.weight.shape[1] * 32 // m.bits
    return m.weight.shape[1]


# Path components of routers, routed experts, embeddings and the output head: never adapted
# (experts must stay streamable; routers decide the route the pre-router predicts).
_EXCLUDE = {
    "gate",
    "router",
    "shared_expert_gate",
    "switch_mlp",
    "experts",
    "lm_head",
    "embed_tokens",
    "word_embeddings",
}
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
    """Linear paths matched by `targets`: each target is one or more whole path components
    ("q_proj", "self_attn.o_proj", a full path). Strict: a target that matches no adaptable
    module is an error."""
    candidates = candidate_linears(model)
    chosen, unmatched = set(), []
    for t in targets:
        hits = [p for p in candidates if f".{t}." in f".{p}."]
        if not hits:
            unmatched.append(t)
        chosen.update(hits)
    if unmatched:
        names = sorted({p.rsplit(".", 1)[1] for p in candidates})
        raise Edge0Error(
            f"--targets: {unmatched} match no attention, shared-expert or dense-MLP linear of this model; "
            f"choose among {names} (or full paths)"
        )
    return sorted(chosen)


def apply_lora(model: nn.Module, paths: list[str], r: int, alpha: float) -> dict[str, LoRALinear]:
    """Wrap each path's linear in a LoRALinear (in place); returns them by path."""
    wrapped = {}
    for path in paths:
        layer = LoRALinear(get_module(model, path), r, alpha)
        set_module(model, path, layer)
        wrapped[path] = layer
    return wrapped


def lora_tensors(wrapped: dict) -> dict[str, np.ndarray]:
    """The adapter's matrices as float32 numpy, keyed "<path>.lora_a" / "<path>.lora_b"."""
    return {
        f"{path}.{k}": np.array(v.astype(mx.float32))
        for path, m in wrapped.items()
        for k, v in (("lora_a", m.lora_a), ("lora_b", m.lora_b))
    }


def load_lora_tensors(wrapped: dict, tensors: dict, dtype) -> None:
    """Set each wrapped linear's matrices from `tensors` (as written by lora_tensors)."""
    for path, m in wrapped.items():
        m.lora_a = mx.array(tensors[f"{path}.lora_a"]).astype(dtype)
        m.lora_b = mx.array(tensors[f"{path}.lora_b"]).astype(dtype)
    mx.eval([m.parameters() for m in wrapped.values()])


def trainable_parameters(model: nn.Module) -> list[str]:
    """Names of the trainable parameters (after freeze() + apply_lora: only lora_a / lora_b)."""
    return [k for k, _ in tree_flatten(model.trainable_parameters())]


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRALinear of the model, by path."""
    return {p: m for p, m in model.named_modules() if isinstance(m, LoRALinear)}


def expected_shapes(model: nn.Module, paths: list[str], r: int) -> dict[str, tuple]:
    """The lora_a [r, in] and lora_b [out, r] shapes an adapter must have for `paths`."""
    out = {}
    for path in paths:
        m = get_module(model, path)
        out[f"{path}.lora_a"] = (r, _input_dims(m))
        out[f"{path}.lora_b"] = (m.weight.shape[0], r)
    return out


MERGES = ("fresh", "fixed", "float")


def merged_linear(layer: LoRALinear, how: str = "fresh") -> tuple[nn.Module, dict]:
    """The adapter merged into its base weight W (the dequantized int4 weight):
    - "fresh": W + dW quantized again from scratch with the base's group size and bits, as
      `mlx_lm convert -q` would quantize a merged checkpoint (new per-group scales and biases);
    - "fixed": W + dW rounded onto the base's own grid (its scales and biases kept), as a merge
      that only rewrites the int4 codes would do; held as a float layer with on-grid values;
    - "float": W + dW unquantized (a control: it keeps the whole delta).
    Returns (module, stats): `delta_kept` ||W' - W|| / ||dW||, `delta_aligned`
    <W' - W, dW> / ||dW||^2 (the part of the change that is the adapter's own),
    `below_half_step` the fraction of dW entries under half a quantization step of their group,
    `median_delta_in_steps` the median |dW| / step."""
    base = layer.base
    if how not in MERGES or not isinstance(base, nn.QuantizedLinear) or getattr(base, "mode", "affine") != "affine":
        raise Edge0Error(f"merge: needs an affine-quantized base and one of {MERGES}")
    gs, bits = base.group_size, base.bits
    delta = layer.scale * (layer.lora_b.astype(mx.float32) @ layer.lora_a.astype(mx.float32))
    bias = base.bias if "bias" in base else None
    w = mx.dequantize(base.weight, base.scales, base.biases, group_size=gs, bits=bits).astype(mx.float32)
    scale = mx.repeat(base.scales.astype(mx.float32), gs, axis=-1)
    step = mx.abs(scale)  # MLX picks the sign of each group's scale
    if how == "fresh":
        merged = nn.QuantizedLinear(w.shape[1], w.shape[0], bias=bias is not None, group_size=gs, bits=bits)
        qw, scales, biases = mx.quantize(w + delta, group_size=gs, bits=bits)
        merged.weight, merged.scales, merged.biases = (
            qw,
            scales.astype(base.scales.dtype),
            biases.astype(base.biases.dtype),
        )
        w_new = mx.dequantize(qw, scales, biases, group_size=gs, bits=bits).astype(mx.float32)
    else:
        if how == "fixed":
            offset = mx.repeat(base.biases.astype(mx.float32), gs, axis=-1)
            codes = mx.clip(mx.round((w + delta - offset) / scale), 0, 2**bits - 1)
            w_new = codes * scale + offset
        else:
            w_new = w + delta
        merged = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
        merged.weight = w_new.astype(base.scales.dtype)
    if bias is not None:
        merged.bias = bias
    norm2 = mx.maximum((delta * delta).sum(), 1e-30)
    return merged, {
        "delta_kept": float(mx.sqrt(((w_new - w) ** 2).sum() / norm2).item()),
        "delta_aligned": float((((w_new - w) * delta).sum() / norm2).item()),
        "below_half_step": float((mx.abs(delta) < step / 2).mean().item()),
        "median_delta_in_steps": float(np.median(np.array(mx.abs(delta) / step))),
    }


def merge_lora(model: nn.Module, how: str = "fresh") -> dict[str, dict]:
    """Replace every LoRALinear by its merged linear (in place, see merged_linear); stats by path."""
    stats = {}
    for path, layer in lora_modules(model).items():
        merged, stats[path] = merged_linear(layer, how)
        set_module(model, path, merged)
    mx.eval(model.parameters())
    return stats


def dequantize_resident(model: nn.Module, dtype: str) -> int:
    """Replace every resident QuantizedLinear / QuantizedEmbedding (attention, routers, embedding
    and head; the streamed experts are not in the tree) by a float layer holding the same
    dequantized weight. Same function up to summation order, but on the CPU MLX's quantized
    matmul is ~35x slower than a float GEMM at training batch sizes. Returns the module count."""
    dt = getattr(mx, dtype)
    swapped = [(p, m) for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    for path, m in swapped:
        w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits).astype(dt)
        if isinstance(m, nn.QuantizedEmbedding):
            new = nn.Embedding(w.shape[0], w.shape[1])
        else:
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                new.bias = m.bias
        new.weight = w
        set_module(model, path, new)
    mx.eval(model.parameters())
    return len(swapped)
