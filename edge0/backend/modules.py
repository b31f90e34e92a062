"""Module surgery on an mlx-lm model: find and replace modules by dotted path, count resident bytes."""

from __future__ import annotations

import mlx.nn as nn
from mlx.utils import tree_flatten


def get_module(root, path: str):
    """The module (or array) at a dotted path, e.g. "model.layers.3.mlp.gate"."""
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def set_module(root, path: str, value) -> None:
    """Replace the module at a dotted path (a top-level name included)."""
    parent, _, name = path.rpartition(".")
    (get_module(root, parent) if parent else root)[name] = value


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter the model holds (streamed experts are not parameters)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
