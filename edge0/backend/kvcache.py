"""KV caches through mlx-lm's prompt-cache helpers: make, trim, measure, save and read them."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import (
    ArraysCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.utils import common_prefix_len

__all__ = [
    "make_prompt_cache",
    "make_cache",
    "can_trim_prompt_cache",
    "trim_prompt_cache",
    "common_prefix_len",
    "save_prompt_cache",
    "cache_offset",
    "prompt_cache_nbytes",
    "read_prompt_cache",
    "prompt_cache_metadata",
    "rewind_problem",
    "rewind_point",
    "rewind",
    "trim_to",
]


def make_cache(model, kv_bits: int | None = None, group_size: int = 64) -> list:
    """The model's prompt cache; with `kv_bits`, its attention layers' caches quantized from the
    first token (mlx-lm's QuantizedKVCache; recurrent layers' state stays as it is)."""
    cache = make_prompt_cache(model)
    if kv_bits is not None:
        cache = [
            c.to_quantized(group_size=group_size, bits=kv_bits) if hasattr(c, "to_quantized") else c for c in cache
        ]
    return cache


def cache_offset(cache) -> int:
    """Tokens a prompt cache holds (0 for none)."""
    return int(cache[0].offset) if cache else 0


def prompt_cache_nbytes(cache) -> int:
    """Bytes of the KV arrays a prompt cache holds (about its size on disk)."""
    return sum(v.nbytes for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array))


def read_prompt_cache(path: str):
    """(cache, metadata) from a `save_prompt_cache` file, its arrays read now, so a damaged file
    fails here and not in a later forward."""
    cache, metadata = load_prompt_cache(path, return_metadata=True)
    mx.eval([c.state for c in cache])
    return cache, metadata


def prompt_cache_metadata(flat: dict[str, str]) -> dict:
    """The metadata `save_prompt_cache` stored, from its file's flat header metadata (which also
    holds the cache classes and scalars)."""
    metadata = tree_unflatten(list(flat.items()))
    if not isinstance(metadata, list) or not metadata or not isinstance(metadata[0], dict):
        raise ValueError("no prompt-cache metadata")
    return metadata[0]


def trim_to(cache, n: int) -> bool:
    """Make every layer hold its first `n` tokens (a prefill cancelled between layers leaves the
    first layers ahead of the others). False, and nothing changed, when a layer holding more than
    `n` cannot be trimmed (recurrent state)."""
    ahead = [c for c in cache if c.offset > n] if all(hasattr(c, "offset") for c in cache) else None
    if ahead is None or not all(c.is_trimmable() for c in ahead):
        return False
    for c in ahead:
        c.trim(c.offset - n)
    return True


def rewind_problem(cache) -> str | None:
    """Why `cache` cannot be taken back to an earlier token (None if it can): every layer must
    be trimmable (attention KV) or a recurrent state that `rewind_point` copies (ArraysCache)."""
    bad = sorted({type(c).__name__ for c in cache if not c.is_trimmable() and not isinstance(c, ArraysCache)})
    return f"its {', '.join(bad)} layers cannot be rewound" if bad else None


def rewind_point(cache):
    """What `rewind` needs to take `cache` back to now: None when every layer is trimmable, else
    the recurrent layers' states (ArraysCache replaces its entries, so a copy of the list keeps them)."""
    if can_trim_prompt_cache(cache):
        return None
    return [list(c.cache) if isinstance(c, ArraysCache) else None for c in cache]


def rewind(cache, drop: int, fed: int, point) -> bool:
    """Drop the last `drop` of the `fed` tokens the last forward added. Without a `point`, every
    layer is trimmed. With one (recurrent layers), every layer goes back to before the forward
    (trimmed by `fed`, states put back), and the caller feeds the kept tokens again. Returns
    whether it did (a replay is due)."""
    if point is None:
        trim_prompt_cache(cache, drop)
        return False
    for c, saved in zip(cache, point):
        if saved is not None:
            c.cache = list(saved)
        else:
            c.trim(fed)
    return True
