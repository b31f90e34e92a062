"""Images in: a VL checkpoint's tower kept by convert, loaded through mlx-vlm's modules, and image
prompts decoded with the experts streamed, token for token as mlx-vlm decodes them (the reference)."""

import io
import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("mlx_vlm")

import edge0  # noqa: E402
from edge0.errors import ImagesRefused  # noqa: E402
from edge0.store.convert import convert  # noqa: E402
from tests.fixtures.make import cached_dir  # noqa: E402
from tests.fixtures.vision import random_image, vl_fixture_dir  # noqa: E402

QUESTION = "Describe the image."
# M-RoPE and DeepStack; M-RoPE on a hybrid (linear attention); tiles of plain positions (Llama 4)
FAMILIES = ["qwen3_vl_moe", "qwen3_5_moe", "llama4"]


def _mlx_vlm_4bit(family: str = "qwen3_vl_moe") -> str:
    """mlx-vlm's own 4-bit conversion of the VL fixture (the layout mlx-community publishes)."""
    from mlx_vlm.convert import convert as vlm_convert

    hf = vl_fixture_dir(family)
    return str(
        cached_dir(
            "mlx-vlm-q4",
            family,
            lambda out: vlm_convert(hf_path=str(hf), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64),
        )
    )


_references: dict = {}


def vl_store(family: str = "qwen3_vl_moe"):
    """`edge0 convert` of the VL fixture in HF layout (the text model quantized as mlx-lm does)."""
    hf = vl_fixture_dir(family)
    return cached_dir("store", f"vl-{family}", lambda out: convert(str(hf), out, quiet=True))


def _quantized_as(model, store) -> None:
    """mlx-vlm's `model` with its text model quantized as the store's is: the modules the store holds
    scales for, at the store's bits (mlx-lm's per-module overrides included); the tower as it is."""
    import mlx.nn as nn
    from safetensors import safe_open

    q = json.loads((store / "config.json").read_text())["quantization"]
    with safe_open(str(store / "model.safetensors"), "numpy") as f:
        names = set(f.keys())
    for layer in json.loads((store / "edge0-manifest.json").read_text())["expert_layers"]:
        names.update(f"{layer['module']}.{t}" for t in layer["tensors"])

    def predicate(path, module):
        if not path.startswith("language_model.") or f"{path}.scales" not in names:
            return False
        return q[path] if path in q else True

    nn.quantize(model, q["group_size"], q["bits"], class_predicate=predicate)


def _reference(family: str):
    """mlx-vlm's model of the HF fixture with its text model quantized as mlx-lm quantizes it, its
    processor, and the Edge0 store converted from the same checkpoint."""
    from mlx_vlm import load

    if family not in _references:
        store = vl_store(family)
        model, processor = load(str(vl_fixture_dir(family)))
        _quantized_as(model, store)
        _references[family] = (model, processor, store)
    return _references[family]


@pytest.fixture(scope="module")
def reference():
    return _reference("qwen3_vl_moe")


def _mlx_vlm_tokens(reference, images: list[bytes], question=QUESTION, max_tokens=10, prompt=None):
    """mlx-vlm's greedy tokens and prompt token count for `question` with `images` (or for the
    rendered `prompt`)."""
    from mlx_vlm import generate
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    model, processor, _ = reference
    if prompt is None:
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


def _conversation(images: list[bytes]) -> list[dict]:
    """Three turns, every image in the first."""
    return [
        {"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": "It is a picture of noise."},
        {"role": "user", "content": "What colour is it mostly?"},
    ]


