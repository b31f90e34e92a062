"""Greedy tokens and logits equal mlx-lm's on the same fixture, for every spec'd family and for
two families served at the universal level."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_load

import edge0
from edge0.backend import core as B
from edge0.store import ExpertStore, open_manifest
from tests.fixtures.families import SPECD, UNIVERSAL
from tests.fixtures.make import reference_dir

PROMPT = "hello world, once upon a time there was a tiny model that"


def mlx_lm_greedy(model, prompt, n):
    out = []
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
        out.append(int(tok))
    return out


@pytest.mark.parametrize("family", SPECD + UNIVERSAL)
def test_tokens_and_logits_match_mlx_lm(family, store_for):
    ref_model, tok = mlx_load(str(reference_dir(family)))
    prompt = tok.encode(PROMPT)
    assert len(prompt) >= 16
    expected = mlx_lm_greedy(ref_model, prompt, 32)
    assert len(set(expected)) > 1  # a degenerate fixture would make this check toothless

    for source in ("hf", "mlx"):
        engine = edge0.load(store_for(family, source), dtype="float32")
        assert (engine.spec is not None) == (family in SPECD)
        got = engine.generate(prompt, max_tokens=32, ignore_eos=True)
        assert got.tokens == expected, f"{family} ({source}): greedy tokens differ from mlx-lm"
        assert got.stats["expert_bytes_read"] > 0

    ref_logits = np.array(ref_model(mx.array(prompt[:16])[None])[0].astype(mx.float32))
    ours = engine.logits(prompt[:16])
    assert ours.shape == ref_logits.shape
    assert np.abs(ours - ref_logits).max() <= 1e-4


@pytest.mark.parametrize(
    "family,dtype",
    [("qwen3_moe", "float32"), ("deepseek_v3", "float32"), ("qwen3_moe", "bfloat16"), ("mixtral", "float16")],
)
def test_converted_tensors_bit_identical_to_mlx_lm_convert(family, dtype, store_for):
    store = store_for(family, "hf", dtype=dtype)
    ref = {}
    for f in sorted(reference_dir(family, dtype=dtype).glob("model*.safetensors")):
        ref.update(mx.load(str(f)))
    ours = dict(mx.load(str(store / "model.safetensors")))
    experts = ExpertStore(store, open_manifest(store))
    for layer, info in experts.layers.items():
        ours.update(
            {
                f"{info['module']}.{name}": B.from_raw(buf, dt, (info["num_experts"], *shape))
                for name, (buf, dt, shape) in experts.read_layer(layer).items()
            }
        )
    assert set(ours) == set(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype, k
        assert mx.array_equal(ours[k], ref[k]).item(), k


def test_bfloat16_checkpoint_at_native_dtype_matches_mlx_lm(store_for):
    ref_model, tok = mlx_load(str(reference_dir("qwen3_moe", dtype="bfloat16")))
    prompt = tok.encode(PROMPT)
    engine = edge0.load(store_for("qwen3_moe", "hf", dtype="bfloat16"), dtype="bfloat16")
    assert engine.generate(prompt, max_tokens=32, ignore_eos=True).tokens == mlx_lm_greedy(ref_model, prompt, 32)


def test_every_specd_family_in_the_registry_has_a_fixture_and_a_token_identity_case():
    from edge0.families import FAMILIES as REGISTRY
    from tests.fixtures.families import FAMILIES as FIXTURES

    # Each model type the registry gives a MoESpec has a fixture of that model_type, and the
    # fixture is in SPECD, which parametrizes test_tokens_and_logits_match_mlx_lm above.
    fixture_types = {name: f.config["model_type"] for name, f in FIXTURES.items()}
    missing = sorted(set(REGISTRY) - set(fixture_types.values()))
    assert missing == [], f"spec'd model types with no fixture in tests/fixtures/families.py: {missing}"
    assert {fixture_types[name] for name in SPECD} == set(REGISTRY)
    assert not set(UNIVERSAL) & set(REGISTRY)  # a universal-level fixture must not be spec'd
