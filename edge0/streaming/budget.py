"""The default expert-cache budget: the memory this process can still use (the one probe,
backend.memory: MemAvailable, the cgroup limit or vm_stat), measured once the resident weights are
loaded, less the KV cache at the configured context, what a prefill of that context holds (two
layers of experts and the span's activations) and a headroom. See docs/architecture.md
("Expert pool")."""

from __future__ import annotations

from dataclasses import dataclass, replace

from edge0.backend import memory
from edge0.spec import text_config
from edge0.units import format_size

DEFAULT_CONTEXT = 4096  # tokens of KV cache the default budget leaves room for
HEADROOM_MIN = 64 << 20  # MLX temporaries, Python objects, read buffers
HEADROOM_SHARE = 0.10  # of the available memory, when that is more: other processes come and go
PREFILL_LAYERS = 2  # whole-layer prefill holds the layer computing and the next one read ahead
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(config: dict, compute_dtype: str, kv_bits: int | None = None, kv_group_size: int = 64) -> int:
    """KV-cache bytes one token adds, from config.json (K and V of every full-attention layer in
    the compute dtype; MLA families cache one latent and one rope key per layer). With `kv_bits`,
    mlx-lm's quantized cache: `kv_bits` per value plus a scale and a bias per group."""
    c = text_config(config)
    layers = int(c.get("num_hidden_layers") or 0)
    full = layers // int(c.get("full_attention_interval") or 1)  # hybrid: linear-attention layers keep a fixed state
    if c.get("kv_lora_rank"):
        per_layer = int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim") or 0)
    else:
        heads = int(c.get("num_attention_heads") or 1)
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or int(c.get("hidden_size") or 0) // heads)
        per_layer = 2 * kv_heads * head_dim
    itemsize = ITEMSIZE.get(compute_dtype, 4)
    per_value = itemsize if kv_bits is None else kv_bits / 8 + 2 * itemsize / kv_group_size
    return int(full * per_layer * per_value)


def context_tokens(config: dict, given: int | None) -> int:
    """The context the KV cache is sized for: `given`, else 4096 or the model's own if shorter."""
    if given is not None:
        return given
    own = text_config(config).get("max_position_embeddings")
    return min(DEFAULT_CONTEXT, int(own)) if own else DEFAULT_CONTEXT


@dataclass(frozen=True)
class DefaultBudget:
    """The default expert-cache budget and the terms it was computed from (bytes)."""

    bytes: int
    available: int
    source: str  # where `available` comes from: MemAvailable, cgroup limit ..., vm_stat
    kv: int
    context: int
    prefill: int  # two layers of experts + the span's activations at `context` tokens
    headroom: int

    @property
    def free(self) -> int:
        """What the expert cache may use (can be below zero)."""
        return self.available - self.kv - self.prefill - self.headroom

    def describe(self) -> str:
        return (
            f"default: {format_size(self.available)} available after loading ({self.source}) - KV cache "
            f"{format_size(self.kv)} at {self.context} tokens - prefill {format_size(self.prefill)} - headroom "
            f"{format_size(self.headroom)}"
        )


def default_budget(total_expert_bytes: int, kv_bytes: int, context: int, prefill_bytes: int) -> DefaultBudget:
    """All experts if they fit in what is left, else what is left (see the module docstring)."""
    available, source = memory.available()
    headroom = max(HEADROOM_MIN, int(HEADROOM_SHARE * available))
    b = DefaultBudget(0, available, source, kv_bytes, context, prefill_bytes, headroom)
    return replace(b, bytes=min(total_expert_bytes, max(0, b.free)))
