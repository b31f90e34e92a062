"""Logging and atomic file writes shared by the demo-model training stages."""

from __future__ import annotations

import json
import os
import time

import mlx.core as mx


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def atomic_write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def atomic_save_safetensors(path: str, arrays: dict, metadata: dict | None = None) -> None:
    tmp = path[: -len(".safetensors")] + ".tmp.safetensors"
    mx.save_safetensors(tmp, arrays, metadata=metadata or {})
    os.replace(tmp, path)
