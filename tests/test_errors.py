"""Expected failures: one line naming the file and the fix, exit code 2, no traceback."""

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.fixtures.make import fixture_dir, write_safetensors_shards  # noqa: F401


def run_cli(*args):
    p = subprocess.run([sys.executable, "-m", "edge0", *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stderr.strip()


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def store_copy(store_for, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(store_for("qwen3_moe"), dst)
    return dst


def test_not_a_store(tmp_path):
    src = fixture_dir("qwen3_moe")
    code, err = run_cli("generate", "--model", str(src), "--prompt", "hi")
    assert_one_line_error(code, err, str(src), "not an edge0 store", "edge0 convert")


@pytest.mark.slow  # in the default suite's time budget: the other one-line CLI errors stay
def test_other_format_version(store_copy):
    m = store_copy / "edge0-manifest.json"
    data = json.loads(m.read_text())
    data["version"] = 99
    m.write_text(json.dumps(data))
    code, err = run_cli("generate", "--model", str(store_copy), "--prompt", "hi")
    assert_one_line_error(code, err, "edge0-manifest.json", "version 99", "edge0 convert")


def test_truncated_expert_file(store_copy):
    f = store_copy / "experts" / "layer-001.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    code, err = run_cli("generate", "--model", str(store_copy), "--prompt", "hi")
    assert_one_line_error(code, err, "layer-001.safetensors", "truncated", "edge0 convert")


def test_wrong_checksum(store_copy):
    f = store_copy / "experts" / "layer-000.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    code, err = run_cli("verify", str(store_copy))
    assert_one_line_error(code, err, "layer-000.safetensors", "checksum", "edge0 convert")
    code, err = run_cli("generate", "--model", str(store_copy), "--prompt", "hi", "--verify")
    assert_one_line_error(code, err, "layer-000.safetensors", "checksum")


@pytest.mark.slow  # in the default suite's time budget: the other one-line CLI errors stay
def test_config_without_moe_block(tmp_path):
    src = tmp_path / "dense"
    shutil.copytree(fixture_dir("qwen3_moe"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_experts"] = 0  # qwen3_moe with no experts builds dense MLPs only
    (src / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli("convert", "--hf-path", str(src), "-o", str(tmp_path / "out"))
    assert_one_line_error(code, err, "config.json", "no MoE block")
    assert not (tmp_path / "out").exists()


def test_usage_error_exit_2():
    code, err = run_cli("generate")
    assert code == 2 and "Traceback" not in err and "--prompt" in err
    code, err = run_cli("frobnicate")
    assert code == 2 and "unknown verb" in err


@pytest.mark.parametrize(
    "bad,kind",
    [
        pytest.param("{{ ''.__class__.__mro__ }}", "SecurityError", marks=pytest.mark.slow),  # suite time
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ],
    ids=["sandbox", "raises"],
)
def test_a_chat_template_that_fails_is_one_line(store_copy, bad, kind):
    """A template reaching for Python internals (jinja's sandbox refuses it) or raising: the CLI says
    which file holds the template, in one line, exit 2 (before: a traceback, exit 1); the server
    answers 400 without the store's path or CLI advice."""
    import edge0
    from edge0.server.config import ServerConfig
    from tests.fake_server import running_server

    template = store_copy / "chat_template.jinja"  # where a converted store keeps its template
    template.write_text(bad + "{% for m in messages %}{{ m.content }}{% endfor %}")
    code, err = run_cli("generate", "--model", str(store_copy), "--prompt", "hi", "--max-tokens", "2")
    assert code == 2 and "Traceback" not in err
    describe, error = err.splitlines()  # the load's describe line, then the error in one line
    assert describe.startswith("store: ") and error.startswith("edge0: error: ")
    for needle in (str(template), "the chat template failed", kind, "--no-chat-template"):
        assert needle in error
    code, _ = run_cli(
        "generate", "--model", str(store_copy), "--prompt", "hi", "--max-tokens", "2", "--no-chat-template"
    )
    assert code == 0
    with running_server(edge0.load(store_copy, prerouter=False), ServerConfig()) as base:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "the chat template failed" in r.json()["error"]["message"]
    assert str(store_copy) not in r.text and "--no-chat-template" not in r.text


def test_a_tokenizer_that_is_code_needs_trust_remote_code(store_copy, tmp_path):
    """Kimi's tokenizer is Python shipped with the model: refused in one line naming the flag;
    with --trust-remote-code it loads (here a subclass of the fast tokenizer, which proves it ran)."""
    config = store_copy / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["auto_map"] = {"AutoTokenizer": [None, "tokenization_fixture.FixtureTokenizer"]}
    data.pop("tokenizer_class", None)
    config.write_text(json.dumps(data))
    (store_copy / "tokenization_fixture.py").write_text(
        "import pathlib\nfrom transformers import PreTrainedTokenizerFast\n\n\n"
        "class FixtureTokenizer(PreTrainedTokenizerFast):\n"
        "    def __init__(self, *a, **k):\n"
        f"        pathlib.Path({str(tmp_path / 'ran')!r}).write_text('yes')\n"
        "        super().__init__(*a, **k)\n"
    )
    code, err = run_cli("generate", "--model", str(store_copy), "--prompt", "hi", "--max-tokens", "2")
    assert_one_line_error(code, err, str(config), "Python code shipped with the model", "--trust-remote-code")
    assert not (tmp_path / "ran").exists()
    p = subprocess.run(
        [sys.executable, "-m", "edge0", "generate", "--model", str(store_copy), "--prompt", "hi", "--max-tokens", "2"]
        + ["--trust-remote-code"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "ran").read_text() == "yes"
