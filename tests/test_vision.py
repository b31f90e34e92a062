"""Images in: a VL checkpoint's tower kept by convert, loaded through mlx-vlm's modules, and image
prompts decoded with the experts streamed, token for token as mlx-vlm decodes them (the reference)."""

import io
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("mlx_vlm")

import edge0  # noqa: E402
from edge0.errors import ImagesRefused  # noqa: E402
from edge0.store.convert import convert  # noqa: E402
from tests.fixtures.make import cached_dir  # noqa: E402
from tests.fixtures.vision import random_image, vl_fixture_dir  # noqa: E402

QUESTION = "Describe the image."


def _mlx_vlm_4bit() -> str:
    """mlx-vlm's own 4-bit conversion of the VL fixture (the layout mlx-community publishes)."""
    from mlx_vlm.convert import convert as vlm_convert

    hf = vl_fixture_dir()
    return str(
        cached_dir(
            "mlx-vlm-q4",
            "qwen3_vl_moe",
            lambda out: vlm_convert(hf_path=str(hf), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64),
        )
    )


@pytest.fixture(scope="module")
def reference():
    """mlx-vlm's model and processor on its 4-bit output, and an Edge0 store converted from it."""
    from mlx_vlm import load

    src = _mlx_vlm_4bit()
    model, processor = load(src)
    store = cached_dir("store", "vl-from-mlx-vlm", lambda out: convert(src, out, quiet=True))
    return model, processor, store


def _mlx_vlm_tokens(reference, images: list[bytes], question=QUESTION, max_tokens=10):
    from mlx_vlm import generate
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    model, processor, _ = reference
    prompt = apply_chat_template(processor, model.config, question, num_images=len(images))
    out = generate(
        model,
        processor,
        prompt,
        image=[Image.open(io.BytesIO(b)) for b in images],
        max_tokens=max_tokens,
        temperature=0.0,
        verbose=False,
    )
    return prompt, list(out.token_ids), out.prompt_tokens


@pytest.mark.parametrize("executor", ["exact", "staged", "hot"])
def test_image_prompts_decode_mlx_vlms_tokens_with_every_executor(reference, executor):
    engine = edge0.load(reference[2], decode_executor=executor)
    try:
        assert "vision tower" in engine.describe()
        for images in ([random_image(1)], [random_image(2, 96, 64), random_image(3)]):
            prompt, want, prompt_tokens = _mlx_vlm_tokens(reference, images)
            out = engine.generate(engine.tokenizer.encode(prompt, add_special_tokens=False), 10, images=images)
            assert out.tokens == want
            assert out.stats["prompt_tokens"] == prompt_tokens
    finally:
        engine.close()


def test_the_same_text_with_another_image_never_reuses_the_first_images_cache(reference):
    engine = edge0.load(reference[2])
    try:
        a, b = random_image(4), random_image(5)
        prompt, want_a, _ = _mlx_vlm_tokens(reference, [a])
        _, want_b, _ = _mlx_vlm_tokens(reference, [b])
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        assert engine.generate(ids, 10, images=[a], reuse_cache=True).tokens == want_a
        again = engine.generate(ids, 10, images=[b], reuse_cache=True)
        assert again.tokens == want_b
        # the text before the image is shared, nothing of the image
        cached = again.stats["prompt_tokens"] - again.stats["prefill_tokens"]
        assert 0 < cached <= ids.index(engine.tower.image_token)
        same = engine.generate(ids, 10, images=[b], reuse_cache=True)
        assert same.tokens == want_b and same.stats["prefill_tokens"] <= 1
    finally:
        engine.close()


def test_an_image_that_is_not_one_and_a_model_without_a_tower_are_refused(reference, tmp_path):
    engine = edge0.load(reference[2])
    try:
        prompt, _, _ = _mlx_vlm_tokens(reference, [random_image(1)], max_tokens=1)
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        with pytest.raises(ImagesRefused, match="image 1: not a readable image"):
            engine.generate(ids, 2, images=[b"not a picture"])
        with pytest.raises(ImagesRefused, match="1 image placeholders for 2 images"):
            engine.generate(ids, 2, images=[random_image(1), random_image(2)])
    finally:
        engine.close()
    text_only = edge0.load(cached_dir("store", "qwen3_moe-text", lambda out: _text_store(out)))
    try:
        with pytest.raises(ImagesRefused, match="this model does not take images"):
            text_only.generate("hello", 2, images=[random_image(1)])
    finally:
        text_only.close()


def _text_store(out):
    from tests.fixtures.make import fixture_dir

    convert(str(fixture_dir("qwen3_moe")), out, quiet=True)


def test_convert_of_an_hf_checkpoint_keeps_the_tower_as_mlx_vlm_loads_it(tmp_path):
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_vlm import load

    hf = vl_fixture_dir()
    store = convert(str(hf), tmp_path / "store", quiet=True)
    manifest = json.loads((store / "edge0-manifest.json").read_text())
    assert manifest["vision"]["file"] == "vision.safetensors" and manifest["vision"]["tensors"] > 0
    assert (store / "preprocessor_config.json").is_file()
    kept = mx.load(str(store / "vision.safetensors"))
    model, _ = load(str(hf))
    tower = {n: w for n, w in tree_flatten(model.parameters()) if not n.startswith("language_model.")}
    assert sorted(kept) == sorted(tower)
    for name, w in tower.items():
        np.testing.assert_array_equal(np.array(kept[name]), np.array(w), err_msg=name)
    engine = edge0.load(store)
    try:
        assert engine.tower is not None and engine.tower.nbytes == manifest["vision"]["bytes"]
    finally:
        engine.close()


def test_a_store_converted_without_its_tower_loads_text_only_and_says_so(tmp_path, reference):
    import shutil

    store = tmp_path / "old"
    shutil.copytree(reference[2], store)
    manifest = json.loads((store / "edge0-manifest.json").read_text())
    del manifest["vision"]
    from edge0.store.format import seal

    manifest.pop("manifest_sha256", None)
    (store / "edge0-manifest.json").write_text(json.dumps(seal(manifest), indent=1))
    engine = edge0.load(store)
    try:
        assert engine.tower is None
        assert "text only: the store holds no vision tower" in engine.describe()
    finally:
        engine.close()
