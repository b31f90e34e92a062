"""Streaming safetensors writer.

The safetensors library writes a whole dict at once; the converter must write tensor by tensor
so memory does not grow with model size. The header only needs names, dtypes and shapes, which
are known before any data is computed. Files written here are read back by `safetensors`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "U8": 1, "I32": 4, "I64": 8}


class SafetensorsWriter:
    """Write tensors in the declared order; `offsets[name]` is each tensor's absolute byte offset."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple]], metadata: dict | None = None):
        self.path = Path(path)
        header, pos = {}, 0
        self.sizes = {}
        for name, st_dtype, shape in entries:
            n = _ITEMSIZE[st_dtype]
            for d in shape:
                n *= d
            header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
            self.sizes[name] = n
            pos += n
        if metadata:
            header["__metadata__"] = metadata
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        self.data_start = 8 + len(blob)
        self.offsets = {k: self.data_start + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
        self._order = [e[0] for e in entries]
        self._sha = hashlib.sha256()
        self._fh = open(self.path, "wb")
        self._put(struct.pack("<Q", len(blob)) + blob)

    def _put(self, b) -> None:
        self._fh.write(b)
        self._sha.update(b)

    def write(self, name: str, data: memoryview | bytes) -> None:
        """Append the raw bytes of the next tensor."""
        expected = self._order[0] if self._order else None
        if name != expected:
            raise ValueError(f"tensor {name!r} written out of order (expected {expected!r})")
        n = len(memoryview(data).cast("B"))
        if n != self.sizes[name]:
            raise ValueError(f"tensor {name!r}: {n} bytes, header says {self.sizes[name]}")
        self._order.pop(0)
        self._put(data)

    def close(self) -> dict:
        """Finish the file; returns {"size", "sha256"} for the manifest."""
        if self._order:
            raise ValueError(f"{self.path}: tensors never written: {self._order[:3]}")
        self._fh.close()
        return {"size": self.path.stat().st_size, "sha256": self._sha.hexdigest()}
