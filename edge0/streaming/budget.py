"""The default expert-cache budget: the memory this process can still use (the one probe,
backend.memory: MemAvailable, the cgroup limit or vm_stat), measured once the resident weights are
loaded, less the KV cache at the configured context, the KV caches of other conversations kept
beside it (engine/kvpool.py), what a prefill of that context holds (two layers of experts and the
span's activations) and a headroom. See docs/architecture.md
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
POOL_CONTEXTS = 2  # the default memory for other conversations' KV caches: this many contexts' worth


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
    prompt_caches: int = 0  # the KV caches of other conversations (engine/kvpool.py)

    @property
    def free(self) -> int:
        """What the expert cache may use (can be below zero)."""
        return self.available - self.kv - self.prefill - self.headroom - self.prompt_caches

    def describe(self) -> str:
        return (
            f"default: {format_size(self.available)} available after loading ({self.source}) - KV cache "
            f"{format_size(self.kv)} at {self.context} tokens - prompt caches {format_size(self.prompt_caches)} "
            f"(--prompt-cache-memory) - prefill {format_size(self.prefill)} - headroom {format_size(self.headroom)}"
        )


def prompt_cache_memory(kv_bytes: int, given: int | None, room: int | None) -> int:
    """Memory for the KV caches of other conversations: `given`, else two contexts' KV cache, at most
    a quarter of `room` (what the expert cache would get without them; None: not bounded)."""
    if given is not None:
        return given
    auto = POOL_CONTEXTS * kv_bytes
    return auto if room is None else max(0, min(auto, room // 4))


def default_budget(
    total_expert_bytes: int, kv_bytes: int, context: int, prefill_bytes: int, prompt_caches: int | None = None
) -> DefaultBudget:
    """All experts if they fit in what is left, else what is left (see the module docstring);
    `prompt_caches` None: the default share (prompt_cache_memory)."""
    available, source = memory.available()
    headroom = max(HEADROOM_MIN, int(HEADROOM_SHARE * available))
    b = DefaultBudget(0, available, source, kv_bytes, context, prefill_bytes, headroom)
    b = replace(b, prompt_caches=prompt_cache_memory(kv_bytes, prompt_caches, max(0, b.free)))
    return replace(b, bytes=min(total_expert_bytes, max(0, b.free)))
