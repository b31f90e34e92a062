"""Attach trained heads to a loaded engine: predictions become routes, and the cross-token stager
reads the predicted experts ahead."""

from __future__ import annotations

from pathlib import Path

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.backend import prerouter as bpr
from edge0.errors import Edge0Error
from edge0.prerouter.heads import load_heads
from edge0.prerouter.stager import PreRouterStager
from edge0.store.format import manifest_hash


def attach_prerouter(engine, path: Path, manifest: dict, diagnostics: bool = False) -> None:
    tensors, meta = load_heads(path, manifest_hash(engine.root), engine.spec.to_dict(), engine.root)
    blocks = dict(bnn.moe_blocks(engine.model))
    owners = [int(o) for o in meta["owners"]]
    consumers = {int(o): int(c) for o, c in meta["consumers"].items()}
    missing = [l for l in owners + list(consumers.values()) if l not in blocks]
    if missing or set(owners) != set(consumers):
        raise Edge0Error(f"{path}: heads name layers {missing or owners} that are not MoE layers of this model; retrain the heads")
    num_experts, dim = tensors[f"{owners[0]}.linear.weight"].shape
    hidden = tensors[f"{owners[0]}.fc1.weight"].shape[0]
    heads = bpr.build_heads(tensors, owners, dim, num_experts, hidden, B.dtype(engine.compute_dtype))
    biases = {c: bpr.router_bias(blocks[c]) for c in consumers.values()}
    pr = bpr.PreRouting(heads, consumers, biases, engine.spec, engine.k, diagnostics)
    for block in blocks.values():
        object.__setattr__(block, "prerouting", pr)
    engine.prerouting, engine.heads_path, engine.heads_meta = pr, Path(path), meta
    staged = {c: ex for c, ex in engine.streaming.staged().items() if c in set(consumers.values())}
    engine.stager = PreRouterStager(pr, staged)
