"""Greedy tokens and logits equal mlx-lm's on the same fixture, for every spec'd family and every
other MoE family mlx-lm ships (served at the universal level), through every executor with a
cache smaller than a layer; and every mlx-lm model module with routed experts has such a case or
a documented refusal."""

import json
import pkgutil
import re
from pathlib import Path

import mlx.core as mx
import mlx_lm.models
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING
from mlx_lm.utils import load as mlx_load

import edge0
from edge0.backend import core as B
from edge0.families import REFUSED
from edge0.spec import moe_dims
from edge0.store import ExpertStore, open_manifest
from tests.fixtures import ALL_FAMILIES as ALL
from tests.fixtures import CHUNKED_PREFILL
from tests.fixtures.families import SPECD, UNIVERSAL
from tests.fixtures.make import fixture_config, reference_dir

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


# -- every MoE family of the installed mlx-lm --------------------------------------------------------------------


def mlx_lm_moe_modules() -> set[str]:
    """Modules of the installed mlx_lm.models whose model has routed experts: the module, or a model
    module it imports, builds SwitchGLU/SwitchMLP experts or keeps a list of per-expert modules."""
    root = Path(mlx_lm.models.__file__).parent
    sources = {m.name: (root / f"{m.name}.py").read_text() for m in pkgutil.iter_modules([str(root)])}
    imports = {}
    for name, src in sources.items():
        found = set(re.findall(r"^from \.(\w+) import", src, re.M))
        for group in re.findall(r"^from \. import ([\w, ]+)", src, re.M):
            found.update(n.strip() for n in group.split(","))
        imports[name] = found & set(sources)
    moe = {n for n, src in sources.items() if re.search(r"\bSwitch(GLU|MLP)\(|\bexperts = \[", src)}
    moe.discard("switch_layers")  # defines them
    while True:
        more = {n for n, deps in imports.items() if deps & moe} - moe - {"switch_layers"}
        if not more:
            return moe
        moe |= more


def module_of(family: str) -> str:
    """The mlx_lm.models module mlx-lm loads a fixture's config with (as mlx_lm.utils._get_classes)."""
    c = fixture_config(family)
    for arch in c.get("architectures") or ():
        if (c["model_type"], arch) in MODEL_ARCHITECTURE_REMAPPING:
            return MODEL_ARCHITECTURE_REMAPPING[(c["model_type"], arch)]
    return MODEL_REMAPPING.get(c["model_type"], c["model_type"])


def test_every_mlx_lm_moe_module_has_a_token_identity_case_or_a_refusal():
    found = mlx_lm_moe_modules()
    covered = {module_of(f) for f in ALL}
    assert covered <= found, f"fixtures of modules the discovery missed: {sorted(covered - found)}"
    missing = sorted(found - covered - set(REFUSED))
    assert missing == [], (
        f"mlx-lm MoE modules with no fixture in tests/fixtures/zoo.py and no entry in edge0.families.REFUSED: {missing}"
    )
    assert set(REFUSED) <= found and not set(REFUSED) & covered
    assert len(found) >= 55  # mlx-lm 0.32.2 ships 55 such modules (53 with fixtures, 2 refused)


def _small_cache(store: Path) -> tuple[int, int]:
    """(bytes of K + 1 expert slots in every MoE layer, K): a cache smaller than one layer's experts."""
    experts = ExpertStore(store, open_manifest(store))
    k = moe_dims(json.loads((store / "config.json").read_text()))[1]
    return (k + 1) * sum(experts.expert_nbytes(l) for l in experts.layers), k


# (source, prefill executor, decode executor). The default run checks one case per family, in
# turn across the families, so every source and executor is checked on many of them; -m slow adds
# the other five for every family (the suite's time budget: 53 families x 6 loads is minutes).
CASES = [
    ("hf", "whole", "staged"),
    ("mlx", "exact", "hot"),
    ("hf", "exact", "exact"),
    ("mlx", "whole", "staged"),
    ("hf", "whole", "hot"),
    ("mlx", "exact", "exact"),
]


def _default_case(family: str) -> list[tuple[str, str, str]]:
    return [CASES[ALL.index(family) % len(CASES)]]


def _check_executors(family, store_for, cases):
    ref_model, tok = mlx_load(str(reference_dir(family)))
    prompt = tok.encode(PROMPT)
    expected = mlx_lm_greedy(ref_model, prompt, 16)
    assert len(set(expected)) > 1
    for source, prefill, decode in cases:
        store = store_for(family, source)
        cache, k = _small_cache(store)
        engine = edge0.load(
            store, dtype="float32", expert_cache=cache, prefill_executor=prefill, decode_executor=decode
        )
        if decode != "exact":
            assert k + 1 == engine.streaming.n_slots < engine.streaming.max_slots  # smaller than a layer
        got = engine.generate(prompt, max_tokens=16, ignore_eos=True)
        assert got.tokens == expected, f"{family} ({source}, {prefill}/{decode}): greedy tokens differ from mlx-lm"
        stats = engine.stats()
        assert stats["totals"]["bytes_read"] > 0
        chunked = family in CHUNKED_PREFILL
        assert engine.prefiller.layerwise is not chunked
        assert (stats["prefill_chunked_spans"] > 0, stats["prefill_spans"] > 0) == (chunked, not chunked)
        assert ("not layer by layer" in engine.describe()) is chunked


@pytest.mark.parametrize("family", ALL)
def test_a_store_and_executors_with_a_small_cache_match_mlx_lm(family, store_for):
    _check_executors(family, store_for, _default_case(family))


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL)
def test_the_other_stores_and_executors_match_mlx_lm(family, store_for):
    _check_executors(family, store_for, [c for c in CASES if c not in _default_case(family)])
