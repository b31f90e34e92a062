"""Model construction from a config, lazy safetensors access and tokenizers (via mlx-lm)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, load_config, save_config
from mlx_lm.utils import load_tokenizer as _mlx_load_tokenizer

from edge0.errors import Edge0Error
from edge0.units import SAFETENSORS_DTYPES

__all__ = ["load_config", "load_tokenizer", "save_config", "TokenizerWrapper"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
ST_DTYPE = {getattr(mx, name): label for label, (name, _) in SAFETENSORS_DTYPES.items() if hasattr(mx, name)}


def load_tokenizer(path, **kwargs) -> TokenizerWrapper:
    """mlx-lm's tokenizer, with ids the vocabulary skips (no token string) detokenized as empty
    text: a model can sample them, and mlx-lm's BPE detokenizer would fail on the None."""
    tok = _mlx_load_tokenizer(Path(path), **kwargs)
    detok = tok._detokenizer
    tokenmap = getattr(detok, "tokenmap", None)
    if tokenmap is not None and any(t is None for t in tokenmap):
        detok.tokenmap = ["" if t is None else t for t in tokenmap]
    return tok


def control_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens (chat-format controls such as <|im_start|>), except
    those that mark reasoning or tool calls, whose text the server parses."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    special = {i for i, t in added.items() if getattr(t, "special", False)} | set(getattr(hf, "all_special_ids", ()))
    markers = {
        getattr(tokenizer, name, None) for name in ("think_start", "think_end", "tool_call_start", "tool_call_end")
    }
    return frozenset(i for i in special if hf.convert_ids_to_tokens(i) not in markers)


def read_config(root: Path, fix: str) -> dict:
    """`root`/config.json as mlx-lm reads it, after checking that it and generation_config.json
    (if present) are JSON objects and that config.json names a model_type; else an Edge0Error
    that names the file, what it holds, and `fix`."""
    for name, required in (("config.json", True), ("generation_config.json", False)):
        path = root / name
        if not path.is_file():
            if required:
                raise Edge0Error(f"{path}: missing; {fix}")
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise Edge0Error(f"{path}: not a JSON file ({type(e).__name__}: {e}); {fix}") from None
        except OSError as e:
            raise Edge0Error(f"{path}: cannot be read ({e.strerror}); {fix}") from None
        if not isinstance(data, dict):
            raise Edge0Error(f"{path}: a JSON {type(data).__name__}, not an object; {fix}")
        if required and not isinstance(data.get("model_type"), str):
            raise Edge0Error(f"{path}: no model_type (the mlx-lm model family); {fix}")
    return load_config(root)


def model_classes(config: dict, where: Path):
    try:
        return _get_classes(config)
    except ValueError:
        raise Edge0Error(
            f"{where / 'config.json'}: model_type {config.get('model_type')!r} is not supported "
            "by the installed mlx-lm; upgrade mlx-lm (pip install -U mlx-lm)"
        ) from None


def build_model(config: dict, where: Path) -> nn.Module:
    """An mlx-lm model for `config` with lazily initialised (never evaluated) parameters."""
    model_class, args_class = model_classes(config, where)
    try:
        return model_class(args_class.from_dict(config))
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        # Nothing but config.json goes in here, so a failure is a field missing or of the wrong type.
        raise Edge0Error(
            f"{where / 'config.json'}: mlx-lm cannot build a {config['model_type']!r} model from it "
            f"({type(e).__name__}: {e}); the file is damaged or incomplete"
        ) from None


def layer_index(path: str) -> int:
    """The decoder layer a module path belongs to (`...layers.7.mlp` -> 7)."""
    return int(_LAYER.search(path + ".").group(1))


def expert_modules(model: nn.Module, where: Path, supported: str = "") -> list[tuple[str, int]]:
    """(path, layer index) of every SwitchGLU/SwitchMLP module: the routed experts. A model
    without any is an Edge0Error; `supported` says in it which models edge0 runs."""
    found = []
    for path, m in model.named_modules():
        if isinstance(m, (SwitchGLU, SwitchMLP)):
            layer = _LAYER.search(path + ".")
            if layer is None:
                raise Edge0Error(f"{where / 'config.json'}: expert module {path} is not inside a layers list")
            found.append((path, int(layer.group(1))))
    if not found:
        raise Edge0Error(
            f"{where / 'config.json'}: model_type {getattr(model, 'model_type', '?')!r} "
            "has no MoE block with routed experts (no SwitchGLU/SwitchMLP layers); edge0 runs "
            f"MoE models only{f' ({supported})' if supported else ''}; use mlx-lm for dense models"
        )
    return sorted(found, key=lambda p: p[1])


def lazy_load(files) -> dict:
    """Tensors of safetensors files, read from disk only when evaluated."""
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def flat_parameters(model: nn.Module) -> dict:
    return dict(tree_flatten(model.parameters()))


def materialize(arrays: list) -> None:
    mx.eval(*arrays)


def raw_bytes(a: mx.array) -> memoryview:
    """The little-endian bytes of an evaluated array."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return memoryview(a).cast("B")


def st_dtype(a: mx.array) -> str:
    return ST_DTYPE[a.dtype]
