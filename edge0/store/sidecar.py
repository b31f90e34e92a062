"""Sidecar files next to a store (pre-router heads, LoRA adapters): float32 safetensors whose
metadata carries a magic format name and a version, written atomically."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from edge0.errors import Edge0Error


def write_sidecar(path, tensors: dict, header: dict[str, str]) -> Path:
    """Write `tensors` as float32 with string metadata `header`: a temp file, then a rename."""
    from safetensors.numpy import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, str(tmp), metadata=header)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_sidecar(path, fmt: str, version: int, what: str, hint: str) -> tuple[dict, dict]:
    """(tensors, metadata strings) of a sidecar; an Edge0Error naming the file and `hint` unless it
    is readable and its format is `fmt` at `version`. `what` names the kind ("LoRA adapter")."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise Edge0Error(f"{path}: not a readable {what} ({e}); {hint}") from None
    if meta.get("format") != fmt:
        raise Edge0Error(f"{path}: not an edge0 {what} (format {meta.get('format')!r}); {hint}")
    if meta.get("version") != str(version):
        raise Edge0Error(f"{path}: {what} format version {meta.get('version')}, this edge0 reads {version}; {hint}")
    return tensors, meta
