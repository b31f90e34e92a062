"""Passes for checks, evaluation and traces, not for serving: teacher-forced logits (with gate
routing, or along the routes decoding would use) and route observation."""

from __future__ import annotations

from edge0.backend import assemble as bas
from edge0.backend import core as B
from edge0.backend import forward as bfw
from edge0.engine.parts import Parts
from edge0.errors import Edge0Error


def logits(model, tokens: list[int]):
    """Float32 logits of every prompt position [T, V] (no cache; gate routing)."""
    return bfw.full_logits(model, tokens)


def prerouted_logits(model, hooks, tokens: list[int]):
    """Float32 logits [T, V] of every position in one forward pass, routed as decoding routes
    them: with a pre-router, each pre-routed layer uses at position t the route its head
    predicted at t-1 (position 0 uses the gate). Without one this is `logits`."""
    with hooks.teacher_forcing():
        return bfw.full_logits(model, tokens)


def decode_logits(parts: Parts, tokens: list[int]):
    """Float32 log-probs [T, V] of every position, computed token by token through the KV cache
    and the expert cache, as decoding does (teacher forcing)."""
    kept = []

    def keep(logprobs):
        kept.append(logprobs)
        return B.argmax(logprobs, axis=-1)

    kv, stepper = parts.kv, parts.stepper
    cache = kv.make()  # nothing reuses it
    stepper.hooks.start()
    try:
        for i, t in enumerate(tokens):
            stepper.decode([t], i, keep, cache)
    finally:
        stepper.hooks.finish()
    out = B.to_numpy(B.concatenate(kept, axis=0).astype(B.float32))
    return out.reshape(len(tokens), -1)


def observe_routes(parts: Parts, fn) -> None:
    """Call fn(layer, indices [T, K] int array, scores [T, E] float32) for every forward pass of
    every spec'd MoE layer (None stops). Each call syncs to the host: for traces only."""
    if parts.spec is None:
        raise Edge0Error(
            f"{parts.model_id}: route tracing needs a spec'd family (this one is served at the universal level)"
        )
    for layer, block in bas.moe_blocks(parts.model):
        block.use_observer(None if fn is None else (lambda i, s, layer=layer: fn(layer, i, s)))
    parts.prefiller.skip_last = fn is None  # an observer sees every layer's routes, the last one's too
