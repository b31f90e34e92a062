"""`edge0 eval`: perplexity and agreement, checked analytically and against mlx-lm."""

import json
import subprocess
import sys

import numpy as np

from edge0.engine.evaluate import evaluate
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
    flipped = evaluate(
        model, list(rng.integers(0, v, 200)), window=32, reference_logits=lambda ids: -table[np.array(ids)]
    )
    assert flipped["agreement"] < 0.2 and flipped["kl_to_reference"] > 0.1


def test_eval_cli_matches_mlx_lm_reference(store_for, tmp_path):
    data = tmp_path / "valid.txt"
    data.write_text("Once upon a time there was a tiny model. It read its experts from disk. " * 20)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0",
            "eval",
            "--model",
            str(store_for("qwen3_moe")),
            "--data",
            str(data),
            "--reference",
            str(reference_dir("qwen3_moe")),
            "--window",
            "64",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["agreement"] == 1.0 and res["kl_to_reference"] < 1e-6 and res["perplexity"] > 1


def test_eval_decode_measures_the_expert_cache(store_for, tmp_path, capsys):
    """--decode runs through the expert cache: same perplexity as one forward pass at alpha 0,
    and substitution shows up as substitutions and fewer bytes read per token."""
    from edge0.cli.eval import main

    root = store_for("qwen3_moe")
    data = tmp_path / "valid.txt"
    data.write_text("Once upon a time there was a tiny model. It read its experts from disk. " * 8)
    two_slots = str(2 * 2 * 7680)  # 2 slots (top-k) x 2 layers x 7680-byte experts
    base = [
        "--model",
        str(root),
        "--data",
        str(data),
        "--window",
        "32",
        "--max-windows",
        "2",
        "--json",
        "--expert-cache",
        two_slots,
        "--cache-policy",
        "smoe",
    ]
    out = {}
    for name, extra in {
        "forward": [],
        "decode": ["--decode"],
        "subst": ["--decode", "--substitute-alpha", "1"],
    }.items():
        assert main(base + extra) == 0
        out[name] = json.loads(capsys.readouterr().out)
    assert abs(out["decode"]["perplexity"] - out["forward"]["perplexity"]) < 1e-3 * out["forward"]["perplexity"]
    assert out["decode"]["decode"] and out["decode"]["substitutions"] == 0 and 0 <= out["decode"]["expert_hit_rate"] < 1
    assert out["subst"]["substitutions"] > 0
    assert out["subst"]["expert_bytes_per_token"] < out["decode"]["expert_bytes_per_token"]
