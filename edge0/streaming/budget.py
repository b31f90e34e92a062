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
