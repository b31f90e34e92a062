"""Issue 18, the CLI / convert / load items: concurrent first use and convert, partial directories
of killed conversions, flag values out of range, and bad model directories. Every expected
failure is one line on stderr and exit code 2."""

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import edge0
from edge0.cli import VERBS
from edge0.cli import main as cli_main
from edge0.errors import Edge0Error
from edge0.store.convert import convert
from tests.fixtures.make import fixture_config, fixture_dir
from tests.test_errors import assert_one_line_error

ROOT = Path(__file__).resolve().parents[1]


def run_verb(capsys, *argv):
    """`edge0 ARGV` in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli_main(list(argv))
    return e.value.code, capsys.readouterr().err.strip()


def start(script: str, *args, env=None) -> subprocess.Popen:
    """A Python process running `script` with `args` as sys.argv[1:], in this checkout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(p: subprocess.Popen, timeout=120):
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err.strip()


def leftovers(parent: Path, name: str) -> list[str]:
    """Partial directories and lock files of conversions to `parent/name`."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


# -- 1. concurrent first use and convert ---------------------------------------------------------
# Both processes import everything first, then meet at a barrier (a file each in a directory) so
# that they reach the conversion at the same moment.
RACE = """
    import os, sys, time, pathlib
    import edge0.cli, edge0.cli.convert, edge0.cli.generate, edge0.backend.quant
    barrier = pathlib.Path(sys.argv[1])
    (barrier / str(os.getpid())).touch()
    while len(list(barrier.iterdir())) < 2:
        time.sleep(0.002)
    edge0.cli.main(sys.argv[2:])
"""


def race(tmp_path, *argv, env=None):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [start(RACE, barrier, *argv, env=env) for _ in range(2)]
    return [finish(p) for p in procs]


@pytest.mark.slow  # in the default suite's time budget (runs under -m slow)
def test_first_use_of_the_bundled_model_by_two_processes_at_once(tmp_path):
    cache = tmp_path / "cache"
    results = race(
        tmp_path,
        "generate",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--no-chat-template",
        env={"EDGE0_CACHE": str(cache)},
    )
    for code, _, err in results:
        assert code == 0 and "Traceback" not in err, err
        assert "tok/s" in err
    (store,) = (cache / "stores").iterdir()
    assert (store / "edge0-manifest.json").is_file()
    assert leftovers(store.parent, store.name) == []


@pytest.mark.slow  # in the default suite's time budget (runs under -m slow)
def test_two_converts_to_the_same_output(tmp_path):
    out = tmp_path / "store"
    results = sorted(race(tmp_path, "convert", "--hf-path", fixture_dir("qwen3_moe"), "-o", out))
    (ok, _, _), (code, _, err) = results
    assert ok == 0
    # the loser either met the running conversion or, arriving after it, its store
    assert_one_line_error(code, err, f"-o {out}")
    assert "another conversion" in err or "already exists" in err
    assert (out / "edge0-manifest.json").is_file() and leftovers(tmp_path, "store") == []
    edge0.load(out)


def test_convert_while_another_holds_the_output(tmp_path):
    from edge0.store.outdir import output_lock

    out = tmp_path / "store"
    with output_lock(out, wait=False, quiet=True):
        with pytest.raises(Edge0Error, match=f"another conversion \\(pid {os.getpid()}\\) is writing it"):
            convert(str(fixture_dir("qwen3_moe")), out, quiet=True)
    assert not out.exists() and leftovers(tmp_path, "store") == []


# -- 2. partial directories of killed conversions ------------------------------------------------
# A conversion that stops after writing its first tensor, so that it can be killed mid-write.
STALLED = """
    import sys, time, pathlib
    import edge0.cli
    from edge0.store.writer import SafetensorsWriter
    write = SafetensorsWriter.write
    def stall(self, *a):
        write(self, *a)
        pathlib.Path(sys.argv[1]).touch()
        time.sleep(600)
    SafetensorsWriter.write = stall
    edge0.cli.main(sys.argv[2:])
