"""KV caches through mlx-lm's prompt-cache helpers: make, trim, measure, save and read them."""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.utils import common_prefix_len

from edge0.backend import layer_probe as lp
from edge0.backend.quantized_batch import BatchQuantizedKVCache

__all__ = [
    "Caches",
    "watch",
    "make_prompt_cache",
    "make_cache",
    "can_trim_prompt_cache",
    "trim_prompt_cache",
    "common_prefix_len",
    "save_prompt_cache",
    "cache_offset",
    "counts_tokens",
    "prompt_cache_nbytes",
    "read_prompt_cache",
    "prompt_cache_metadata",
    "prompt_cache_digest",
    "rewind_problem",
    "rewind_point",
    "rewind",
    "replays",
    "trim_to",
    "trim_floor",
    "copy_cache",
    "KVFootprint",
    "kv_footprint",
    "batch_problem",
    "merge_caches",
    "filter_cache",
    "join_rows",
    "extract_row",
    "rows_can_drop_tails",
    "drop_row_tails",
]


class Caches(list):
    """A prompt cache: one cache per layer. A list that a pipeline's rank 0 can name (`mirror`)
    and learn is dropped (a weak reference), so the other ranks keep their layers' share of it."""

    __slots__ = ("__weakref__", "mirror")


# Across ranks, rank 0 hears of every prompt cache made and every change one goes through outside a
# forward, so the other ranks make the same change to theirs (edge0/distributed/mirror.py).
_watcher = None


def watch(fn) -> None:
    """`fn(op, out, *args)` hears of each prompt-cache op below (None: nobody listens)."""
    global _watcher
    _watcher = fn


def _note(op: str, out, *args) -> None:
    if _watcher is not None:
        _watcher(op, out, *args)


def make_cache(model, kv_bits: int | None = None, group_size: int = 64) -> list:
    """The model's prompt cache; with `kv_bits`, its full-attention layers' caches quantized from
    the first token (mlx-lm's QuantizedKVCache; sliding windows, which mlx-lm cannot quantize, and
    recurrent states stay as they are)."""
    cache = make_prompt_cache(model)
    if kv_bits is not None:
        cache = [c.to_quantized(group_size=group_size, bits=kv_bits) if type(c) is KVCache else c for c in cache]
    cache = Caches(cache)
    _note("make", cache)
    return cache


def counts_tokens(cache) -> bool:
    """Whether some layer of `cache` counts the tokens it holds (not only recurrent state)."""
    return any(hasattr(leaf, "offset") for layer in cache for leaf in _leaves(layer))


def cache_offset(cache) -> int:
    """Tokens a prompt cache holds (0 for none): the first layer's that counts them (a hybrid
    family's linear-attention state does not; a CacheList's first cache does)."""
    for c in (leaf for layer in cache or () for leaf in _leaves(layer)):
        if hasattr(c, "offset"):
            return int(c.offset)
    return 0


def prompt_cache_nbytes(cache) -> int:
    """Bytes of the KV arrays a prompt cache holds (about its size on disk)."""
    return sum(v.nbytes for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array))


def read_prompt_cache(path: str):
    """(cache, metadata) from a `save_prompt_cache` file, its arrays read now, so a damaged file
    fails here and not in a later forward."""
    cache, metadata = load_prompt_cache(path, return_metadata=True)
    mx.eval([c.state for c in cache])
    cache = Caches(cache)
    _note("read", cache)
    return cache, metadata


def prompt_cache_metadata(flat: dict[str, str]) -> dict:
    """The metadata `save_prompt_cache` stored, from its file's flat header metadata (which also
    holds the cache classes and scalars)."""
    for key in flat:  # tree_unflatten makes a list as long as the largest index a key names
        if any(part.isdigit() and int(part) > 4096 for part in key.split(".")):
            raise ValueError(f"metadata key {key[:40]!r} names an index past any cache's")
    metadata = tree_unflatten(list(flat.items()))
    if not isinstance(metadata, list) or not metadata or not isinstance(metadata[0], dict):
        raise ValueError("no prompt-cache metadata")
    return metadata[0]


def prompt_cache_digest(cache) -> str:
    """A sha256 of a prompt cache's arrays (each one's dtype, shape and bytes, in order), as
    `save_prompt_cache` writes them and `read_prompt_cache` reads them back: a file's KV data is
    told from a damaged copy of it that still loads."""
    h = hashlib.sha256()
    for _, a in tree_flatten([c.state for c in cache]):
        if isinstance(a, mx.array):
            a = mx.contiguous(a)  # a cache's state is a view of its larger buffers
            mx.eval(a)
            h.update(f"{a.dtype} {a.shape};".encode())
            h.update(memoryview(a))
    return h.hexdigest()


