"""Tests of the fixture maker: HF layout, exact sanitize round trip, mlx-lm load/convert,
tokenizer, memory fixture and cache."""

import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_tokenizer
from transformers import AutoTokenizer

from edge0.store.headers import read_header
from tests.fixtures import (
    FAMILIES,
    ZOO,
    fixture_dir,
    fixture_weights,
    make_hf_fixture,
    make_memory_fixture,
    reference_dir,
    write_tokenizer,
)
from tests.fixtures import tokenizer as tok
from tests.fixtures.make import build_model

# One routed-expert key, one other family-specific key (HF names) and the expected shape of
# the first, per family: documents the layouts the maker must produce.
EXPECTED_KEYS = {
    "qwen3_moe": ("model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.gate.weight", [64, 64]),
    "qwen3_5_moe": (
        "model.language_model.layers.0.mlp.experts.gate_up_proj",
        "model.language_model.layers.0.linear_attn.conv1d.weight",
        [8, 128, 64],
    ),
    "qwen3_next": (
        "model.layers.3.mlp.experts.6.gate_proj.weight",
        "model.layers.0.linear_attn.conv1d.weight",
        [64, 64],
    ),
    "deepseek_v3": (
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.self_attn.kv_b_proj.weight",
        [64, 64],
    ),
    "mixtral": (
        "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
        [64, 64],
    ),
    "bailing_moe": ("model.layers.2.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.gate.expert_bias", [64, 64]),
    "olmoe": ("model.layers.0.mlp.experts.5.up_proj.weight", "model.layers.0.self_attn.q_norm.weight", [64, 64]),
    "phimoe": ("model.layers.1.block_sparse_moe.experts.5.w2.weight", "lm_head.bias", [64, 64]),
}

TEXT = 'héllo ✓ 日本 — the world\n\n\ttabs  {"a": [1, 2]} 🙂 <tool_call> <|im_end|>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _shard_keys(hf_dir):
    return {p.name: read_header(p) for p in sorted(hf_dir.glob("model-*.safetensors"))}


def test_every_family_has_expected_keys():
    assert set(FAMILIES) == set(EXPECTED_KEYS)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_layout(family):
    hf_dir = fixture_dir(family)
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == family and config["architectures"]
    assert config["torch_dtype"] == "float32"
    assert config["eos_token_id"] == tok.token_id("<|im_end|>")

    shards = _shard_keys(hf_dir)
    assert len(shards) >= 2
    n = len(shards)
    assert sorted(shards) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    keys = {k: name for name, header in shards.items() for k in header.tensors}
    assert index["weight_map"] == keys
    assert index["metadata"]["total_size"] == sum(sum(h.nbytes().values()) for h in shards.values())

    expert_key, other_key, shape = EXPECTED_KEYS[family]
    headers = {k: v for header in shards.values() for k, v in header.tensors.items()}
    assert headers[expert_key] == ("F32", shape)
    assert other_key in headers
    assert not any("switch_mlp" in k or k.startswith("language_model.") for k in headers)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (hf_dir / name).exists()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sanitize_round_trip_is_exact(family, dtype):
    config, params, hf = fixture_weights(family, dtype=dtype, seed=3)
    back = build_model(config).sanitize(dict(hf))
    assert set(back) == set(params)
    for k, v in params.items():
        assert back[k].dtype == v.dtype == getattr(mx, dtype), k
        assert back[k].shape == v.shape and mx.array_equal(back[k], v).item(), k


@pytest.mark.parametrize("family", sorted(ZOO))
def test_sanitize_round_trip_of_every_other_mlx_lm_family_is_exact(family):
    """The zoo's HF layouts (float32; the token-identity tests load each through mlx-lm as well)."""
    config, params, hf = fixture_weights(family, seed=3)
    assert not any(".switch_mlp." in k or ".switch_glu." in k for k in hf) or family in ("qwen3_5", "gpt_oss")
    back = build_model(config).sanitize(dict(hf))
    assert set(back) == set(params)
    for k, v in params.items():
        assert back[k].shape == v.shape and mx.array_equal(back[k], v).item(), k


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mlx_lm_loads_hf_fixture_and_runs(family):
    model, tokenizer = mlx_lm.load(str(fixture_dir(family)))
    _, params, _ = fixture_weights(family)
    loaded = dict(tree_flatten(model.parameters()))
    assert set(loaded) == set(params)
    assert all(mx.array_equal(loaded[k], v).item() for k, v in params.items())

    ids = tokenizer.encode("Once upon a time, héllo")[:8]
    assert len(ids) == 8
    logits = model(mx.array([ids]))
    mx.eval(logits)
    assert logits.shape == (1, 8, tok.vocab_size())
    assert mx.isfinite(logits).all().item()
    assert 0.3 < logits.std().item() < 5  # neither flat nor exploding


