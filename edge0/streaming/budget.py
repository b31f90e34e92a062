"""The default expert-cache budget: the memory this process can still use (the one probe,
backend.memory: MemAvailable, the cgroup limit or vm_stat), measured once the resident weights are
loaded, less the KV cache at the configured context, the KV caches of other conversations kept
beside it (engine/kvpool.py: by default two at the context served, at most a quarter of what is
left), what a prefill of the configured context holds (two layers of experts and the span's
activations) and a headroom. See docs/architecture.md ("Expert pool")."""

from __future__ import annotations

from dataclasses import dataclass, replace

from edge0.backend import memory
from edge0.spec import text_config
from edge0.units import format_size

DEFAULT_CONTEXT = 4096  # tokens of KV cache the default budget leaves room for
# the context served for a model whose config.json declares none (server/config.py DEFAULT_MAX_PROMPT_TOKENS)
UNDECLARED_CONTEXT = 32768
HEADROOM_MIN = 64 << 20  # MLX temporaries, Python objects, read buffers
HEADROOM_SHARE = 0.10  # of the available memory, when that is more: other processes come and go
PREFILL_LAYERS = 2  # whole-layer prefill holds the layer computing and the next one read ahead
POOL_CONTEXTS = 2  # the default memory for other conversations' KV caches: this many served contexts' worth


def context_tokens(config: dict, given: int | None) -> int:
    """The context the KV cache is sized for: `given`, else 4096 or the model's own if shorter."""
    if given is not None:
        return given
    own = text_config(config).get("max_position_embeddings")
    return min(DEFAULT_CONTEXT, int(own)) if own else DEFAULT_CONTEXT


def served_context(config: dict, given: int | None) -> int:
    """The longest context served, the one a conversation can grow to: the model's own
    (max_position_embeddings, the server's context length; 32768 when it declares none, as the
    server takes), or `given` (--context-tokens) when longer."""
    own = text_config(config).get("max_position_embeddings")
    own = own if isinstance(own, int) and own > 0 else UNDECLARED_CONTEXT
    return max(own, given or 0)


@dataclass(frozen=True)
class Reserve:
    """What the default expert-cache budget leaves memory for, besides two layers of experts and
    the headroom (bytes)."""

    kv: int = 0  # the KV cache of the request in flight at `context` tokens
    context: int = 0
    prefill: int = 0  # a prefill span's activations at `context` tokens
    prompt_caches: int | None = None  # --prompt-cache-memory; None: the default (prompt_cache_memory)
    served_kv: int = 0  # one KV cache at the `served` context (served_context)
    served: int = 0


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
    prompt_caches_for: str = ""  # what the default was sized for ("": --prompt-cache-memory given)

    @property
    def free(self) -> int:
        """What the expert cache may use (can be below zero)."""
        return self.available - self.kv - self.prefill - self.headroom - self.prompt_caches

    def describe(self) -> str:
        return (
            f"default: {format_size(self.available)} available after loading ({self.source}) - KV cache "
            f"{format_size(self.kv)} at {self.context} tokens - prompt caches {format_size(self.prompt_caches)} "
            f"({pool_reason(self.prompt_caches_for)}) - prefill {format_size(self.prefill)} - headroom "
            f"{format_size(self.headroom)}"
        )


def pool_reason(sized_for: str) -> str:
    """How the describe lines name the prompt caches' memory: what it was sized for, and its option."""
    return f"{sized_for}; --prompt-cache-memory" if sized_for else "--prompt-cache-memory"


def prompt_cache_memory(reserve: Reserve, room: int) -> tuple[int, str]:
    """(bytes, what they were sized for) for the KV caches of other conversations: the given
    --prompt-cache-memory (""), else POOL_CONTEXTS KV caches at the served context (a conversation
    grows to it), at most a quarter of `room` (what the expert cache would get without them)."""
    if reserve.prompt_caches is not None:
        return reserve.prompt_caches, ""
    auto = POOL_CONTEXTS * reserve.served_kv
    contexts = f"{('one', 'two', 'three', 'four')[POOL_CONTEXTS - 1]} {reserve.served:,}-token contexts"
    if auto <= room // 4:
        return auto, contexts
    return max(0, room // 4), f"a quarter of the memory left for experts; {contexts} would take {format_size(auto)}"


def default_budget(total_expert_bytes: int, reserve: Reserve, prefill_bytes: int) -> DefaultBudget:
    """All experts if they fit in what is left, else what is left (see the module docstring), with
    the prompt caches' share (prompt_cache_memory); `prefill_bytes`: two layers of experts and the
    span's activations."""
    available, source = memory.available()
    headroom = max(HEADROOM_MIN, int(HEADROOM_SHARE * available))
    b = DefaultBudget(0, available, source, reserve.kv, reserve.context, prefill_bytes, headroom)
    size, sized_for = prompt_cache_memory(reserve, max(0, b.free))
    b = replace(b, prompt_caches=size, prompt_caches_for=sized_for)
    return replace(b, bytes=min(total_expert_bytes, max(0, b.free)))
