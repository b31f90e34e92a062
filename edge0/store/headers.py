"""Safetensors headers without the data: tensor names, dtypes, shapes and the string metadata, through
the `safetensors` package (the one header reader of the project)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from edge0.units import tensor_nbytes


@dataclass(frozen=True)
class Header:
    tensors: dict[str, tuple[str, list[int]]]  # name -> (safetensors dtype, shape)
    metadata: dict[str, str]

    def nbytes(self) -> dict[str, int]:
        """Tensor name -> bytes of its data."""
        return {name: tensor_nbytes(dt, shape) for name, (dt, shape) in self.tensors.items()}


def read_header(path) -> Header:
    """The header of safetensors file `path`; a ValueError naming the file if it is not one."""
    try:
        with safe_open(str(Path(path)), framework="numpy") as f:
            tensors = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}
            return Header(tensors, dict(f.metadata() or {}))
    except SafetensorError as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from None