@pytest.mark.parametrize("executor", ["exact", "staged", "hot"])
@pytest.mark.parametrize("family", FAMILIES)
def test_image_prompts_decode_mlx_vlms_tokens_with_every_executor(family, executor):
    reference = _reference(family)
    engine = edge0.load(reference[2], decode_executor=executor)
    try:
        assert "vision tower" in engine.describe()
        for images in ([random_image(1)], [random_image(2, 96, 64), random_image(3)]):
            prompt, want, prompt_tokens = _mlx_vlm_tokens(reference, images)
            out = engine.generate(engine.tokenizer.encode(prompt, add_special_tokens=False), 10, images=images)
            assert out.tokens == want
            assert out.stats["prompt_tokens"] == prompt_tokens
        images = [random_image(4)]
        text = engine.tokenizer.decode(engine.chat_prompt(_conversation(images)), skip_special_tokens=False)
        _, want, prompt_tokens = _mlx_vlm_tokens(reference, images, prompt=text)
        out = engine.generate(text, 10, images=images)
        assert out.tokens == want and out.stats["prompt_tokens"] == prompt_tokens
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_text_with_another_image_never_reuses_the_first_images_cache(family):
    reference = _reference(family)
    engine = edge0.load(reference[2])
    try:
        a, b = random_image(4), random_image(5)
        prompt, want_a, _ = _mlx_vlm_tokens(reference, [a])
        _, want_b, _ = _mlx_vlm_tokens(reference, [b])
        if family == "qwen3_vl_moe":  # its replies depend on the picture (the check below would not fail otherwise)
            assert want_a != want_b
        # every family's first log-prob depends on the picture (its features reach the text model)
        firsts = [list(engine.stream_generate(prompt, 1, images=[image], logprobs=0))[0].logprob for image in (a, b)]
        assert abs(firsts[0] - firsts[1]) > 1e-4
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        assert engine.generate(ids, 10, images=[a], reuse_cache=True).tokens == want_a
        again = engine.generate(ids, 10, images=[b], reuse_cache=True)
        assert again.tokens == want_b
        # the text before the image is shared (a hybrid's recurrent state only at a prompt's end), nothing
        # of the image
        cached = again.stats["prompt_tokens"] - again.stats["prefill_tokens"]
        first_image = int(np.argmax(engine.image_prompt(ids, [b]).visual))
        assert (0 < cached if family == "qwen3_vl_moe" else 0 <= cached) and cached <= first_image
        if family == "qwen3_vl_moe":  # a hybrid keeps its state at a prompt's end: a longer prompt reuses it
            same = engine.generate(ids, 10, images=[b], reuse_cache=True)
            assert same.tokens == want_b and same.stats["prefill_tokens"] <= 1
        # the conversation goes on after its image: the whole first prompt is reused, as mlx-vlm decodes it
        text = engine.tokenizer.decode(ids, skip_special_tokens=False)
        longer = text + engine.tokenizer.decode(again.tokens) + "<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n"
        _, want, _ = _mlx_vlm_tokens(reference, [b], prompt=longer + "<|im_start|>assistant\n")
        turn = engine.generate(longer + "<|im_start|>assistant\n", 10, images=[b], reuse_cache=True)
        assert turn.tokens == want
        if family != "llama4":  # its chunked attention caches keep only their last chunk: not cut back that far
            assert turn.stats["prompt_tokens"] - turn.stats["prefill_tokens"] >= len(ids)
    finally:
        engine.close()


def test_an_image_that_is_not_one_and_a_model_without_a_tower_are_refused(reference, tmp_path):
    engine = edge0.load(reference[2])
    try:
        prompt, _, _ = _mlx_vlm_tokens(reference, [random_image(1)], max_tokens=1)
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        with pytest.raises(ImagesRefused, match="image 1: not a readable image"):
            engine.generate(ids, 2, images=[b"not a picture"])
        with pytest.raises(ImagesRefused, match="placeholders do not match its 2 images"):
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


@pytest.mark.parametrize("family", FAMILIES)
def test_image_rows_decode_in_a_batch_with_text_rows_as_they_do_alone(family):
    """Two image prompts (one image, two images) and two text prompts join one batch, at different
    steps: each row's tokens are its tokens alone (its rope delta travels with its row of the
    batch's cache), and the image rows' equal mlx-vlm's."""
    from edge0.engine.request import Request

    reference = _reference(family)
    engine = edge0.load(reference[2])
    try:
        if family == "llama4":  # mlx-lm has no batched form of its chunked attention cache: refused, said so
            assert "ChunkedKVCache layers have no batched form" in engine.batch_problem()
            return
        image_sets = [[random_image(6)], [random_image(7, 96, 64), random_image(8)]]
        prompts = [_mlx_vlm_tokens(reference, images, max_tokens=1)[0] for images in image_sets]
        visions = [engine.image_prompt(p, images) for p, images in zip(prompts, image_sets)]
        texts = [engine.encode("Once upon a time"), engine.encode("hello world, the answer is")]
        requests = [
            Request(visions[0].tokens, 8, ignore_eos=True, vision=visions[0]),
            Request(texts[0], 8, ignore_eos=True),
            Request(visions[1].tokens, 8, ignore_eos=True, vision=visions[1]),
            Request(texts[1], 8, ignore_eos=True),
        ]
        alone = [
            engine.generate(p, 8, ignore_eos=True, images=images).tokens for p, images in zip(prompts, image_sets)
        ] + [engine.generate(t, 8, ignore_eos=True).tokens for t in texts]
        with engine.batching() as batch:
            seqs = [batch.join(requests[0]), batch.join(requests[1])]
            batch.advance()
            batch.advance()
            seqs += [batch.join(requests[2]), batch.join(requests[3])]
            while batch.busy:
                batch.advance()
            assert batch.counts["most_rows"] >= 3
        got = [seqs[0].tokens, seqs[2].tokens, seqs[1].tokens, seqs[3].tokens]
        assert got == alone
        for (p, images), tokens in zip(zip(prompts, image_sets), got):
            assert tokens == _mlx_vlm_tokens(reference, images, prompt=p, max_tokens=8)[1]
    finally:
        engine.close()


