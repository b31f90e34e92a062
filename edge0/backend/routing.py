"""Router logits -> (expert indices, weights), op for op as each family's mlx-lm block does it,
so indices and weights are bit-identical. `k` may be smaller than the native top-k (serving
width override): top-k of the same scores, renormalised where the family renormalises."""

from __future__ import annotations

from edge0.backend import core as B
from edge0.spec import RoutingSpec

# T tokens, E experts, K active


def softmax_topk(logits, k: int, norm: bool):
    """Qwen3-MoE: softmax over E, top-K, optional renormalisation. logits [..., T, E]."""
    gates = B.softmax(logits, axis=-1, precise=True)
    inds = B.stop_gradient(B.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = B.take_along_axis(gates, inds, axis=-1)
    if norm:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


def topk_softmax(logits, k: int):
    """Mixtral: top-K logits, softmax over those K."""
    inds = B.stop_gradient(B.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])
    scores = B.take_along_axis(logits, inds, axis=-1)
    return inds, B.softmax(scores, axis=-1, precise=True)


@B.compile
def _grouped(logits, bias, k, n_group, topk_group, scale, norm, score_function, select, eps, cast):
    in_type = logits.dtype
    if score_function == "sigmoid":
        scores = B.sigmoid(logits.astype(B.float32))
    else:
        scores = B.softmax(logits.astype(B.float32), axis=-1)
    orig_scores = scores
    if bias is not None:
        scores = scores + bias
    if n_group > 1:
        scores = B.unflatten(scores, axis=-1, shape=(n_group, -1))
        group_scores = B.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)
        drop = n_group - topk_group
        group_idx = B.argpartition(group_scores, kth=drop - 1, axis=-2)[..., :drop, :]
        zero = B.array(0.0, scores.dtype)
        scores = B.put_along_axis(scores, B.stop_gradient(group_idx), zero, axis=-2)
        scores = B.flatten(scores, -2, -1)
    if select == "tail":
        inds = B.argpartition(scores, kth=-k, axis=-1)[..., -k:]
    else:
        inds = B.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    inds = B.stop_gradient(inds)
    scores = B.take_along_axis(orig_scores, inds, axis=-1)
    if k > 1 and norm:
        denominator = scores.sum(axis=-1, keepdims=True)
        if eps:
            denominator = denominator + eps
        scores = scores / denominator
    scores = scores * scale
    return inds, (scores.astype(in_type) if cast else scores)


def route(logits, spec: RoutingSpec, k: int, bias=None):
    """Select K experts per token. Returns (indices [..., K] uint32, weights [..., K])."""
    if spec.kind == "softmax_topk":
        return softmax_topk(logits, k, spec.norm_topk_prob)
    if spec.kind == "topk_softmax":
        return topk_softmax(logits, k)
    return _grouped(
        logits,
        bias,
        k,
        spec.n_group,
        spec.topk_group,
        spec.routed_scaling_factor,
        spec.norm_topk_prob,
        spec.score_function,
        spec.select,
        spec.renorm_eps,
        spec.cast_to_input,
    )


def expert_scores(logits, spec: RoutingSpec):
    """Per-expert router scores before selection ([..., E], float32): softmax or sigmoid of the
    logits. Used by traces and score-aware cache policies, not by routing itself."""
    x = logits.astype(B.float32)
    if spec.kind == "grouped" and spec.score_function == "sigmoid":
        return B.sigmoid(x)
    return B.softmax(x, axis=-1, precise=True)