"""


def stalled_convert(tmp_path, out):
    mid = tmp_path / "mid"
    p = start(STALLED, mid, "convert", "--hf-path", fixture_dir("qwen3_moe"), "-o", out)
    deadline = time.time() + 120
    while not mid.exists():
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline
        time.sleep(0.01)
    partial = out.parent / f".{out.name}.partial-{p.pid}"
    assert (partial / "model.safetensors").is_file()
    return p, partial


def test_rerun_removes_the_partial_directory_of_a_killed_convert(tmp_path, capsys):
    out = tmp_path / "store"
    p, partial = stalled_convert(tmp_path, out)
    p.kill()
    p.wait()
    assert partial.is_dir()
    live = out.parent / f".{out.name}.partial-1"  # pid 1 is always running: not ours to remove
    live.mkdir()
    code, err = run_verb(capsys, "convert", "--hf-path", str(fixture_dir("qwen3_moe")), "-o", str(out))
    assert code == 0, err
    assert f"removing {partial}" in err
    assert not partial.exists() and live.is_dir()
    assert (out / "edge0-manifest.json").is_file()


def test_sigterm_during_convert_leaves_nothing(tmp_path):
    out = tmp_path / "store"
    p, partial = stalled_convert(tmp_path, out)
    p.terminate()
    code, _, err = finish(p)
    assert code == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert not out.exists() and leftovers(tmp_path, "store") == []


# -- 3. flag values ------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["generate", "chat"])
@pytest.mark.parametrize(
    "flags, needle",
    [
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
    ],
)
def test_sampling_flags_out_of_range(capsys, store_for, verb, flags, needle):
    args = [verb, "--model", str(store_for("qwen3_moe")), *flags] + (["--prompt", "hi"] if verb == "generate" else [])
    assert_one_line_error(*run_verb(capsys, *args), needle)


@pytest.mark.parametrize("verb", ["generate", "serve"])
@pytest.mark.parametrize("k", ["0", "-1", "3", "999"])
def test_top_k_out_of_range(capsys, store_for, verb, k):
    args = [verb, "--model", str(store_for("qwen3_moe")), "--top-k", k] + (
        ["--prompt", "hi"] if verb == "generate" else []
    )
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


@pytest.mark.parametrize(
    "content, needles",
    [
        pytest.param(
            json.dumps(dense_config()),
            ["model_type 'llama'", "no MoE block", "spec'd families: ", "qwen3_moe", "universal level"],
            id="dense",
        ),
        pytest.param(
            json.dumps({**fixture_config("qwen3_moe"), "mlp_only_layers": [1]}),
            ["routed experts in 1 layers", "2 MoE layers"],
            id="other-moe-layers",
        ),
        pytest.param(
            json.dumps(fixture_config("mixtral")),
            ["model_type 'mixtral'", "holds a 'qwen3_moe' model"],
            id="other-family",
        ),
        pytest.param("{not json", ["not a JSON file"], id="not-json"),
        pytest.param(bytes(range(256)) * 4, ["not a JSON file", "UnicodeDecodeError"], id="random-bytes"),
        pytest.param("[1, 2]", ["a JSON list, not an object"], id="list"),
        pytest.param("{}", ["no model_type"], id="no-model-type"),
        pytest.param(
            json.dumps({"model_type": "no_such_family"}), ["'no_such_family' is not supported"], id="unknown-family"
        ),
        pytest.param(
            json.dumps({"model_type": "qwen3_moe"}), ["cannot build a 'qwen3_moe' model"], id="fields-missing"
        ),
        pytest.param(
            json.dumps({**fixture_config("qwen3_moe"), "hidden_size": "wide"}),
            ["hidden_size is 'wide', not an integer >= 1"],
            id="wrong-type",
        ),
        pytest.param(None, ["config.json: missing"], id="missing"),
    ],
)
def test_bad_config_in_a_store(capsys, store_copy, content, needles):
    config = store_copy / "config.json"
    if content is None:
        config.unlink()
    else:
        config.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = run_verb(capsys, "generate", "--model", str(store_copy), "--prompt", "hi")
    assert_one_line_error(code, err, str(config), *needles)


@pytest.mark.parametrize(
    "name, content, needles",
    [
        pytest.param("config.json", bytes(range(256)) * 4, ["config.json: not a JSON file"], id="random-bytes"),
        pytest.param(
            "config.json", json.dumps(dense_config()), ["model_type 'llama'", "no MoE block", "qwen3_moe"], id="dense"
        ),
        pytest.param(
            "generation_config.json", b"\xff\xfe", ["generation_config.json: not a JSON file"], id="gen-bytes"
        ),
        pytest.param("generation_config.json", "[]", ["generation_config.json: a JSON list"], id="gen-list"),
    ],
)
def test_bad_config_in_a_convert_source(capsys, tmp_path, name, content, needles):
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("qwen3_moe"), src)
    (src / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = run_verb(capsys, "convert", "--hf-path", str(src), "-o", str(tmp_path / "out"))
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "out").exists()


# -- hostile pass over the verbs -----------------------------------------------------------------
def assert_last_line_error(code, err, *needles):
    """An error found after the model loaded: its describe line, then the one-line error."""
    assert code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("edge0: error: ") and all(n in err.splitlines()[-1] for n in needles), err


@pytest.fixture
def files(tmp_path):
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)) * 8)
    (tmp_path / "text.txt").write_text("Lists are mutable sequences. " * 20)
    (tmp_path / "empty").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    "argv, needles",
    [
        pytest.param(
            ["generate", "--prompt", "hi", "--substitute-alpha", "nan"],
            ["--substitute-alpha nan", "finite"],
            id="alpha-nan",
        ),
        pytest.param(
            ["generate", "--prompt", "hi", "--substitute-alpha", "inf"], ["--substitute-alpha inf"], id="alpha-inf"
        ),
        pytest.param(["generate", "--prompt", "\udcff"], ["--prompt: not UTF-8 text"], id="prompt-not-utf8"),
        pytest.param(["eval", "--data", "{f}/binary.txt"], ["binary.txt: not UTF-8 text"], id="eval-data-binary"),
        pytest.param(
            ["eval", "--data", "{f}/text.txt", "--window", "1"], ["--window 1: must be >= 2"], id="eval-window"
        ),
        pytest.param(
            ["eval", "--data", "{f}/text.txt", "--max-windows", "0"], ["--max-windows 0"], id="eval-max-windows"
        ),
        pytest.param(
            ["eval", "--data", "{f}/text.txt", "--reference", "{f}/nowhere"],
            ["--reference", "no such directory"],
            id="eval-reference-missing",
        ),
        pytest.param(
            ["eval", "--data", "{f}/text.txt", "--reference", "{f}/empty"],
            ["empty/config.json: missing"],
            id="eval-reference-empty",
        ),
        pytest.param(
            ["train-prerouter", "--data", "{f}/text.txt", "--out", "{f}/h", "--window", "0"],
            ["--window >= 2"],
            id="prerouter-window",
        ),
        pytest.param(
            ["train-prerouter", "--data", "{f}/text.txt", "--out", "{f}/h", "--listwise", "nan"],
            ["--listwise nan"],
            id="prerouter-listwise",
        ),
        pytest.param(
            ["train-prerouter", "--data", "{f}/binary.txt", "--out", "{f}/h"],
            ["binary.txt: not UTF-8 text"],
            id="prerouter-data-binary",
        ),
    ],
)
def test_hostile_inputs_are_one_line(capsys, store_for, files, argv, needles):
    argv = [a.format(f=files) for a in argv]
    code, err = run_verb(capsys, argv[0], "--model", str(store_for("qwen3_moe")), *argv[1:])
    assert_one_line_error(code, err, *needles)


def test_empty_or_undecodable_prompt(capsys, store_for, monkeypatch):
    store = str(store_for("qwen3_moe"))
    code, err = run_verb(capsys, "generate", "--model", store, "--prompt", "", "--no-chat-template")
    assert_last_line_error(code, err, "--prompt '': no tokens")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe"), errors="surrogateescape"))
    code, err = run_verb(capsys, "generate", "--model", store, "--prompt", "-")
    assert_one_line_error(code, err, "--prompt -: standard input: not UTF-8 text")


def test_chat_skips_a_line_that_is_not_utf8(capsys, store_for, monkeypatch):
    lines = b"\xff\xfe hello\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines), errors="surrogateescape"))
    code, err = run_verb(capsys, "chat", "--model", str(store_for("qwen3_moe")), "--max-tokens", "2")
    assert code == 0 and "[not UTF-8 text; line skipped]" in err


def test_convert_of_a_store(capsys, store_for, tmp_path):
    code, err = run_verb(capsys, "convert", "--hf-path", str(store_for("qwen3_moe")), "-o", str(tmp_path / "out"))
    assert_one_line_error(code, err, "already an edge0 store", "--model")


def test_simulate_substitute_alpha_nan(capsys, tmp_path):
    from edge0.cache import tracefile
    from tests.test_trace import synthetic_trace

    trace = tracefile.write(tmp_path / "t.npz", synthetic_trace(layers=1, steps=20, experts=8, k=2))
    code, err = run_verb(capsys, "simulate", "--trace", str(trace), "--substitute-alpha", "nan")
    assert_one_line_error(code, err, "--substitute-alpha nan")


def test_empty_string_prompt_is_an_edge0_error(store_for):
    import edge0

    e = edge0.load(store_for("qwen3_moe"), prerouter=False, lora=False)
    with pytest.raises(Edge0Error, match="prompt is empty"):
        e.generate("", max_tokens=2)
