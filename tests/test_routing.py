"""edge0's routing is bit-identical to each spec'd family's own mlx-lm MoE block."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from edge0.backend.moe import SpecMoEBlock
from edge0.backend.routing import route
from edge0.errors import Edge0Error
from edge0.families import spec_for
from edge0.spec import RoutingSpec
from tests.fixtures.families import SPECD
from tests.fixtures.make import build_model, fixture_config, random_params


class Recorder(nn.Module):
    """Stands in for SwitchGLU: records the indices and returns one-hot rows, so the block's
    weighted sum y[..., j] equals the weight of the j-th selected expert (j < K)."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.calls = []

    def __call__(self, x, inds, scores=None):  # scores: router scores the block passes for the expert cache
        self.calls.append(inds)
        k = inds.shape[-1]
        eye = mx.eye(k, self.dim, dtype=x.dtype)
        return mx.broadcast_to(eye, (*inds.shape, self.dim))


def _blocks(model):
    return [(p, m) for p, m in model.named_modules() if "switch_mlp" in m]


def _mute_shared(block):
    for name in ("shared_experts", "shared_expert"):
        if name in block:
            zeros = [(k, mx.zeros_like(v)) for k, v in tree_flatten(block[name].parameters())]
            block[name].update(tree_unflatten(zeros))


@pytest.mark.parametrize("family", SPECD)
def test_routing_bit_identical_to_mlx_lm(family):
    config = fixture_config(family)
    model = build_model(config)
    model.update(tree_unflatten(list(random_params(model, seed=1).items())))
    spec = spec_for(config)
    blocks = _blocks(model)
    assert blocks, family
    rng = np.random.default_rng(0)
    for path, block in blocks:
        dim = block["switch_mlp"].gate_proj.weight.shape[-1] if hasattr(block["switch_mlp"], "gate_proj") else 64
        _mute_shared(block)
        rec = Recorder(dim)
        block["switch_mlp"] = rec
        x = mx.array(rng.normal(size=(2, 7, dim)).astype(np.float32))
        y_ref = block(x)
        mx.eval(y_ref)
        ref_inds = rec.calls[-1]

        ours = SpecMoEBlock(block, spec, spec.top_k, layer=0)
        bias = ours.router_bias()
        inds, scores = route(ours.router_logits(x), spec.routing, spec.top_k, bias)
        mx.eval(inds, scores)
        assert mx.array_equal(inds, ref_inds).item(), f"{family} {path}: indices differ"
        k = spec.top_k
        assert np.array_equal(np.array(scores), np.array(y_ref[..., :k].astype(scores.dtype))), (
            f"{family} {path}: weights differ"
        )
        # and the whole block (routing + weighted sum) matches too
        y_ours = ours(x)
        assert mx.array_equal(y_ours, y_ref).item()


def test_k_override_softmax_topk_renormalises():
    logits = mx.array([[2.0, 1.0, 0.5, -1.0, 3.0]])
    spec = RoutingSpec("softmax_topk", norm_topk_prob=True)
    inds, w = route(logits, spec, 2)
    assert sorted(np.array(inds)[0].tolist()) == [0, 4]
    p = np.exp([2.0, 3.0])
    np.testing.assert_allclose(sorted(np.array(w)[0]), sorted(p / p.sum()), rtol=1e-6)
    assert abs(float(w.sum()) - 1) < 1e-6


def test_k_override_without_renorm_keeps_raw_softmax():
    logits = mx.array([[2.0, 1.0, 0.5, -1.0, 3.0]])
    inds, w = route(logits, RoutingSpec("softmax_topk", norm_topk_prob=False), 1)
    full = np.exp(np.array([2.0, 1.0, 0.5, -1.0, 3.0]))
    full /= full.sum()
    assert np.array(inds)[0].tolist() == [4]
    np.testing.assert_allclose(np.array(w)[0], [full[4]], rtol=1e-6)


def test_k_override_grouped_is_topk_of_same_scores():
    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(size=(5, 16)).astype(np.float32))
    bias = mx.array(rng.normal(size=(16,)).astype(np.float32) * 0.1)
    spec = RoutingSpec("grouped", norm_topk_prob=True, score_function="sigmoid", n_group=1, routed_scaling_factor=2.5)
    i8, _ = route(logits, spec, 8, bias)
    i3, w3 = route(logits, spec, 3, bias)
    s = 1 / (1 + np.exp(-np.array(logits)))
    corrected = s + np.array(bias)
    for t in range(5):
        top3 = set(np.argsort(-corrected[t])[:3].tolist())
        assert set(np.array(i3)[t].tolist()) == top3
        assert top3 <= set(np.array(i8)[t].tolist())
        np.testing.assert_allclose(np.array(w3)[t].sum(), 2.5, rtol=1e-5)


def test_k_equal_native_is_native_and_out_of_range_rejected():
    spec = spec_for(fixture_config("qwen3_moe"))
    assert spec.serving_k(None) == spec.top_k == spec.serving_k(spec.top_k)
    for bad in (0, spec.top_k + 1):
        with pytest.raises(Edge0Error, match="--top-k"):
            spec.serving_k(bad)
