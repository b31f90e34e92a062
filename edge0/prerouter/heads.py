"""The heads file: safetensors with a magic format name, a version, and provenance metadata,
tied to one store by its manifest hash."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edge0.errors import Edge0Error
from edge0.store.format import HEADS_FILE
from edge0.store.sidecar import read_sidecar, write_sidecar

FORMAT = "edge0-prerouter"
VERSION = 1
DEFAULT_NAME = HEADS_FILE


def _retrain(store) -> str:
    return f"train heads for it with: edge0 train-prerouter --model {store} --data <text> --out <file>"


def save_heads(path, tensors: dict[str, np.ndarray], meta: dict) -> Path:
    """Write atomically (temp file, then rename)."""
    header = {"format": FORMAT, "version": str(VERSION)}
    header.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()})
    return write_sidecar(path, tensors, header)


def load_heads(path, manifest_sha256: str, spec_dict: dict, store) -> tuple[dict, dict]:
    """Read and check a heads file for the store whose manifest hash is `manifest_sha256`.
    Returns (tensors, metadata with JSON fields decoded)."""
    path = Path(path)
    if not path.is_file():
        raise Edge0Error(f"--prerouter {path}: no such file; {_retrain(store)}")
    tensors, meta = read_sidecar(path, FORMAT, VERSION, "pre-router heads file", _retrain(store))
    try:
        decoded = {
            k: json.loads(v) if k not in ("format", "version", "manifest_sha256") else v for k, v in meta.items()
        }
    except json.JSONDecodeError:
        raise Edge0Error(f"{path}: damaged metadata; {_retrain(store)}") from None
    if meta.get("manifest_sha256") != manifest_sha256:
        raise Edge0Error(
            f"{path}: heads were trained for another model (store manifest {str(meta.get('manifest_sha256'))[:12]}, "
            f"this store {manifest_sha256[:12]}); {_retrain(store)}"
        )
    if decoded.get("spec", {}).get("num_experts") != spec_dict["num_experts"]:
        raise Edge0Error(
            f"{path}: heads predict {decoded.get('spec', {}).get('num_experts')} experts, the model has "
            f"{spec_dict['num_experts']}; {_retrain(store)}"
        )
    for k, v in tensors.items():
        if not np.isfinite(v).all():
            raise Edge0Error(f"{path}: tensor {k} holds non-finite values (damaged file); {_retrain(store)}")
    return tensors, decoded
