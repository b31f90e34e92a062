"""mmap reader for layer-stacked expert tensors: expert e of a tensor is the byte range
[offset + e * expert_nbytes, offset + (e + 1) * expert_nbytes) of its layer file."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np


_PAGE = mmap.PAGESIZE


def _release(mm: mmap.mmap, start: int, n: int) -> None:
    """Unmap pages we copied from, so touched file pages do not pile up in this process's RSS
    (they stay in the OS page cache, where the kernel can reclaim them)."""
    lo = start - start % _PAGE
    mm.madvise(mmap.MADV_DONTNEED, lo, start + n - lo)


class ExpertStore:
    """Byte-range access to every MoE layer's experts. Thread-safe; counts bytes read.

    `cold_reads` drops every range it reads from the OS page cache too, so each read comes from
    storage: a benchmark knob that simulates a model much larger than RAM on a machine where it
    would otherwise stay cached."""

    def __init__(self, root, manifest: dict, cold_reads: bool = False):
        self.root = Path(root)
        self.layers = {int(l["layer"]): l for l in manifest["expert_layers"]}
        self._maps: dict[str, mmap.mmap] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.cold_reads = cold_reads

    def _map(self, rel: str) -> mmap.mmap:
        with self._lock:
            if rel not in self._maps:
                fd = os.open(self.root / rel, os.O_RDONLY)
                self._fds[rel] = fd
                self._maps[rel] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            return self._maps[rel]

    def _done(self, rel: str, mm: mmap.mmap, start: int, n: int) -> None:
        _release(mm, start, n)
        if self.cold_reads:
            os.posix_fadvise(self._fds[rel], start, n, os.POSIX_FADV_DONTNEED)

    def expert_nbytes(self, layer: int) -> int:
        """Bytes of one expert of `layer` (all its tensors)."""
        return sum(t["expert_nbytes"] for t in self.layers[layer]["tensors"].values())

    def read(self, layer: int, ids) -> dict[str, tuple[np.ndarray, str, tuple]]:
        """Copy experts `ids` of `layer` out of the file.

        Returns {tensor name: (uint8 bytes [len(ids), expert_nbytes], safetensors dtype,
        per-expert shape)}; tensor names are relative to the layer's expert module
        (e.g. "gate_proj.scales").
        """
        info = self.layers[layer]
        mm = self._map(info["file"])
        out, total = {}, 0
        for name, t in info["tensors"].items():
            n = t["expert_nbytes"]
            buf = np.empty((len(ids), n), dtype=np.uint8)
            for i, e in enumerate(ids):
                start = t["offset"] + int(e) * n
                buf[i] = np.frombuffer(mm, dtype=np.uint8, count=n, offset=start)
                self._done(info["file"], mm, start, n)
            out[name] = (buf, t["dtype"], tuple(t["shape"][1:]))
            total += buf.nbytes
        with self._lock:
            self.bytes_read += total
        return out

    def read_layer(self, layer: int) -> dict[str, tuple[np.ndarray, str, tuple]]:
        """All experts of `layer`: one large read per stacked tensor (same layout as `read`)."""
        info = self.layers[layer]
        mm = self._map(info["file"])
        num = int(info["num_experts"])
        out, total = {}, 0
        for name, t in info["tensors"].items():
            n = t["expert_nbytes"] * num
            buf = np.frombuffer(mm, dtype=np.uint8, count=n, offset=t["offset"]).copy()
            self._done(info["file"], mm, t["offset"], n)
            out[name] = (buf.reshape(num, -1), t["dtype"], tuple(t["shape"][1:]))
            total += n
        with self._lock:
            self.bytes_read += total
        return out

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                m.close()
            for fd in self._fds.values():
                os.close(fd)
            self._maps.clear()
            self._fds.clear()
