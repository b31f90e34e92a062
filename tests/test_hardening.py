"""Issue 18, the CLI / convert / load items. Every expected failure is one line on stderr and
exit code 2, without usage text or a traceback."""

import json
import shutil

import pytest

import edge0
from edge0.cli import VERBS
from edge0.cli import main as cli_main
from edge0.errors import Edge0Error
from tests.fixtures.make import fixture_config, fixture_dir
from tests.test_errors import assert_one_line_error


def run_verb(capsys, *argv):
    """`edge0 ARGV` in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli_main(list(argv))
    return e.value.code, capsys.readouterr().err.strip()


# -- 3. flag values ------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["generate", "chat"])
@pytest.mark.parametrize("flags, needle", [
    (["--seed=-1"], "--seed -1"),
    (["--seed", str(2**64)], f"--seed {2**64}"),
    (["--temp", "-1"], "--temp -1"),
    (["--temp", "nan"], "--temp nan"),
    (["--temp", "inf"], "--temp inf"),
    (["--top-p", "5"], "--top-p 5"),
    (["--top-p", "0"], "--top-p 0"),
    (["--top-p", "nan"], "--top-p nan"),
    (["--max-tokens", "-5"], "--max-tokens -5"),
    (["--max-tokens", "x"], "--max-tokens"),
])
def test_sampling_flags_out_of_range(capsys, store_for, verb, flags, needle):
    args = [verb, "--model", str(store_for("qwen3_moe")), *flags] + (["--prompt", "hi"] if verb == "generate" else [])
    assert_one_line_error(*run_verb(capsys, *args), needle)


@pytest.mark.parametrize("verb", ["generate", "serve"])
@pytest.mark.parametrize("k", ["0", "-1", "3", "999"])
def test_top_k_out_of_range(capsys, store_for, verb, k):
    args = [verb, "--model", str(store_for("qwen3_moe")), "--top-k", k] + (["--prompt", "hi"] if verb == "generate" else [])
    code, err = run_verb(capsys, *args)
    assert_one_line_error(code, err, f"--top-k {k}")
    if int(k) > 0:
        assert "use 1..2" in err


def test_layer_executor_must_name_a_moe_layer(capsys, store_for):
    store = str(store_for("qwen3_moe"))
    code, err = run_verb(capsys, "generate", "--model", store, "--prompt", "hi", "--layer-executor", "99:decode=hot")
    assert_one_line_error(code, err, "--layer-executor 99:decode=hot", "not a MoE layer", "0-1")
    with pytest.raises(Edge0Error, match="layer 2 is not a MoE layer"):
        edge0.load(store, layer_executors={2: {"prefill": "exact"}})
    assert edge0.load(store, layer_executors={1: {"decode": "hot"}}).k == 2


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_usage_errors_are_one_line(capsys, verb):
    code, err = run_verb(capsys, verb, "--no-such-flag")
    assert_one_line_error(code, err, f"edge0 {verb}: error: ")


# -- 4. bad model directories --------------------------------------------------------------------
@pytest.fixture
def store_copy(store_for, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(store_for("qwen3_moe"), dst)
    return dst


def dense_config() -> dict:
    return {**fixture_config("qwen3_moe"), "model_type": "llama", "architectures": ["LlamaForCausalLM"]}


@pytest.mark.parametrize("content, needles", [
    pytest.param(json.dumps(dense_config()), ["model_type 'llama'", "no MoE block", "spec'd families: ", "qwen3_moe",
                                              "universal level"], id="dense"),
    pytest.param(json.dumps({**fixture_config("qwen3_moe"), "mlp_only_layers": [1]}),
                 ["routed experts in 1 layers", "2 MoE layers"], id="other-moe-layers"),
    pytest.param(json.dumps(fixture_config("mixtral")), ["model_type 'mixtral'", "holds a 'qwen3_moe' model"],
                 id="other-family"),
    pytest.param("{not json", ["not a JSON file"], id="not-json"),
    pytest.param(bytes(range(256)) * 4, ["not a JSON file", "UnicodeDecodeError"], id="random-bytes"),
    pytest.param("[1, 2]", ["a JSON list, not an object"], id="list"),
    pytest.param("{}", ["no model_type"], id="no-model-type"),
    pytest.param(json.dumps({"model_type": "no_such_family"}), ["'no_such_family' is not supported"], id="unknown-family"),
    pytest.param(json.dumps({"model_type": "qwen3_moe"}), ["cannot build a 'qwen3_moe' model"], id="fields-missing"),
    pytest.param(json.dumps({**fixture_config("qwen3_moe"), "hidden_size": "wide"}), ["cannot build"], id="wrong-type"),
    pytest.param(None, ["config.json: missing"], id="missing"),
])
def test_bad_config_in_a_store(capsys, store_copy, content, needles):
    config = store_copy / "config.json"
    if content is None:
        config.unlink()
    else:
        config.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = run_verb(capsys, "generate", "--model", str(store_copy), "--prompt", "hi")
    assert_one_line_error(code, err, str(config), *needles)


@pytest.mark.parametrize("name, content, needles", [
    pytest.param("config.json", bytes(range(256)) * 4, ["config.json: not a JSON file"], id="random-bytes"),
    pytest.param("config.json", json.dumps(dense_config()), ["model_type 'llama'", "no MoE block", "qwen3_moe"], id="dense"),
    pytest.param("generation_config.json", b"\xff\xfe", ["generation_config.json: not a JSON file"], id="gen-bytes"),
    pytest.param("generation_config.json", "[]", ["generation_config.json: a JSON list"], id="gen-list"),
])
def test_bad_config_in_a_convert_source(capsys, tmp_path, name, content, needles):
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("qwen3_moe"), src)
    (src / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = run_verb(capsys, "convert", "--hf-path", str(src), "-o", str(tmp_path / "out"))
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "out").exists()
