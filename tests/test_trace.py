"""Trace format round trip and errors; traces recorded from a fixture store; `edge0 trace`."""

import json

import numpy as np
import pytest

from edge0.cache import tracefile
from edge0.errors import Edge0Error


def synthetic_trace(layers=2, steps=600, experts=8, k=2, seed=0) -> tracefile.Trace:
    """Routes with skewed, drifting expert popularity (like real routers), scores to match."""
    rng = np.random.default_rng(seed)
    routes = np.zeros((layers, steps, k), np.int64)
    scores = np.zeros((layers, steps, experts), np.float32)
    for l in range(layers):
        base = np.log(rng.dirichlet(np.full(experts, 0.5)) + 1e-6)
        state = rng.normal(size=experts)
        for t in range(steps):
            state = 0.9 * state + 0.45 * rng.normal(size=experts)
            z = base + state
            p = np.exp(z - z.max())
            p /= p.sum()
            routes[l, t] = np.argsort(-p)[:k]
            scores[l, t] = p
    meta = {
        "model": "synthetic",
        "num_experts": experts,
        "top_k": k,
        "layers": [1 + 2 * l for l in range(layers)],
        "expert_bytes": [1 << 20] * layers,
        "source": {"data": "synthetic"},
    }
    return tracefile.Trace(
        routes, scores.astype(np.float16), np.arange(steps), np.zeros(steps, np.uint8), np.array([0, steps // 2]), meta
    )


def test_round_trip(tmp_path):
    tr = synthetic_trace()
    path = tracefile.write(tmp_path / "t.npz", tr)
    assert [p.name for p in tmp_path.iterdir()] == ["t.npz"]  # no temp file left behind
    back = tracefile.read(path)
    assert back.routes.dtype == np.uint8 and np.array_equal(back.routes, tr.routes)
    assert back.scores.dtype == np.float16 and np.array_equal(back.scores, tr.scores)
    assert np.array_equal(back.starts, tr.starts) and np.array_equal(back.tokens, tr.tokens)
    assert back.meta["format"] == "edge0-trace" and back.meta["version"] == tracefile.VERSION
    assert back.layers == [1, 3] and back.num_experts == 8 and back.top_k == 2 and back.num_steps == 600


def test_many_experts_use_int16(tmp_path):
    tr = synthetic_trace(layers=1, steps=20, experts=300, k=3)
    back = tracefile.read(tracefile.write(tmp_path / "t.npz", tr))
    assert back.routes.dtype == np.int16 and np.array_equal(back.routes, tr.routes)


def test_slice_keeps_prompt_starts():
    tail = synthetic_trace().slice(250, 600)
    assert tail.num_steps == 350 and tail.starts.tolist() == [0, 50]


def _rewrite_meta(path, **changes):
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    meta.update(changes)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def test_errors_say_how_to_regenerate(tmp_path):
    path = tracefile.write(tmp_path / "t.npz", synthetic_trace(steps=10))
    _rewrite_meta(path, version=99)
    with pytest.raises(Edge0Error, match="version 99 .* reads version 1; regenerate it with: edge0 trace"):
        tracefile.read(path)
    _rewrite_meta(path, version=1, format="other")
    with pytest.raises(Edge0Error, match="not 'edge0-trace'"):
        tracefile.read(path)
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(Edge0Error, match="not an edge0 trace"):
        tracefile.read(tmp_path / "junk.npz")
    with pytest.raises(Edge0Error, match="no such trace file"):
        tracefile.read(tmp_path / "missing.npz")


def test_write_rejects_inconsistent_arrays(tmp_path):
    tr = synthetic_trace(steps=10)
    tr.routes[0, 0, 0] = 8
    with pytest.raises(ValueError, match="expert ids"):
        tracefile.write(tmp_path / "t.npz", tr)


@pytest.fixture(scope="module")
def fixture_trace(store_for, tmp_path_factory):
    """`edge0 trace` on the qwen3_moe fixture store: 2 prompts x (24 teacher-forced + 5 generated)."""
    from edge0.cli.trace import main

    tmp = tmp_path_factory.mktemp("trace")
    data = tmp / "text.txt"
    data.write_text(
        "first document about files and lists. " * 20 + "\n<|endoftext|>\n" + "second one, on modules and errors. " * 20
    )
    out = tmp / "t.npz"
    assert (
        main(
            [
                "--model",
                str(store_for("qwen3_moe")),
                "--data",
                str(data),
                "--out",
                str(out),
                "--prompts",
                "2",
                "--prompt-tokens",
                "24",
                "--max-tokens",
                "5",
            ]
        )
        == 0
    )
    return tracefile.read(out)


def test_recorded_trace_shapes(fixture_trace, store_for):
    from edge0.store.format import manifest_hash

    tr = fixture_trace
    steps = 2 * (24 + 5 - 1)  # the last generated token of each prompt is never fed back
    assert tr.routes.shape == (2, steps, 2) and tr.scores.shape == (2, steps, 8)
    assert tr.starts.tolist() == [0, 28] and tr.phase.sum() == 2 * 4
    assert tr.meta["manifest_hash"] == manifest_hash(store_for("qwen3_moe"))
    assert tr.layers == [0, 1] and tr.top_k == 2 and tr.meta["score_kind"] == "softmax"
    assert len(tr.expert_bytes) == 2 and min(tr.expert_bytes) > 0
    s = tr.scores.astype(np.float32)
    np.testing.assert_allclose(s.sum(-1), 1.0, atol=1e-2)
    # the routed experts are the top-k of the recorded softmax scores (float16 rounding aside)
    routed = np.take_along_axis(s, tr.routes.astype(np.int64), axis=-1).min(-1)
    others = np.where(np.eye(8, dtype=bool)[tr.routes.astype(np.int64)].any(-2), -1, s).max(-1)
    assert (routed >= others - 2e-3).all()


def test_trace_cli_errors(tmp_path, store_for):
    from edge0.cli.trace import main

    with pytest.raises(Edge0Error, match="no such file"):
        main(
            [
                "--model",
                str(store_for("qwen3_moe")),
                "--data",
                str(tmp_path / "none.txt"),
                "--out",
                str(tmp_path / "t.npz"),
            ]
        )
    with pytest.raises(Edge0Error, match="does not exist"):
        main(["--model", "x", "--data", "x", "--out", str(tmp_path / "no" / "t.npz")])


def test_trace_records_the_routes_pre_routed_layers_use(tmp_path):
    """The bundled model serves with its pre-router by default: decode steps of consumer layers
    take the predicted routes, and the trace records them (one row per token in every layer)."""
    from edge0.cli.trace import main

    data = tmp_path / "text.txt"
    data.write_text("The Python tutorial explains lists, dictionaries and modules. " * 8)
    out = tmp_path / "t.npz"
    assert (
        main(["--data", str(data), "--out", str(out), "--prompts", "1", "--prompt-tokens", "12", "--max-tokens", "6"])
        == 0
    )
    tr = tracefile.read(out)
    assert tr.routes.shape[:2] == (6, 12 + 6 - 1)
    assert tr.phase.sum() == 5


def test_trace_of_synthetic_routes_has_the_model_shape(tmp_path, store_for):
    from edge0.cli.trace import main
    from edge0.store.format import manifest_hash

    out = tmp_path / "s.npz"
    assert (
        main(
            [
                "--model",
                str(store_for("qwen3_moe")),
                "--routing",
                "qwen3-like",
                "--out",
                str(out),
                "--prompts",
                "2",
                "--prompt-tokens",
                "10",
                "--max-tokens",
                "5",
            ]
        )
        == 0
    )
    tr = tracefile.read(out)
    assert tr.routes.shape == (2, 30, 2) and tr.num_experts == 8
    assert (
        tr.meta["manifest_hash"] == manifest_hash(store_for("qwen3_moe"))
        and tr.meta["source"]["routing"] == "qwen3-like"
    )
