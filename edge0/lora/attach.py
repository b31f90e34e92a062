"""Attach an adapter to a loaded engine as unmerged low-rank deltas, after checking that it was
trained for exactly this base store, serving width K and pre-router."""

from __future__ import annotations

import json
from pathlib import Path

from edge0.backend import core as B
from edge0.backend import io as bio
from edge0.backend import lora as blora
from edge0.errors import Edge0Error
from edge0.lora.adapter import DEFAULT_NAME, read_adapter, retrain_hint
from edge0.store.format import lora_file, manifest_hash, sha256_file


def prerouter_hash(engine):
    """sha256 of the engine's pre-router heads file, or None when it routes with the gates."""
    return sha256_file(Path(engine.heads_path)) if engine.prerouting is not None else None


def _mismatch(engine, meta: dict, heads_sha) -> str | None:
    """Why an adapter with identity `meta` (manifest_sha256, top_k, prerouter_sha256) does not fit
    this engine (store, serving K, heads with sha256 `heads_sha` or None for gate routing)."""
    base = manifest_hash(engine.root)
    if meta.get("manifest_sha256") != base:
        return (
            f"adapter was trained for another base model (store manifest {str(meta.get('manifest_sha256'))[:12]}, "
            f"this store {base[:12]})"
        )
    if meta.get("top_k") != engine.k:
        return f"adapter was trained at K={meta.get('top_k')}, this engine serves K={engine.k}"
    theirs = meta.get("prerouter_sha256")
    if theirs != heads_sha:
        had = f"pre-router heads {theirs[:12]}" if theirs else "gate routing (no pre-router)"
        has = f"heads {engine.heads_path} ({heads_sha[:12]})" if heads_sha else "gate routing (no pre-router)"
        return f"adapter was trained with {had}, this engine uses {has}"
    return None


def store_adapter(engine) -> tuple[Path | None, str]:
    """The store's adapter that fits this engine, for serving without --lora: `lora-k{K}.safetensors`,
    then `lora.safetensors`, whichever was trained for this store, K and routing. Returns (path,
    note); with no fitting adapter the path is None and the note says why (the describe line shows
    it), so serving at another K or without the pre-router still starts."""
    from safetensors import safe_open

    found = [p for p in (engine.root / lora_file(engine.k), engine.root / DEFAULT_NAME) if p.is_file()]
    ours, why = prerouter_hash(engine), []
    for p in found:
        try:  # the identity only: the tensors are read and checked by attach_lora
            with safe_open(str(p), framework="numpy") as f:
                raw = f.metadata() or {}
            meta = {
                "manifest_sha256": raw.get("manifest_sha256"),
                "top_k": json.loads(raw.get("top_k", "null")),
                "prerouter_sha256": None if raw.get("prerouter_sha256", "none") == "none" else raw["prerouter_sha256"],
            }
        except Exception:  # noqa: BLE001 - a damaged file is reported by attach_lora's checks
            return p, ""
        reason = _mismatch(engine, meta, ours)
        if reason is None:
            return p, ""
        why.append(f"{p.name}: {reason}")
    return None, ("no recovery LoRA: " + "; ".join(why)) if why else ""


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
    reason = _mismatch(engine, meta, prerouter_hash(engine))
    if reason is not None:
        serve_k = f"serve with --top-k {meta.get('top_k')} or " if meta.get("top_k") != engine.k else ""
        raise Edge0Error(f"{path}: {reason}; {serve_k}{hint}")
    targets = meta["targets"]
    if engine.stage is not None:  # a pipeline stage adapts its own layers' linears
        targets = [t for t in targets if engine.stage.holds(bio.layer_index(t))]
    candidates = set(blora.candidate_linears(engine.model))
    unknown = [t for t in targets if t not in candidates]
    if unknown:
        raise Edge0Error(f"{path}: targets {unknown[:3]} are not adaptable linears of this model; {hint}")
    shapes = blora.expected_shapes(engine.model, targets, meta["r"])
    wrong = [k for k, s in shapes.items() if tuple(tensors[k].shape) != s]
    if wrong:
        raise Edge0Error(
            f"{path}: tensor {wrong[0]} has shape {tensors[wrong[0]].shape}, the model needs {shapes[wrong[0]]}; {hint}"
        )
    wrapped = blora.apply_lora(engine.model, targets, meta["r"], meta["alpha"])
    blora.load_lora_tensors(wrapped, tensors, B.dtype(dtype or engine.compute_dtype))
    engine.use_lora(path, meta)
    return meta
