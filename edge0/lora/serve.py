"""Attach an adapter to a loaded engine as unmerged low-rank deltas, after checking that it was
trained for exactly this base store, serving width K and pre-router."""

from __future__ import annotations

from pathlib import Path

from edge0.backend import core as B
from edge0.backend import lora as blora
from edge0.errors import Edge0Error
from edge0.lora.adapter import DEFAULT_NAME, read_adapter, retrain_hint
from edge0.store.format import manifest_hash, sha256_file


def prerouter_hash(engine):
    """sha256 of the engine's pre-router heads file, or None when it routes with the gates."""
    return sha256_file(Path(engine.heads_path)) if engine.prerouting is not None else None


def store_adapter(engine) -> tuple[Path | None, str]:
    """The store's adapter that fits this engine, for serving without --lora: `lora-k{K}.safetensors`,
    then `lora.safetensors`, whichever was trained for the engine's K and routing. Returns (path,
    note); with no fitting adapter the path is None and the note says why (the describe line shows
    it), so serving at another K or without the pre-router still starts."""
    from safetensors import safe_open

    found = [p for p in (engine.root / f"lora-k{engine.k}.safetensors", engine.root / DEFAULT_NAME) if p.is_file()]
    ours, base = prerouter_hash(engine), manifest_hash(engine.root)
    for p in found:
        try:
            with safe_open(str(p), framework="numpy") as f:
                meta = f.metadata() or {}
        except Exception:  # noqa: BLE001 - a damaged file is reported by attach_lora's checks
            return p, ""
        if (str(engine.k) == meta.get("top_k") and (meta.get("prerouter_sha256") or "none") == (ours or "none")
                and meta.get("manifest_sha256") == base):
            return p, ""
    if not found:
        return None, ""
    routing = "pre-router heads" if ours else "gate routing"
    return None, (f"no recovery LoRA: {', '.join(p.name for p in found)} was trained for another store, K or "
                  f"routing than this store at K={engine.k} with {routing}")


def attach_lora(engine, path, dtype: str | None = None) -> dict:
    """Wrap the adapter's target linears of `engine.model` in LoRALinear and load its tensors, in
    `dtype` (default the compute dtype; training keeps float32 master weights). Returns the
    adapter's metadata (also kept as engine.lora_meta)."""
    path = Path(path)
    if engine.lora_path is not None:
        raise Edge0Error(f"--lora {path}: this engine already serves {engine.lora_path}; load the model again")
    heads = engine.heads_path if engine.prerouting is not None else None
    hint = retrain_hint(engine.root, engine.k, heads)
    tensors, meta = read_adapter(path, engine.root)
    base = manifest_hash(engine.root)
    if meta.get("manifest_sha256") != base:
        raise Edge0Error(f"{path}: adapter was trained for another base model (store manifest {str(meta.get('manifest_sha256'))[:12]}, "
                         f"this store {base[:12]}); {hint}")
    if meta.get("top_k") != engine.k:
        raise Edge0Error(f"{path}: adapter was trained at K={meta.get('top_k')}, this engine serves K={engine.k}; "
                         f"serve with --top-k {meta.get('top_k')} or {hint}")
    theirs, ours = meta["prerouter_sha256"], prerouter_hash(engine)
    if theirs != ours:
        had = f"pre-router heads {theirs[:12]}" if theirs else "gate routing (no pre-router)"
        has = f"heads {heads} ({ours[:12]})" if ours else "gate routing (no pre-router)"
        raise Edge0Error(f"{path}: adapter was trained with {had}, this engine uses {has}; {hint}")
    candidates = set(blora.candidate_linears(engine.model))
    unknown = [t for t in meta["targets"] if t not in candidates]
    if unknown:
        raise Edge0Error(f"{path}: targets {unknown[:3]} are not adaptable linears of this model; {hint}")
    shapes = blora.expected_shapes(engine.model, meta["targets"], meta["r"])
    wrong = [k for k, s in shapes.items() if tuple(tensors[k].shape) != s]
    if wrong:
        raise Edge0Error(f"{path}: tensor {wrong[0]} has shape {tensors[wrong[0]].shape}, the model needs {shapes[wrong[0]]}; {hint}")
    wrapped = blora.apply_lora(engine.model, meta["targets"], meta["r"], meta["alpha"])
    blora.load_lora_tensors(wrapped, tensors, B.dtype(dtype or engine.compute_dtype))
    engine.lora_path, engine.lora_meta = path, meta
    return meta