def copy_cache(cache) -> list:
    """An independent copy of a prompt cache: MLX updates a cache's arrays in place, so a copy
    that only shared them would write into the original."""
    out = Caches(copy.deepcopy(list(cache)))
    _note("copy", out, cache)
    return out


def trim_floor(cache) -> int:
    """The fewest tokens `cache` can be cut back to: 0, or the first chunk boundary at or after the
    tokens a chunked attention cache still holds (mlx-lm's ChunkedKVCache drops the tokens before
    its last chunk's worth and cannot give them back; a token attends to its chunk's tokens before it)."""
    floors = [
        -(-c.start_position // c.chunk_size) * c.chunk_size
        for layer in cache
        for c in _leaves(layer)
        if getattr(c, "start_position", 0) and getattr(c, "chunk_size", 0)
    ]
    return max(floors, default=0)


def trim_to(cache, n: int) -> bool:
    """Make every layer hold its first `n` tokens (a prefill cancelled between layers leaves the
    first layers ahead of the others). False, and nothing changed, when a layer holding more than
    `n` cannot be trimmed (recurrent state) or no longer holds the tokens before `n` (trim_floor)."""
    leaves = [leaf for layer in cache for leaf in _leaves(layer)]  # a CacheList's caches each hold tokens
    ahead = [c for c in leaves if c.offset > n] if all(hasattr(c, "offset") for c in leaves) else None
    if ahead is None or not all(c.is_trimmable() for c in ahead) or n < trim_floor(cache):
        _note("trim", cache, n, False)
        return False
    for c in ahead:
        c.trim(c.offset - n)
    _note("trim", cache, n, True)
    return True


def rewind_problem(cache) -> str | None:
    """Why `cache` cannot be taken back to an earlier token (None if it can): every layer must
    be trimmable (attention KV) or a recurrent state that `rewind_point` copies (ArraysCache)."""
    bad = sorted({type(c).__name__ for c in cache if not c.is_trimmable() and not isinstance(c, ArraysCache)})
    return f"its {', '.join(bad)} layers cannot be rewound" if bad else None


# Cache types whose batched form is ours, not mlx-lm's (which has none for them).
_BATCHED = {QuantizedKVCache: BatchQuantizedKVCache}


def _merge(caches: list):
    """One layer's batched cache from sequences' own caches of that layer."""
    kind = type(caches[0])
    return _BATCHED.get(kind, kind).merge(caches)


def batch_problem(cache) -> str | None:
    """Why sequences with caches like `cache` cannot decode in one batch (None if they can):
    every layer's cache type needs a batched form, mlx-lm's `merge` (KV, rotating window,
    recurrent state, lists of them) or ours (the quantized KV cache of --kv-bits)."""
    bad = sorted({type(c).__name__ for c in cache if "merge" not in vars(type(c)) and type(c) not in _BATCHED})
    return f"its {', '.join(bad)} layers have no batched form in mlx-lm" if bad else None


def merge_caches(caches: list[list]) -> list:
    """One batched cache per layer from each sequence's own cache (mlx-lm left-pads the shorter
    ones; the padding is masked and each row keeps its own positions). Evaluated here, so the
    sequences' own caches can go as soon as the caller drops them."""
    merged = Caches(_merge(list(layer)) for layer in zip(*caches))
    for m, layer in zip(merged, zip(*caches)):
        _rows_delta(m, [getattr(c, "rope_delta", None) for c in layer])
    mx.eval([x for c in merged for _, x in tree_flatten(c.state) if isinstance(x, mx.array)])
    _note("merge", merged, caches)
    return merged


def _rows_delta(merged, deltas: list) -> None:
    """A batch's cache keeps its rows' rope deltas (a VL model's; edge0.backend.vision) as one array."""
    if any(d is not None for d in deltas):
        merged.rope_delta = mx.array([d or 0 for d in deltas])


def filter_cache(cache: list, rows: list[int]) -> None:
    """Keep only the batch rows `rows` of a merged cache (in place)."""
    idx = mx.array(rows)
    for c in cache:
        c.filter(idx)
        if getattr(c, "rope_delta", None) is not None:
            c.rope_delta = c.rope_delta[idx]
    _note("filter", cache, rows)


def join_rows(merged: list | None, cache: list) -> list:
    """A sequence's own `cache` joins a batch's `merged` cache as its last row (None: the first
    row of a new batch); mlx-lm pads the shorter side on the left. Evaluated, as merge_caches."""
    if merged is None:
        return merge_caches([cache])
    for m, c in zip(merged, cache):
        m.extend(_merge([c]))
        if getattr(m, "rope_delta", None) is not None:
            m.rope_delta = mx.concatenate([m.rope_delta, mx.array([c.rope_delta])])
    mx.eval([x for c in merged for _, x in tree_flatten(c.state) if isinstance(x, mx.array)])
    _note("join", merged, merged, cache)
    return merged


def extract_row(merged: list, row: int) -> list:
    """A sequence's own cache, copied out of row `row` of a batch's `merged` cache (its padding
    left out), e.g. to keep its conversation's KV for the next request."""
    out = Caches(_extract(c, row) for c in merged)
    for o, m in zip(out, merged):
        if getattr(m, "rope_delta", None) is not None:
            o.rope_delta = int(m.rope_delta[row].item())
    mx.eval([x for c in out for _, x in tree_flatten(c.state) if isinstance(x, mx.array)])
    _note("extract", out, merged, row)
    return out


def _extract(cache, row: int):
    """One row of a layer's batched cache; a recurrent state never fed (a pipeline's rank 0 keeps
    one for each linear-attention layer another rank runs) stays empty (mlx-lm's extract fails)."""
    if isinstance(cache, ArraysCache) and all(c is None for c in cache.cache):
        return ArraysCache(len(cache.cache))
    return cache.extract(row)


def rows_can_drop_tails(cache) -> bool:
    """Whether a batch of sequences with caches like `cache` can drop each row's last tokens on its
    own (a batched verify's rejected drafts): every layer batches as a plain or quantized KV cache."""
    return all(type(c) in (KVCache, QuantizedKVCache) for c in cache)


def drop_row_tails(merged: list, drops: list[int]) -> None:
    """Row i of a batch's `merged` cache drops its last `drops[i]` tokens: they are rolled to the
    front of the row and become left padding (mlx-lm's right padding, finalized), each row's
    positions going on from its kept tokens."""
    _note("drop_tails", merged, drops)
    if not any(drops):
        return
    for c in merged:
        c.prepare(right_padding=drops)
        c.finalize()


def replays(cache) -> bool:
    """Whether a verify's rewind of a cache like `cache` (a pipeline rank's share) may have to go
    back to before the forward and feed the kept tokens again rather than cut: some layer cannot
    be cut back (recurrent state), or will not once its sliding window is full."""
    leaves = [leaf for layer in cache for leaf in _leaves(layer)]
    return not can_trim_prompt_cache(cache) or any(isinstance(c, RotatingKVCache) for c in leaves)


def rewind_point(cache, replay: bool = False):
    """What `rewind` needs to take `cache` back to now: None when every layer is trimmable (and
    not `replay`), else per layer what cutting back cannot restore: a recurrent layer's states
    (ArraysCache replaces its entries, so a copy of the list keeps them), and a sliding window
    past its size, whose next multi-token update drops its oldest keys (mlx-lm's RotatingKVCache
    concatenates new arrays then, so its current ones stay as they are). `replay`: a point even
    so, so that a rewind goes back to before the forward and the kept tokens are fed again (a
    pipeline's rank 0 whose own layers all trim, when another rank's cannot)."""
    if can_trim_prompt_cache(cache) and not replay:
        point = None
    else:
        point = [_layer_point(c) for c in cache]
    _note("point", cache, point is not None)
    return point


def _layer_point(c):
    if isinstance(c, ArraysCache):
        return ("states", list(c.cache))
    if isinstance(c, RotatingKVCache) and not c.is_trimmable():
        return ("window", c.keys, c.values, c.offset, c._idx)
    return None


def rewind(cache, drop: int, fed: int, point) -> bool:
    """Drop the last `drop` of the `fed` tokens the last forward added. Without a `point`, every
    layer is trimmed. With one (recurrent layers, full sliding windows), every layer goes back to
    before the forward (trimmed by `fed`, states and windows put back), and the caller feeds the
    kept tokens again. Returns
    whether it did (a replay is due)."""
    _note("rewind", cache, drop, fed, point is not None)
    if point is None:
        trim_prompt_cache(cache, drop)
        return False
    for c, saved in zip(cache, point):
        if saved is None:
            c.trim(fed)
        elif saved[0] == "states":
            c.cache = list(saved[1])
        else:  # a full sliding window: as it was before the forward
            c.keys, c.values, c.offset, c._idx = saved[1:]
    return True


@dataclass(frozen=True)
class KVFootprint:
    """What a model's prompt cache holds as it grows: per cache, the bytes one token adds and the
    tokens it keeps at most (a sliding window; None: all), and the bytes of fixed states
    (linear-attention and SSM layers)."""

    per_token: tuple[int, ...]
    caps: tuple[int | None, ...]
    fixed: int
    quantizable: tuple[bool, ...] = ()  # per cache: --kv-bits would quantize it

    def with_bits(self, bits: int, group_size: int = 64, itemsize: int = 4) -> "KVFootprint":
        """The footprint with --kv-bits: `bits` per value and a scale and a bias per group (in the
        compute dtype, `itemsize` bytes) for the caches that quantize."""
        scale = (bits / 8 + 2 * itemsize / group_size) / itemsize
        per_token = tuple(int(p * scale) if q else p for p, q in zip(self.per_token, self.quantizable))
        return KVFootprint(per_token, self.caps, self.fixed, self.quantizable)

    def bytes_at(self, tokens: int) -> int:
        """Bytes the cache holds after `tokens` tokens."""
        held = (p * (tokens if c is None else min(tokens, c)) for p, c in zip(self.per_token, self.caps))
        return self.fixed + sum(held)

    def longest(self, room: int, most: int) -> int:
        """The most tokens (up to `most`) whose cache fits in `room` bytes."""
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.bytes_at(mid) <= room else (lo, mid - 1)
        return lo


def _held(cache) -> int:
    return sum(a.nbytes for _, a in tree_flatten(cache.state) if isinstance(a, mx.array))


def _leaves(cache) -> list:
    """A cache and the caches it nests (a CacheList's)."""
    inner = getattr(cache, "caches", None)
    return [leaf for c in inner for leaf in _leaves(c)] if isinstance(inner, (list, tuple)) else [cache]


def _per_slot(cache) -> int | None:
    """Bytes one cached token takes in a KV-style cache, from its own key and value arrays (quantized
    ones included); None for a cache that keeps no keys (a recurrent state)."""
    keys = getattr(cache, "keys", None)
    if keys is None:
        return None
    arrays = [a for _, a in tree_flatten([keys, getattr(cache, "values", None)]) if isinstance(a, mx.array)]
    return sum(a.nbytes for a in arrays) // arrays[0].shape[-2]


def _cap(cache) -> int | None:
    """The most tokens a cache keeps: a sliding window's size (mlx-lm's rotating cache, DeepSeek-V4.1's
    layer window), or a chunked cache's chunk plus the step it allocates ahead; None: every token."""
    window = getattr(cache, "max_size", None) or getattr(cache, "window_size", None)
    if window:
        return int(window)
    chunk = getattr(cache, "chunk_size", None)
    return int(chunk) + int(getattr(cache, "step", 0)) if chunk else None


def kv_footprint(model, kv_bits: int | None = None, group_size: int = 64, dtype: str = "float32") -> KVFootprint:
    """The footprint of the cache `make_cache` gives this model, measured on its own caches after two
    tokens and then two more, fed lazily with the MoE blocks stubbed (nothing is evaluated, so a
    model built from a config alone costs no memory). A KV-style cache's token bytes come from its
    key and value arrays, any other cache's from how much it grew (the rest being fixed state),
    capped by its window (`_cap`). Latent attention, shared KV and recurrent states come out as the
    family's own code lays them out; DeepSeek-V4.1's compressed groups (one row per `ratio`
    tokens) are not seen in four tokens and are not counted."""
    cache = make_cache(model, kv_bits, group_size)
    held = []
    for _ in range(2):
        lp.forward_without_experts(model, [1, 2], cache)
        held.append([_held(c) for c in cache for c in _leaves(c)])
    per_token, caps, fixed = [], [], 0
    leaves = [leaf for c in cache for leaf in _leaves(c)]
    for c, two, four in zip(leaves, *held):
        slot = _per_slot(c)
        per_token.append((four - two) // 2 if slot is None else slot)
        fixed += two - 2 * per_token[-1] if slot is None else 0
        caps.append(_cap(c))
    return KVFootprint(tuple(per_token), tuple(caps), fixed, tuple(type(c) is KVCache for c in leaves))
