"""Quantization as `mlx_lm convert -q --q-bits 4 --q-group-size 64` does it, kept lazy so the
converter can evaluate and write one tensor at a time."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map, tree_map_with_path
from mlx_lm.convert import MODEL_CONVERSION_DTYPES
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import quantize_model

from edge0.backend import io as bio
from edge0.errors import Edge0Error


def quantize_hf(
    src: Path, bits: int = 4, group_size: int = 64, dtype: str | None = None, trust_remote_code: bool = False
):
    """Lazily load an unquantized checkpoint and quantize it exactly like mlx-lm's converter.

    Returns (weights: name -> lazy array, config, tokenizer, expert module paths).
    """
    extra = bio.check_remote_code(Path(src), trust_remote_code) or None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            model, tokenizer, config = mlx_lm_load(str(src), tokenizer_config=extra, lazy=True, return_config=True)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise Edge0Error(
            f"{src}: mlx-lm cannot load this checkpoint ({e}); check that the "
            "directory holds a complete model (config.json, *.safetensors, tokenizer)"
        ) from None
    experts = bio.expert_modules(model, src)
    if dtype is None:
        dtype = config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    if dtype in MODEL_CONVERSION_DTYPES:
        dt = getattr(mx, dtype)
        cast = getattr(model, "cast_predicate", lambda _: True)
        model.update(
            tree_map_with_path(
                lambda k, v: v.astype(dt) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
                model.parameters(),
            )
        )
    with contextlib.redirect_stdout(io.StringIO()):
        model, config = quantize_model(model, config, group_size, bits)
    weights = bio.stack_expert_lists(bio.flat_parameters(model), [p for p, _ in experts])
    # Drop the model's references so each tensor is freed once written.
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    return weights, config, tokenizer, experts


def index_quantized(src: Path, trust_remote_code: bool = False):
    """An mlx-lm checkpoint that is already quantized and stacked: its tensors as they are."""
    config = bio.load_config(src)
    files = sorted(src.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no model*.safetensors files")
    experts = bio.expert_modules(bio.build_model(config, src), src)
    weights = bio.stack_expert_lists(bio.lazy_load(files), [p for p, _ in experts])
    return weights, config, bio.load_tokenizer(src, trust_remote_code), experts
