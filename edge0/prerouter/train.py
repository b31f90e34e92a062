"""Pre-router training: collect (layer N input at t, layer N+1 routing at t+1) pairs with the
streaming engine, fit one head per owner layer, measure held-out recall, write the heads file."""

from __future__ import annotations

import datetime
import time

import numpy as np
from tqdm import tqdm

from edge0.backend import assemble as bas
from edge0.backend import core as B
from edge0.backend import heads as bheads
from edge0.backend import train as bt
from edge0.backend.routing import route
from edge0.engine.evaluate import windows
from edge0.errors import Edge0Error
from edge0.prerouter.heads import save_heads
from edge0.store.format import manifest_hash


def owner_layers(engine, start: int | None = None) -> dict[int, int]:
    """owner MoE layer -> the next MoE layer (its consumer), from `start` on."""
    layers = [l for l, _ in bas.moe_blocks(engine.model)]
    pairs = {a: b for a, b in zip(layers, layers[1:])}
    return {a: b for a, b in pairs.items() if start is None or a >= start}


def collect(engine, tokens: list[int], window: int, progress: bool = True) -> list[dict]:
    """Teacher-force `tokens` through the model window by window (gate routing, whole-layer
    prefill). Per window: {layer: (x [T, D] float16, gate indices [T, K], router scores [T, E] float16)}."""
    blocks = dict(bas.moe_blocks(engine.model))
    out = []
    current: dict = {}

    def hook(layer):
        return lambda x, inds, probs: current.__setitem__(layer, (x.astype(np.float16), inds, probs.astype(np.float16)))

    for layer, b in blocks.items():
        b.use_capture(hook(layer))
    try:
        for w in tqdm(windows(tokens, window, None), desc="collect", unit="window", disable=not progress):
            current = {}
            engine.logits(w)
            out.append(current)
    finally:
        for b in blocks.values():
            b.use_capture(None)
    return out


def pairs(traces: list[dict], owner: int, consumer: int):
    """Features at t and labels at t+1 within each window."""
    x = np.concatenate([t[owner][0][:-1] for t in traces])
    inds = np.concatenate([t[consumer][1][1:] for t in traces])
    probs = np.concatenate([t[consumer][2][1:] for t in traces]).astype(np.float32)
    return x, inds, probs


def head_loss(head, x, target, topk, score_function: str, listwise: float, divergence: float = 1.0):
    """`divergence` x divergence to the next router's distribution + `listwise` x mean
    cross-entropy of the true top-k under the head's softmax."""
    logits = head(x)
    logp = logits - B.logsumexp(logits, axis=-1, keepdims=True)
    if score_function == "sigmoid":
        div = bt.binary_cross_entropy_with_logits(logits, target) * target.shape[-1]
    else:
        div = (target * (B.log(B.maximum(target, 1e-12)) - logp)).sum(axis=-1).mean()
    return divergence * div - listwise * B.take_along_axis(logp, topk, axis=-1).mean()


def train_head(
    init_linear: np.ndarray,
    x: np.ndarray,
    target: np.ndarray,
    topk: np.ndarray,
    *,
    hidden: int,
    steps: int,
    lr: float,
    batch: int,
    listwise: float,
    score_function: str,
    seed: int = 0,
    divergence: float = 1.0,
):
    """Fit one head (see head_loss) with Adam on a cosine schedule. x [N, D], target [N, E] router
    probabilities (softmax) or per-expert sigmoid scores, topk [N, K] indices. Returns (head, losses)."""
    B.seed(seed)
    head = bheads.new_head(init_linear, hidden)
    trainer = bt.Trainer(head, bt.cosine(lr, steps))
    xs, ts, ks = B.array(x.astype(np.float32)), B.array(target.astype(np.float32)), B.array(topk.astype(np.int32))

    def objective(xb, tb, kb):
        return head_loss(head, xb, tb, kb, score_function, listwise, divergence)

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        idx = B.array(rng.integers(0, len(x), size=min(batch, len(x))))
        losses.append(trainer.step(objective, xs[idx], ts[idx], ks[idx]))
    return head, losses