# The VL MoE model types of the installed mlx-vlm that no test above runs, and why. Each says what
# docs/images.md says.
NOT_YET = {
    "kimi_vl": "mlx-vlm's output keeps kv_b_proj whole; mlx-lm's text model takes DeepSeek's split attention",
    **{
        f: "not tried: no VL fixture yet"
        for f in ("deepseek_v41", "gemma4", "kimi_k25", "kimi_k3", "minimax_m3_vl", "mistral3", "qwen3_5")
    },
}


def _vl_moe_types() -> list[str]:
    """The model types of the installed mlx-vlm with a vision model and routed experts (a package
    with a vision module whose source names experts)."""
    import re
    from pathlib import Path

    import mlx_vlm

    found = []
    for d in sorted((Path(mlx_vlm.__file__).parent / "models").iterdir()):
        if not d.is_dir() or d.name.startswith("_"):
            continue
        src = "".join(f.read_text() for f in d.glob("*.py"))
        vision = (d / "vision.py").exists() or "VisionModel" in src
        if vision and re.search(r"SwitchGLU|switch_mlp|n_routed_experts|num_experts\b|num_local_experts", src):
            found.append(d.name)
    return found


def test_every_vl_moe_family_of_mlx_vlm_has_a_case_or_a_reason():
    from tests.fixtures import ALL_FAMILIES

    found = _vl_moe_types()
    assert set(FAMILIES) <= set(found) and len(found) >= 10  # the discovery finds the ones tested
    # the others' text models have no Edge0 fixture: Edge0 does not run them, as text or with images
    missing = [f for f in found if f not in FAMILIES and f not in NOT_YET and f in ALL_FAMILIES]
    assert not missing, f"VL MoE families Edge0 runs with neither a test nor a reason: {missing}"
    assert not [f for f in NOT_YET if f not in found], "a reason for a family the installed mlx-vlm lacks"


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_vlms_own_4bit_output_converts_and_decodes_as_mlx_vlm_does(family):
    """The layout mlx-community publishes (mlx-vlm's conversion: its tower in float, its text model
    at 4 bits, routers included) converts, and serves mlx-vlm's tokens for it."""
    from mlx_vlm import load

    src = _mlx_vlm_4bit(family)
    store = cached_dir("store", f"vl-{family}-from-mlx-vlm", lambda out: convert(src, out, quiet=True))
    model, processor = load(src)
    engine = edge0.load(store, decode_executor="exact")
    try:
        for images in ([random_image(1)], [random_image(2, 96, 64), random_image(3)]):
            prompt, want, prompt_tokens = _mlx_vlm_tokens((model, processor, store), images)
            out = engine.generate(prompt, 10, images=images)
            assert out.tokens == want and out.stats["prompt_tokens"] == prompt_tokens
    finally:
        engine.close()


def test_without_mlx_vlm_a_vl_checkpoint_converts_and_loads_text_only(tmp_path, monkeypatch, capsys):
    """A user without the `vision` extra: the checkpoint converts (its language model, said on
    stderr), and a store with a tower loads text only, its load line saying why."""
    from edge0.backend import vision as bvision

    with_tower = vl_store()  # converted with mlx-vlm
    monkeypatch.setattr(bvision, "available", lambda: False)
    store = convert(str(vl_fixture_dir()), tmp_path / "store", quiet=True)
    assert "mlx-vlm is not installed" in capsys.readouterr().err
    assert "vision" not in json.loads((store / "edge0-manifest.json").read_text())
    engine = edge0.load(with_tower)
    try:
        assert engine.tower is None and "mlx-vlm is not installed" in engine.describe()
        with pytest.raises(ImagesRefused, match="this model does not take images"):
            engine.generate("hello", 2, images=[random_image(1)])
    finally:
        engine.close()
