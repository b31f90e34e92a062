"""KV caches through mlx-lm's prompt-cache helpers: make, trim, measure, save and read them."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import (
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