def test_bfloat16_fixture_is_written_as_bf16(tmp_path):
    hf_dir = make_hf_fixture("qwen3_5_moe", tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((hf_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    dtypes = {dt for header in _shard_keys(hf_dir).values() for dt, _ in header.tensors.values()}
    assert dtypes == {"BF16"}


def test_overrides_reach_the_text_config():
    config, params, hf = fixture_weights("qwen3_5_moe", num_experts=16, tie_word_embeddings=True)
    assert config["text_config"]["num_experts"] == 16 and "num_experts" not in config
    assert config["tie_word_embeddings"] is config["text_config"]["tie_word_embeddings"] is True
    assert params["language_model.model.layers.0.mlp.switch_mlp.up_proj.weight"].shape[0] == 16
    assert "language_model.lm_head.weight" not in params and "lm_head.weight" not in hf


def test_maker_refuses_non_empty_dir(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(FileExistsError):
        make_hf_fixture("mixtral", tmp_path)


def test_fixtures_are_deterministic(tmp_path):
    a = make_hf_fixture("mixtral", tmp_path / "a", seed=5)
    b = make_hf_fixture("mixtral", tmp_path / "b", seed=5)
    c = make_hf_fixture("mixtral", tmp_path / "c", seed=6)
    shards = sorted(p.name for p in a.glob("model-*.safetensors"))
    assert all((a / s).read_bytes() == (b / s).read_bytes() for s in shards)
    assert any((a / s).read_bytes() != (c / s).read_bytes() for s in shards)


def test_fixture_dir_is_cached_and_atomic():
    a = fixture_dir("olmoe")
    assert fixture_dir("olmoe") == a
    other = fixture_dir("olmoe", seed=1)
    assert other != a and other.parent == a.parent
    # none of this test's temporary dirs is left (other workers may be building other fixtures)
    assert not [p for p in a.parent.iterdir() if p.name.startswith((f".tmp-{a.name}-", f".tmp-{other.name}-"))]


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_mlx_reference_is_int4_and_generates(family):
    ref = reference_dir(family)
    config = json.loads((ref / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    model, tokenizer = mlx_lm.load(str(ref))
    experts = model.model.layers[0].mlp.switch_mlp.gate_proj
    assert experts.bits == 4 and experts.group_size == 64

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=8):
        tokens.append(int(token))
    assert len(tokens) == 8 and all(0 <= t < tok.vocab_size() for t in tokens)
    assert tokenizer.has_tool_calling


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    path = write_tokenizer(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(path)
    wrapper = load_tokenizer(path)

    assert len(hf) == tok.vocab_size()
    ids = hf.encode(TEXT, add_special_tokens=False)
    assert hf.decode(ids) == TEXT
    assert wrapper.decode(wrapper.encode(TEXT, add_special_tokens=False)) == TEXT
    assert hf.convert_tokens_to_ids("<tool_call>") in ids  # markup tokens are single ids

    detok = wrapper.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == TEXT

    assert hf.eos_token == "<|im_end|>"
    assert wrapper.eos_token_ids == {tok.token_id("<|im_end|>")}
    assert wrapper.has_tool_calling
    assert (wrapper.tool_call_start, wrapper.tool_call_end) == ("<tool_call>", "</tool_call>")

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18C"},
    ]
    text = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert f"<tool_call>\n{call}\n</tool_call>" in text
    assert "<tool_response>\n18C\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")

    plain = wrapper.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=False
    )
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"
    prompt_ids = wrapper.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt_ids[0] == tok.token_id("<|im_start|>")


def test_memory_fixture_ratio(tmp_path):
    path, ratio = make_memory_fixture(tmp_path / "mem")
    assert ratio >= 10
    config = json.loads((path / "config.json").read_text())
    assert config["num_experts"] == 64
    with pytest.raises(ValueError):
        make_memory_fixture(tmp_path / "small", num_experts=8, moe_intermediate_size=64)
