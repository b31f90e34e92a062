"""The bundled demo model: loads with no --model, converts into the cache, matches mlx-lm."""

import contextlib
import io
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_load

import edge0
from edge0.store.bundled import bundled_checkpoint, bundled_store


@pytest.fixture(scope="module")
def mlx_reference(tmp_path_factory):
    from mlx_lm.convert import convert

    out = tmp_path_factory.mktemp("demo") / "q4"
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(bundled_checkpoint()), str(out), quantize=True, q_bits=4, q_group_size=64)
    return mlx_load(str(out))


def test_bundled_model_converts_into_the_cache_and_loads(edge0_cache):
    store = bundled_store()
    assert str(store).startswith(str(edge0_cache)) and (store / "edge0-manifest.json").is_file()
    assert (store / "prerouter.safetensors").is_file()  # the bundled heads travel with it
    engine = edge0.load(None)
    assert engine.root == store and engine.prerouting is not None and engine.spec.num_experts == 16
    # the recovery adapters travel with it too, and the one for the serving K is used
    assert engine.lora_path == store / "lora.safetensors" and engine.lora_meta["top_k"] == 4
    assert edge0.load(None, top_k=2).lora_path == store / "lora-k2.safetensors"
    assert edge0.load(None, top_k=3).lora_path is None  # none trained for K=3: served without one


def test_bundled_greedy_matches_mlx_lm(mlx_reference):
    model, tok = mlx_reference
    prompt = tok.encode("The Python interpreter is")
    want = []
    for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=24), range(24)):
        want.append(int(t))
    engine = edge0.load(None, prerouter=False, lora=False)  # mlx-lm: gate routing, no adapter
    assert engine.generate(prompt, max_tokens=24, ignore_eos=True).tokens == want


@pytest.mark.parametrize("routing", [pytest.param("--no-prerouter", marks=pytest.mark.slow), None])  # suite time
def test_generate_cli_with_no_model_prints_text_and_stats(routing):
    args = [
        sys.executable,
        "-m",
        "edge0",
        "generate",
        "--prompt",
        "A list is",
        "--max-tokens",
        "30",
        "--no-chat-template",
    ]
    p = subprocess.run(args + ([routing] if routing else []), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "tok/s" in p.stderr and "experts read" in p.stderr and len(p.stdout.strip()) >= 10
    if routing is None:  # the defaults: the bundled heads and the recovery adapter for K=4
        assert "LoRA lora.safetensors" in p.stderr
    if routing == "--no-prerouter":  # the model itself writes real words
        words = [w for w in p.stdout.split() if w.isalpha()]
        assert len(words) >= 5
