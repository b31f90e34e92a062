"""`edge0 eval`: perplexity and agreement, checked analytically and against mlx-lm."""

import json
import subprocess
import sys

import numpy as np

from edge0.evaluate import evaluate
from tests.fixtures.make import reference_dir


def test_uniform_model_has_perplexity_equal_to_vocab():
    v = 50
    res = evaluate(lambda ids: np.zeros((len(ids), v)), list(range(30)) * 4, window=16)
    assert abs(res["perplexity"] - v) < 1e-9 and res["tokens"] == 119 - 7


def test_agreement_and_kl_against_a_known_model():
    v, rng = 20, np.random.default_rng(0)
    table = rng.normal(size=(v, v))
    model = lambda ids: table[np.array(ids)]  # noqa: E731
    same = evaluate(model, list(rng.integers(0, v, 200)), window=32, reference_logits=model)
    assert same["agreement"] == 1.0 and abs(same["kl_to_reference"]) < 1e-12
    flipped = evaluate(model, list(rng.integers(0, v, 200)), window=32, reference_logits=lambda ids: -table[np.array(ids)])
    assert flipped["agreement"] < 0.2 and flipped["kl_to_reference"] > 0.1


def test_eval_cli_matches_mlx_lm_reference(store_for, tmp_path):
    data = tmp_path / "valid.txt"
    data.write_text("Once upon a time there was a tiny model. It read its experts from disk. " * 20)
    p = subprocess.run([sys.executable, "-m", "edge0.evaluate", "--model", str(store_for("qwen3_moe")), "--data", str(data),
                        "--reference", str(reference_dir("qwen3_moe")), "--window", "64", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["agreement"] == 1.0 and res["kl_to_reference"] < 1e-6 and res["perplexity"] > 1
