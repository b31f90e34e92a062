"""Synthetic routing (edge0.cache.synthetic): determinism, shapes and ranges, the streaming form
against the batch form, and one hit rate against the band it was fitted to."""

import numpy as np
import pytest

from edge0.cache import make_policy
from edge0.cache.replay import replay_layer
from edge0.cache.synthetic import QWEN3_LIKE, RouteSource, RoutingParams, generate


def test_same_seed_same_routes_other_seed_other_routes():
    a_routes, a_scores = generate(128, 8, 2, 50, seed=7)
    b_routes, b_scores = generate(128, 8, 2, 50, seed=7)
    c_routes, _ = generate(128, 8, 2, 50, seed=8)
    np.testing.assert_array_equal(a_routes, b_routes)
    np.testing.assert_array_equal(a_scores, b_scores)
    assert (a_routes != c_routes).any()


@pytest.mark.parametrize("experts,top_k,layers", [(128, 8, 3), (256, 16, 2), (16, 1, 2), (8, 8, 1)])
def test_shapes_ranges_and_scores(experts, top_k, layers):
    steps = 40
    routes, scores = generate(experts, top_k, layers, steps, seed=1)
    assert routes.shape == (layers, steps, top_k) and routes.dtype == np.int64
    assert scores.shape == (layers, steps, experts) and scores.dtype == np.float32
    assert routes.min() >= 0 and routes.max() < experts
    assert (np.diff(np.sort(routes, axis=2), axis=2) > 0).all()  # K distinct experts per row
    np.testing.assert_allclose(scores.sum(axis=2), 1.0, atol=1e-5)
    assert (scores >= 0).all()
    routed = np.take_along_axis(scores, routes, axis=2)
    assert (np.diff(routed, axis=2) <= 0).all()  # sorted by descending score
    if top_k < experts:
        unrouted = scores.copy()
        np.put_along_axis(unrouted, routes, -1.0, axis=2)
        assert (routed.min(axis=2) >= unrouted.max(axis=2)).all()  # the route is the top-K


def test_stream_equals_batch():
    routes, scores = generate(64, 4, 3, 30, seed=5)
    src = RouteSource(64, 4, 3, seed=5)
    for t in range(10):
        np.testing.assert_array_equal(src.next(), routes[:, t])
    for t in range(10, 30):
        r, s = src.step()
        np.testing.assert_array_equal(r, routes[:, t])
        np.testing.assert_array_equal(s, scores[:, t])


def test_invalid_arguments():
    with pytest.raises(ValueError, match="top_k"):
        RouteSource(8, 9, 1, seed=0)
    with pytest.raises(ValueError, match="layers"):
        RouteSource(8, 2, 0, seed=0)
    with pytest.raises(ValueError, match="routing parameters"):
        RouteSource(8, 2, 1, seed=0, params=RoutingParams(1.0, 1.0, 0.0, 0.0))


def test_lru_hit_rate_in_fitted_band():
    # Published LRU hit rate at C=E/4 is 81%; the fit keeps every cell within 3 points. Cold
    # start is included, as in the fit (it costs at most 32 / (500 * 8) = 0.8 points here).
    routes, _ = generate(128, 8, 4, 500, seed=123, params=QWEN3_LIKE)
    hits = total = 0
    for layer in routes:
        cache, _ = replay_layer(layer, None, make_policy("lru", 32, 128))
        hits, total = hits + cache.hits, total + cache.hits + cache.misses
    assert 78.0 <= 100.0 * hits / total <= 84.0


def test_text_seed_keeps_the_model_and_changes_the_tokens():
    from edge0.cache.synthetic import generate

    a, _ = generate(32, 4, 2, 400, seed=5, text_seed=1)
    b, _ = generate(32, 4, 2, 400, seed=5, text_seed=2)
    c, _ = generate(32, 4, 2, 400, seed=6, text_seed=1)
    assert not np.array_equal(a, b)
    freq = lambda r: np.bincount(r.reshape(2, -1)[0], minlength=32)  # noqa: E731
    # the same model routes to the same popular experts; another model to others
    assert np.corrcoef(freq(a), freq(b))[0, 1] > np.corrcoef(freq(a), freq(c))[0, 1] + 0.3
