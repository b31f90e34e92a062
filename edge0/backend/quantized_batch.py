"""A batched form of mlx-lm's QuantizedKVCache (--kv-bits), which mlx-lm does not have.

mlx-lm's BatchKVCache keeps B rows left-padded to one length, each row at its own positions, and
masks the padding. This is the same layout with keys and values stored as QuantizedKVCache stores
them: (packed, scales, biases), quantized per token over groups of the head dimension. A token's
quantized values do not depend on its row or its padding, so each row holds exactly what its own
QuantizedKVCache would, and attention goes through mlx-lm's quantized path (it dispatches on
`bits`) with the batch mask.

    # B rows, H kv heads, S slots (padding + tokens), D head dim, P = D * bits / 32 packed words
    keys, values: (packed [B, H, S, P] uint32, scales [B, H, S, D / group], biases [B, H, S, D / group])
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache, dynamic_roll


def _empty(shape: tuple, dim: int, dtype, group_size: int, bits: int) -> tuple:
    """Quantized zeros (packed 0, scale 0, bias 0: they dequantize to 0) for `shape` + (dim,)."""
    return (
        mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
    )


def _dims(q: tuple, bits: int) -> tuple[int, object]:
    """The head dimension and compute dtype of quantized arrays `q`."""
    return q[0].shape[-1] * 32 // bits, q[1].dtype


class BatchQuantizedKVCache(BatchKVCache):
    """B sequences' quantized KV caches as one left-padded batch (see the module docstring)."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys, values):
        B, H, n, dk = keys.shape
        dv = values.shape[-1]
        prev = self._idx
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            grow = (self.step + n - 1) // self.step * self.step
            new_k = _empty((B, H, grow), dk, keys.dtype, self.group_size, self.bits)
            new_v = _empty((B, H, grow), dv, values.dtype, self.group_size, self.bits)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                old = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                self.keys, self.values = tree_map(lambda a, b: mx.concatenate([a, b], axis=2), old, (new_k, new_v))
        self.offset = self.offset + n
        self._idx += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = qk[i]
            self.values[i][..., prev : self._idx, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self):
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits = v

    def finalize(self):
        """Rows given right padding (`prepare(right_padding=...)`: a verify's rejected drafts) roll
        it to the front, where it is left padding (masked), as BatchKVCache.finalize does."""
        if self._right_padding is not None:
            pad = self._right_padding
            self.keys, self.values = tree_map(lambda x: dynamic_roll(x, pad[:, None], axis=2), (self.keys, self.values))
            self.offset = self.offset - pad
            self.left_padding += pad
            self._right_padding = None

    def filter(self, batch_indices):
        """Keep only rows `batch_indices` (in place), dropping the padding every kept row has."""
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda x: x[..., shift:, :], (self.keys, self.values))
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: "BatchQuantizedKVCache"):
        """Append `other`'s rows (in place); the side that holds fewer tokens is padded on the left."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        ref = self if self.keys is not None else other
        H = ref.keys[0].shape[1]
        dk, dtype = _dims(ref.keys, self.bits)
        dv, _ = _dims(ref.values, self.bits)
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c):
            k, v = c.keys, c.values
            if k is None:
                rows = c.offset.shape[0]
                k = _empty((rows, H, 0), dk, dtype, self.group_size, self.bits)
                v = _empty((rows, H, 0), dv, dtype, self.group_size, self.bits)
            left = idx - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:
                k, v = tree_map(lambda x: x[..., :right, :], (k, v))
                right = 0
            if left or right:
                k, v = tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), (k, v))
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        cat = lambda a, b: mx.concatenate([a, b])  # noqa: E731
        self.keys, self.values = tree_map(cat, k1, k2), tree_map(cat, v1, v2)
        self.offset, self.left_padding = cat(o1, o2), cat(p1, p2)
        self._idx = idx

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` as its own QuantizedKVCache (its padding left out)."""
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        padding = self.left_padding.tolist()[idx]
        cache.keys, cache.values = tree_map(
            lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]), (self.keys, self.values)
        )
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: list[QuantizedKVCache]) -> "BatchQuantizedKVCache":
        """One batch from sequences' own QuantizedKVCaches (the shorter ones padded on the left)."""
        group_size, bits = caches[0].group_size, caches[0].bits
        if any((c.group_size, c.bits) != (group_size, bits) for c in caches):
            raise ValueError("caches quantized with different group sizes or bits cannot share a batch")
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(padding, group_size, bits)
        if longest == 0:
            return batch
        ref = next(c for c in caches if c.keys is not None)
        H = ref.keys[0].shape[1]
        dk, dtype = _dims(ref.keys, bits)
        dv, _ = _dims(ref.values, bits)
        keys = _empty((len(caches), H, longest), dk, dtype, group_size, bits)
        values = _empty((len(caches), H, longest), dv, dtype, group_size, bits)
        for i, (p, c) in enumerate(zip(padding, caches)):
            for j in range(3):
                if c.offset:
                    keys[j][i : i + 1, :, p:] = c.keys[j][..., : c.offset, :]
                    values[j][i : i + 1, :, p:] = c.values[j][..., : c.offset, :]
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0)
