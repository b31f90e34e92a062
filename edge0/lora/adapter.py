"""The adapter file: safetensors with a magic format name, a version, the identity of what it was
trained for (base store, serving K, pre-router heads), a checksum of its tensors, and provenance."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from edge0.errors import Edge0Error
from edge0.store.format import LORA_FILE
from edge0.store.sidecar import read_sidecar, write_sidecar

FORMAT = "edge0-lora"
VERSION = 1
DEFAULT_NAME = LORA_FILE
# Plain-string metadata fields; every other field is JSON.
_STRINGS = ("format", "version", "manifest_sha256", "prerouter_sha256", "tensors_sha256")


def retrain_hint(store, k=None, heads=None) -> str:
    flags = (f" --top-k {k}" if k else "") + (f" --prerouter {heads}" if heads else " --no-prerouter")
    return (
        f"retrain it with: edge0 train-lora --model {store} --teacher <full-precision checkpoint> --data <text>{flags} "
        f"--out <file> (or serve without it: --no-lora)"
    )


def tensors_digest(tensors: dict[str, np.ndarray]) -> str:
    """sha256 over names, shapes and float32 bytes in name order: detects any damaged byte."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        v = np.ascontiguousarray(tensors[k], dtype=np.float32)
        h.update(f"{k}:{v.shape}".encode())
        h.update(v.tobytes())
    return h.hexdigest()


def save_adapter(path, tensors: dict[str, np.ndarray], meta: dict) -> Path:
    """Write atomically (temp file, then rename). `meta` needs manifest_sha256, prerouter_sha256
    (None without heads), top_k, r, alpha, targets; anything else (provenance) is kept as JSON."""
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    header = {
        "format": FORMAT,
        "version": str(VERSION),
        "tensors_sha256": tensors_digest(tensors),
        "prerouter_sha256": meta.get("prerouter_sha256") or "none",
    }
    header.update({k: v if k in _STRINGS else json.dumps(v) for k, v in meta.items() if k not in header})
    return write_sidecar(path, tensors, header)


def read_adapter(path, store=None) -> tuple[dict, dict]:
    """Read an adapter file and check its own integrity (format, version, metadata, tensor
    checksum, finite values). Returns (tensors, metadata with JSON fields decoded;
    prerouter_sha256 is None for an adapter trained without heads)."""
    path = Path(path)
    hint = retrain_hint(store or "<store>")
    if not path.is_file():
        raise Edge0Error(f"--lora {path}: no such file; {hint}")
    tensors, meta = read_sidecar(path, FORMAT, VERSION, "LoRA adapter", hint)
    try:
        decoded = {k: v if k in _STRINGS else json.loads(v) for k, v in meta.items()}
        targets, r, alpha = list(decoded["targets"]), int(decoded["r"]), float(decoded["alpha"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise Edge0Error(f"{path}: damaged adapter metadata; {hint}") from None
    if decoded.get("tensors_sha256") != tensors_digest(tensors):
        raise Edge0Error(f"{path}: damaged adapter (tensor checksum differs from the one written at training); {hint}")
    expected = {f"{t}.{n}" for t in targets for n in ("lora_a", "lora_b")}
    if set(tensors) != expected:
        raise Edge0Error(f"{path}: tensors do not match the adapter's target list; {hint}")
    if not all(np.isfinite(v).all() for v in tensors.values()):
        raise Edge0Error(f"{path}: adapter holds non-finite values; {hint}")
    if decoded["prerouter_sha256"] == "none":
        decoded["prerouter_sha256"] = None
    decoded.update(targets=targets, r=r, alpha=alpha)
    return tensors, decoded
