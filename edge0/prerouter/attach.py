"""Attach trained heads to a loaded engine: predictions become routes, and the cross-token stager
reads the predicted experts ahead."""

from __future__ import annotations

from pathlib import Path

from edge0.backend import assemble as bas
from edge0.backend import core as B
from edge0.backend import heads as bheads
from edge0.errors import Edge0Error
from edge0.prerouter.heads import DEFAULT_NAME, load_heads
from edge0.prerouter.routes import PreRouting
from edge0.prerouter.stager import PreRouterStager
from edge0.store.format import manifest_hash


def heads_path(root: Path, prerouter, spec) -> Path | None:
    """The heads file to serve: `prerouter` None = the store's own (spec'd families only),
    False = none, or a path."""
    if prerouter is False:
        return None
    if prerouter is None:
        auto = root / DEFAULT_NAME
        return auto if auto.is_file() and spec is not None else None
    if spec is None:
        raise Edge0Error(
            f"--prerouter {prerouter}: this model is served at the universal level (no MoESpec); the pre-router "
            "needs a spec'd family"
        )
    return Path(prerouter).expanduser()


def attach_prerouter(engine, path: Path, diagnostics: bool = False) -> PreRouting:
    """Load the heads at `path` (checked against this store) and route with them."""
    tensors, meta = load_heads(path, manifest_hash(engine.root), engine.spec.to_dict(), engine.root)
    blocks = dict(bas.moe_blocks(engine.model))
    moe = set(engine.stage.moe_layers) if engine.stage is not None else set(blocks)
    owners = [int(o) for o in meta["owners"]]
    consumers = {int(o): int(c) for o, c in meta["consumers"].items()}
    missing = [l for l in owners + list(consumers.values()) if l not in moe]
    if missing or set(owners) != set(consumers):
        raise Edge0Error(
            f"{path}: heads name layers {missing or owners} that are not MoE layers of this model; retrain the heads"
        )
    num_experts, dim = tensors[f"{owners[0]}.linear.weight"].shape
    hidden = tensors[f"{owners[0]}.fc1.weight"].shape[0]
    # on a pipeline stage: the heads of its owner layers, the router biases of its consumers
    here = [o for o in owners if o in blocks]
    heads = bheads.build_heads(tensors, here, dim, num_experts, hidden, B.dtype(engine.compute_dtype))
    biases = {c: blocks[c].router_bias() for c in consumers.values() if c in blocks}
    remote = frozenset(consumers[o] for o in here if consumers[o] not in blocks)
    pr = PreRouting(heads, {o: consumers[o] for o in here}, biases, engine.spec, engine.k, diagnostics, remote)
    use_prerouting(engine, pr, Path(path), meta)
    if engine.pipeline is not None:
        engine.pipeline.outgoing, engine.pipeline.incoming = pr.take_outgoing, pr.receive
    return pr


def use_prerouting(engine, pr: PreRouting, path: Path | None = None, meta: dict | None = None) -> None:
    """Install `pr` in every MoE block and its stager in the engine's generation loop."""
    for _, block in bas.moe_blocks(engine.model):
        block.use_prerouting(pr)
    consumers = set(pr.biases)
    staged = {c: ex for c, ex in engine.streaming.staged().items() if c in consumers}
    engine.use_prerouter(pr, PreRouterStager(pr, staged, path), path, meta)
