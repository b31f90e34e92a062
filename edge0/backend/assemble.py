"""A store's model put together: the family's mlx-lm model from config.json, its resident weights
loaded, and the streaming modules of moe.py in place of its expert layers and MoE blocks."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from edge0.backend import io as bio
from edge0.backend import stages as bstages
from edge0.backend.modules import get_module, set_module
from edge0.backend.moe import SpecMoEBlock, StreamingExpertList, StreamingExperts


def assemble(
    root: Path,
    resident_file: str,
    manifest: dict,
    config: dict,
    spec,
    k: int | None,
    compute_dtype: str,
    stage: tuple[int, int, list[int]] | None = None,
):
    """Build the model of a store: resident weights loaded and evaluated, each expert module
    replaced by a StreamingExperts (see attach_executors), and, for spec'd families, each MoE
    block replaced by a SpecMoEBlock serving width `k`.

    `stage` = (rank, ranks, layers per rank, rank 0 first): a pipeline stage that holds only its
    layers (`manifest` lists only their experts), the embedding on the first stage (the last rank)
    and the final norm and head on the last (rank 0); other weights are never read."""
    model = bio.build_model(config, root)
    resident = bio.lazy_load([root / resident_file])
    names = set(resident)
    for layer in manifest["expert_layers"]:
        names.update(f"{layer['module']}.{t}" for t in layer["tensors"])
    q = config.get("quantization")
    if q:

        def predicate(p, m):
            if p in q:
                return q[p]
            return hasattr(m, "to_quantized") and f"{p}.scales" in names

        nn.quantize(model, q["group_size"], q["bits"], mode=q.get("mode", "affine"), class_predicate=predicate)

    dt = getattr(mx, compute_dtype)
    for layer in manifest["expert_layers"]:
        path = layer["module"]
        inner = get_module(model, path)
        if isinstance(inner, list):  # per-expert modules: one of them runs each expert's stored tensors
            stream = StreamingExpertList(quantized_like(inner[0], layer["tensors"], q), layer["layer"])
        else:
            stream = StreamingExperts(inner, layer["layer"])
        set_module(model, path, stream)
        if spec is not None:
            block_path = path[: -len(spec.experts) - 1]
            set_module(model, block_path, SpecMoEBlock(get_module(model, block_path), spec, k, layer["layer"]))

    keep = None
    if stage is not None:
        rank, size, split = stage
        skip = bstages.keep_stage_layers(model, rank, size, split, rank == size - 1, rank == 0)
        keep = {n for n, _ in tree_flatten(model.parameters()) if not any(n.startswith(p) for p in skip)}
        missing = keep - set(resident)
        if missing:
            raise ValueError(f"Missing parameters: {', '.join(sorted(missing)[:5])}.")
    cast = getattr(model, "cast_predicate", lambda _: True)
    weights = [
        (n, w.astype(dt) if mx.issubdtype(w.dtype, mx.floating) and cast(n) else w)
        for n, w in resident.items()
        if keep is None or n in keep
    ]
    model.eval()
    model.load_weights(weights, strict=keep is None)
    if stage is not None:
        bstages.replace_stage_ends(model, rank == size - 1, rank == 0)
    evaluate_all(model)
    return model


def quantized_like(template: nn.Module, tensors, q: dict | None) -> nn.Module:
    """`template` with the modules quantized whose `.scales` are among `tensors` (names relative to
    it), as `q` (config.json's "quantization") says: one expert's module as the store holds that
    list's experts, a vision tower as its checkpoint holds it."""
    if q:
        nn.quantize(
            template,
            q["group_size"],
            q["bits"],
            mode=q.get("mode", "affine"),
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in tensors,
        )
    return template


def evaluate_all(model: nn.Module) -> None:
    """Evaluate the parameters and every array a module keeps as a plain attribute (mlx-lm's YaRN
    and Llama3 RoPE keep lazy `_freqs`): MLX runs a lazy array only on the thread that built it,
    and the server generates on its engine thread, not the loading one."""
    extra = [v for m in model.modules() for v in m.values() if isinstance(v, mx.array)]
    mx.eval(model.parameters(), extra)


def attach_executors(model: nn.Module, executors: dict) -> None:
    """Give every StreamingExperts (and StreamingExpertList) its executor, by layer."""
    for _, m in model.named_modules():
        if isinstance(m, (StreamingExperts, StreamingExpertList)):
            m.use_executor(executors[m.layer])


def moe_blocks(model: nn.Module) -> list[tuple[int, SpecMoEBlock]]:
    """(layer index, block) of every SpecMoEBlock, in layer order."""
    found = [(bio.layer_index(p), m) for p, m in model.named_modules() if isinstance(m, SpecMoEBlock)]
    return sorted(found, key=lambda t: t[0])