def head_topk(head, x: np.ndarray, spec, k: int, bias) -> np.ndarray:
    """The route a head gives for features x [N, D] (indices [N, k])."""
    inds, _ = route(head(B.array(x.astype(np.float32))), spec.routing, k, bias)
    return B.to_numpy(inds)


def recall(pred: np.ndarray, true: np.ndarray) -> float:
    """Mean fraction of the true experts that the prediction contains."""
    return float(np.mean([len(set(p) & set(t)) / len(t) for p, t in zip(pred.tolist(), true.tolist())]))


def train(
    engine,
    text: str,
    *,
    data_name: str,
    window: int = 256,
    max_tokens: int = 60000,
    holdout: float = 0.1,
    hidden: int = 64,
    steps: int = 600,
    lr: float = 2e-3,
    batch: int = 512,
    listwise: float = 0.5,
    start: int | None = None,
    seed: int = 0,
    progress: bool = True,
):
    """Train heads for every owner layer. Returns (tensors, metadata, report)."""
    if engine.spec is None:
        raise Edge0Error(
            f"{engine.root}: the pre-router needs a spec'd family (this model is served at the universal level)"
        )
    t0 = time.perf_counter()
    # Tokenize only what is used (about 8 characters per token is a safe upper bound).
    tokens = engine.encode(text[: max_tokens * 8])[:max_tokens]
    traces = collect(engine, tokens, window, progress)
    if len(traces) < 2:
        raise Edge0Error(
            f"--data: too little text ({len(tokens)} tokens) for {window}-token windows with a held-out part; give "
            "more text"
        )
    n_val = max(1, int(len(traces) * holdout))
    train_tr, val_tr = traces[:-n_val], traces[-n_val:]
    blocks = dict(bas.moe_blocks(engine.model))
    spec, k = engine.spec, engine.spec.top_k
    tensors, report = {}, {}
    owners = owner_layers(engine, start)
    if not owners:
        raise Edge0Error(f"--start-layer {start}: no MoE layer from there has a following MoE layer")
    for owner, consumer in tqdm(owners.items(), desc="train", unit="head", disable=not progress):
        x, inds, probs = pairs(train_tr, owner, consumer)
        init = B.to_numpy(blocks[consumer].router_weight())
        head, losses = train_head(
            init,
            x,
            probs,
            inds,
            hidden=hidden,
            steps=steps,
            lr=lr,
            batch=batch,
            listwise=listwise,
            score_function=spec.routing.score_function if spec.routing.kind == "grouped" else "softmax",
            seed=seed + owner,
        )
        vx, vinds, vprobs = pairs(val_tr, owner, consumer)
        bias = blocks[consumer].router_bias()
        untrained = bheads.new_head(init, hidden)
        half = max(1, k // 2)
        report[consumer] = {
            "owner": owner,
            "train_pairs": len(x),
            "val_pairs": len(vx),
            "recall_at_k": recall(head_topk(head, vx, spec, k, bias), vinds),
            "recall_at_k_untrained": recall(head_topk(untrained, vx, spec, k, bias), vinds),
            # Gate's top-K/2 of the true scores (exact for softmax top-k routing).
            "recall_at_half_k": recall(head_topk(head, vx, spec, half, bias), np.argsort(-vprobs, axis=1)[:, :half]),
            "first_loss": losses[0],
            "final_loss": float(np.mean(losses[-20:])),
        }
        tensors.update(bheads.head_tensors(head, owner))
    meta = {
        "manifest_sha256": manifest_hash(engine.root),
        "spec": spec.to_dict(),
        "owners": list(owners),
        "consumers": {str(o): c for o, c in owners.items()},
        "provenance": {
            "data": data_name,
            "tokens": len(tokens),
            "window": window,
            "holdout_windows": n_val,
            "hidden": hidden,
            "steps": steps,
            "lr": lr,
            "batch": batch,
            "listwise_weight": listwise,
            "loss": "KL(router || head) + listwise x CE(true top-k)",
            "seed": seed,
            "date": datetime.date.today().isoformat(),
            "seconds": round(time.perf_counter() - t0, 1),
            "validation": report,
        },
    }
    return tensors, meta, report


def write(path, tensors, meta):
    return save_heads(path, tensors, meta)
