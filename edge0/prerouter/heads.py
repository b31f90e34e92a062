"""The heads file: safetensors with a magic format name, a version, and provenance metadata,
tied to one store by its manifest hash."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from edge0.errors import Edge0Error

FORMAT = "edge0-prerouter"
VERSION = 1
DEFAULT_NAME = "prerouter.safetensors"


def _retrain(store) -> str:
    return f"train heads for it with: edge0 train-prerouter --model {store} --data <text> --out <file>"


def save_heads(path, tensors: dict[str, np.ndarray], meta: dict) -> Path:
    """Write atomically (temp file, then rename)."""
    from safetensors.numpy import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    header = {"format": FORMAT, "version": str(VERSION)}
    header.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()})
    try:
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, str(tmp), metadata=header)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_heads(path, manifest_sha256: str, spec_dict: dict, store) -> tuple[dict, dict]:
    """Read and check a heads file for the store whose manifest hash is `manifest_sha256`.
    Returns (tensors, metadata with JSON fields decoded)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise Edge0Error(f"--prerouter {path}: no such file; {_retrain(store)}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise Edge0Error(f"{path}: not a readable pre-router heads file ({e}); {_retrain(store)}") from None
    if meta.get("format") != FORMAT:
        raise Edge0Error(f"{path}: not a pre-router heads file (format {meta.get('format')!r}); {_retrain(store)}")
    if meta.get("version") != str(VERSION):
        raise Edge0Error(f"{path}: heads format version {meta.get('version')}, this edge0 reads {VERSION}; {_retrain(store)}")
    try:
        decoded = {k: json.loads(v) if k not in ("format", "version", "manifest_sha256") else v for k, v in meta.items()}
    except json.JSONDecodeError:
        raise Edge0Error(f"{path}: damaged metadata; {_retrain(store)}") from None
    if meta.get("manifest_sha256") != manifest_sha256:
        raise Edge0Error(f"{path}: heads were trained for another model (store manifest {str(meta.get('manifest_sha256'))[:12]}, "
                         f"this store {manifest_sha256[:12]}); {_retrain(store)}")
    if decoded.get("spec", {}).get("num_experts") != spec_dict["num_experts"]:
        raise Edge0Error(f"{path}: heads predict {decoded.get('spec', {}).get('num_experts')} experts, the model has {spec_dict['num_experts']}; {_retrain(store)}")
    for k, v in tensors.items():
        if not np.isfinite(v).all():
            raise Edge0Error(f"{path}: tensor {k} holds non-finite values (damaged file); {_retrain(store)}")
    return tensors, decoded
