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


def declared_end_ids(path: Path) -> list[int]:
    """The end-of-sequence ids config.json and generation_config.json declare (`eos_token_id`, an
    id or a list): GLM lists <|user|> and <|observation|> there only, not in its tokenizer."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((path / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):  # missing or damaged: read_config reports it
            continue
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and i >= 0 and i not in ids:
                ids.append(i)
    return ids


def remote_code(path: Path) -> str | None:
    """The class a checkpoint's tokenizer_config.json maps AutoTokenizer to, when its tokenizer is
    Python code shipped with the model (Kimi's tiktoken tokenizer), else None."""
    try:
        auto = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return None
    found = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    if isinstance(found, list):  # [slow class, fast class], either may be null
        found = next((c for c in found if isinstance(c, str)), None)
    return found if isinstance(found, str) else None


def check_remote_code(path: Path, trust_remote_code: bool) -> dict:
    """The tokenizer options for `path`: {"trust_remote_code": True} when its tokenizer is code
    and that is allowed; an Edge0Error naming the flag when it is code and not allowed."""
    code = remote_code(path)
    if code is None:
        return {}
    if not trust_remote_code:
        raise Edge0Error(
            f"{path / 'tokenizer_config.json'}: the tokenizer is Python code shipped with the model ({code}); "
            "pass --trust-remote-code to run it (only for a checkpoint you trust: the code runs with your rights)"
        )
    return {"trust_remote_code": True}


def load_tokenizer(path, trust_remote_code: bool = False) -> TokenizerWrapper:
    """mlx-lm's tokenizer, ending at every end id the checkpoint declares (its own and those of
    config.json and generation_config.json), with ids the vocabulary skips (no token string)
    detokenized as empty text: a model can sample them, and mlx-lm's BPE detokenizer would fail
    on the None. A tokenizer that is code loads only with `trust_remote_code` (check_remote_code)."""
    path = Path(path)
    extra = check_remote_code(path, trust_remote_code) or None
    tok = _mlx_load_tokenizer(path, tokenizer_config_extra=extra, eos_token_ids=declared_end_ids(path) or None)
    detok = tok._detokenizer
    tokenmap = getattr(detok, "tokenmap", None)
    if tokenmap is not None and any(t is None for t in tokenmap):
        detok.tokenmap = ["" if t is None else t for t in tokenmap]
    return tok


def control_token_ids(tokenizer, markers=()) -> frozenset[int]:
    """Ids of the tokenizer's special tokens (chat-format controls such as <|im_start|>), except
    `markers`: the tokens of the chat format's markup, whose text its parser reads."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    special = {i for i, t in added.items() if getattr(t, "special", False)} | set(getattr(hf, "all_special_ids", ()))
    keep = set(markers)
    return frozenset(i for i in special if hf.convert_ids_to_tokens(i) not in keep)


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
    """The decoder layer a module path of a spec'd family belongs to (`...layers.7.mlp` -> 7)."""
    return int(_LAYER.search(path + ".").group(1))


def decoder_layers(model) -> tuple[nn.Module, str, list] | None:
    """(owner module, attribute, list) of the model's decoder layers (`model.layers`, wherever the
    family keeps them: `model.layers`, `transformer.h`, `backbone.layers`, ...), or None. On a
    pipeline stage of a family mlx-lm pipelines, the list starts with None for each layer another
    stage runs (mlx-lm keeps the layer numbers): callers leave those entries as they are."""
    layers = getattr(model, "layers", None)
    ref = next((layer for layer in layers or () if layer is not None), None)
    if ref is None:
        return None
    for _, m in model.named_modules():
        for key, value in m.items():
            first = next((v for v in value if v is not None), None) if isinstance(value, list) else None
            if first is not None and first is ref:
                return m, key, value
    return None


def _expert_lists(model: nn.Module):
    """(path, list) of every `experts` list of per-expert modules of one class (DBRX)."""
    for path, m in model.named_modules():
        value = m.get("experts") if isinstance(m, nn.Module) else None
        if isinstance(value, list) and len(value) > 1 and all(type(e) is type(value[0]) for e in value):
            yield (f"{path}.experts" if path else "experts"), value


def expert_modules(model: nn.Module, where: Path, supported: str = "") -> list[tuple[str, int]]:
    """(path, decoder layer index) of every routed-experts module: SwitchGLU/SwitchMLP, or a list
    of per-expert modules. A model without any is an Edge0Error; `supported` says in it which
    models edge0 runs."""
    paths = [p for p, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]
    paths += [p for p, _ in _expert_lists(model)]
    if not paths:
        raise Edge0Error(
            f"{where / 'config.json'}: model_type {getattr(model, 'model_type', '?')!r} "
            "has no MoE block with routed experts (no SwitchGLU/SwitchMLP layers or list of experts); edge0 runs "
            f"MoE models only{f' ({supported})' if supported else ''}; use mlx-lm for dense models"
        )
    found = decoder_layers(model)
    ids = {id(layer): i for i, layer in enumerate(found[2])} if found else {}
    layer_paths = {p: ids[id(m)] for p, m in model.named_modules() if id(m) in ids}
    out = []
    for path in paths:
        owner = max((lp for lp in layer_paths if path.startswith(lp + ".")), key=len, default=None)
        if owner is None:
            raise Edge0Error(
                f"{where / 'config.json'}: expert module {path} is not inside the model's decoder layers "
                "(model.layers); this mlx-lm model is not supported"
            )
        out.append((path, layer_paths[owner]))
    return sorted(out, key=lambda p: p[1])


def stack_expert_lists(weights: dict, paths) -> dict:
    """Per-expert tensors of expert lists (`{path}.{e}.{name}`) stacked into `{path}.{name}` [E, ...],
    the layout the store keeps for every routed-experts module; lazily, one stack per tensor."""
    for path in paths:
        prefix = path + "."
        rows: dict[str, dict[int, mx.array]] = {}
        for k in [k for k in weights if k.startswith(prefix) and k[len(prefix) :].split(".", 1)[0].isdigit()]:
            e, name = k[len(prefix) :].split(".", 1)
            rows.setdefault(name, {})[int(e)] = weights.pop(k)
        for name, per in rows.items():
            weights[prefix + name] = mx.stack([per[e] for e in sorted(per)])
    return weights


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
    """The little-endian bytes of an evaluated array, in row-major order (a transposed view, such as
    an unquantized expert tensor mlx-lm's sanitize swapped, is copied into that order first)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    view = memoryview(a)
    if not view.c_contiguous:
        a = mx.contiguous(a)
        mx.eval(a)
        view = memoryview(a)
    return view.cast("B")


def st_dtype(a: mx.array) -> str:
    return ST_DTYPE[a.dtype]


def float32_checkpoint(mlx_dir: Path) -> Path:
    """The mlx-lm checkpoint `mlx_dir` with its floating tensors (scales, biases, norms,
    embeddings) in float32, beside it as `<name>-float32` (made once, atomically): Edge0 computes
    in float32 on a CPU, and mlx_lm.server has no dtype option (bf16 scales run its quantized
    matmuls about 9x slower here)."""
    import shutil

    out = mlx_dir.with_name(mlx_dir.name + "-float32")
    if out.exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in mlx_dir.iterdir():
        if f.suffix == ".safetensors":
            arrays = mx.load(str(f))
            arrays = {k: v.astype(mx.float32) if v.dtype in (mx.bfloat16, mx.float16) else v for k, v in arrays.items()}
            mx.save_safetensors(str(tmp / f.name), arrays, metadata={"format": "mlx"})
        elif f.is_file():
            shutil.copy2(f, tmp / f.name)
    tmp.replace(out)
    return out
