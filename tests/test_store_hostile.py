"""Issue 35, the store items: manifests whose paths leave the store, manifests and configs of the
wrong shape, stores `edge0 verify` passed although they cannot load, the prompt cache's bound after
a crash, and a full disk under `edge0 convert`. Each is one line and exit code 2, found before
the model is built."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

import pytest

import edge0
from edge0.store import promptcache
from edge0.store.format import MANIFEST, seal
from edge0.store.promptcache import DiskPromptCaches
from tests.test_errors import assert_one_line_error
from tests.test_hardening import assert_last_line_error, run_verb


@pytest.fixture
def store(store_for, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(store_for("qwen3_moe"), dst)
    return dst


def rewrite(store: Path, change, reseal: bool = True) -> None:
    """Apply `change(manifest)` (which may return a replacement) and, with `reseal`, checksum it
    again: what a damaged or hostile manifest that passes the checksum looks like."""
    m = json.loads((store / MANIFEST).read_text())
    m.pop("manifest_sha256")
    m = change(m) or m
    (store / MANIFEST).write_text(json.dumps(seal(m) if reseal and isinstance(m, dict) else m))


def layer0(m: dict) -> dict:
    return m["expert_layers"][0]


def generate_and_verify(capsys, store: Path, *needles) -> None:
    """Both `edge0 generate` and `edge0 verify` refuse the store in one line with `needles`."""
    for argv in (["generate", "--model", str(store), "--prompt", "hi"], ["verify", str(store)]):
        code, err = run_verb(capsys, *argv)
        assert_one_line_error(code, err, *needles)


@pytest.mark.parametrize(
    "change, needles",
    [
        pytest.param(
            lambda m: layer0(m).update(file="../../outside/layer.safetensors"),
            ["expert_layers[0].file", "outside the store"],
            id="dotdot",
        ),
        pytest.param(
            lambda m: layer0(m).update(file="/etc/passwd"), ["expert_layers[0].file", "'/etc/passwd'"], id="absolute"
        ),
        pytest.param(
            lambda m: m["files"].update({"/etc/shadow": {"size": 1, "sha256": "0"}}),
            ["a key of files", "outside"],
            id="files-absolute",
        ),
        pytest.param(
            lambda m: m["files"].update({"../x": {"size": 1, "sha256": "0"}}),
            ["a key of files", "'../x'"],
            id="files-dotdot",
        ),
    ],
)
def test_manifest_paths_stay_inside_the_store(capsys, store, change, needles):
    rewrite(store, change)
    generate_and_verify(capsys, store, str(store / MANIFEST), *needles, "edge0 convert")


def test_a_symlink_that_leaves_the_store_is_refused(capsys, store, tmp_path):
    layer = store / "experts" / "layer-000.safetensors"
    outside = tmp_path / "outside.safetensors"
    shutil.move(layer, outside)
    layer.symlink_to(outside)
    generate_and_verify(capsys, store, "a symlink that leads outside the store", "experts/layer-000.safetensors")


@pytest.mark.parametrize(
    "change, reseal, needles",
    [
        pytest.param(lambda m: [1, 2], False, ["a JSON list, not an object"], id="array"),
        pytest.param(lambda m: m.pop("files") and None, True, ["files is missing or not an object"], id="no-files"),
        pytest.param(lambda m: m.pop("expert_layers") and None, True, ["expert_layers is missing"], id="no-layers"),
        pytest.param(lambda m: m.update(expert_layers=[]), True, ["expert_layers is empty"], id="empty-layers"),
        pytest.param(
            lambda m: layer0(m).update(num_experts="8"), True, ["expert_layers[0].num_experts is '8'"], id="type"
        ),
        pytest.param(
            lambda m: layer0(m).pop("tensors") and None, True, ["expert_layers[0].tensors is missing"], id="no-tensors"
        ),
        pytest.param(
            lambda m: layer0(m)["tensors"]["down_proj.weight"].update(expert_nbytes=-5),
            True,
            ["down_proj.weight'].expert_nbytes is -5", "one expert of that shape is 2048"],
            id="negative-size",
        ),
        pytest.param(
            lambda m: layer0(m)["tensors"]["down_proj.weight"].update(shape=[8, -64, 8]),
            True,
            ["down_proj.weight'].shape is [8, -64, 8]"],
            id="negative-shape",
        ),
        pytest.param(
            lambda m: layer0(m).update(num_experts=10**9),
            True,
            ["num_experts is 1000000000", "spec.num_experts is 8"],
            id="absurd-experts",
        ),
        pytest.param(lambda m: None, False, ["a version 2 manifest without its checksum"], id="v2-checksum-removed"),
    ],
)
def test_a_manifest_of_the_wrong_shape_is_one_line(capsys, store, change, reseal, needles):
    rewrite(store, change, reseal)
    generate_and_verify(capsys, store, str(store / MANIFEST), *needles)


def test_binary_manifest_is_one_line(capsys, store):
    (store / MANIFEST).write_bytes(bytes(range(256)) * 4)
    generate_and_verify(capsys, store, "is not valid JSON", "UnicodeDecodeError")


def test_verify_checks_the_layout_too(capsys, store):
    """A store whose layer entries and spec agree with each other but not with the files: verify
    passed it (every file's hash matches) although it could not load."""

    def more_experts(m):
        m["spec"]["num_experts"] = 9
        for entry in m["expert_layers"]:
            entry["num_experts"] = 9
            entry.pop("expert_crc32")
            for t in entry["tensors"].values():
                t["shape"][0] = 9

    rewrite(store, more_experts)
    code, err = run_verb(capsys, "verify", str(store))
    lines = err.splitlines()
    assert code == 2 and "Traceback" not in err and len(lines) == 3, err  # two layers, then the summary
    assert all("layout in the manifest does not match the file" in line for line in lines[:2])
    code, err = run_verb(capsys, "generate", "--model", str(store), "--prompt", "hi")
    assert_one_line_error(code, err, "experts/layer-000.safetensors: layout in the manifest does not match")


def edit_config(store: Path, **changes) -> Path:
    path = store / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "changes, needles",
    [
        pytest.param(
            {"num_hidden_layers": 10**6}, ["num_hidden_layers is 1000000", "weights hold 2 layers"], id="1e6-layers"
        ),
        pytest.param({"num_attention_heads": 0}, ["num_attention_heads is 0, not an integer >= 1"], id="zero-heads"),
        pytest.param({"hidden_size": 128}, ["hidden_size is 128", "embedding", "has 64"], id="hidden"),
        pytest.param({"vocab_size": 10**12}, ["vocab_size is 1000000000000", "has 314"], id="vocab"),
        pytest.param({"num_experts": 16}, ["num_experts is 16", "hold 8 experts"], id="experts"),
        pytest.param({"rope_theta": float("inf")}, ["rope_theta is inf, not a finite number"], id="infinite"),
        pytest.param({"head_dim": 10**9}, ["does not fit the store's weights", "q_proj.weight"], id="shape-mismatch"),
        pytest.param({"model_type": "mixtral"}, ["model_type 'mixtral'", "holds a 'qwen3_moe' model"], id="family"),
    ],
)
def test_a_config_the_store_does_not_fit_is_one_line_before_the_model_is_built(capsys, store, changes, needles):
    path = edit_config(store, **changes)
    started = time.monotonic()
    code, err = run_verb(capsys, "generate", "--model", str(store), "--prompt", "hi")
    assert_one_line_error(code, err, str(path), *needles)
    assert time.monotonic() - started < 20  # 10^6 layers were built for 75 s, then ran out of memory


def test_a_missing_tokenizer_is_one_line(capsys, store):
    (store / "tokenizer.json").unlink()
    code, err = run_verb(capsys, "generate", "--model", str(store), "--prompt", "hi")
    assert_one_line_error(code, err, f"{store}: its tokenizer does not load", "tokenizer.json", "edge0 verify")


# -- the prompt cache's bound after a crash ------------------------------------------------------
PROMPT = [(7 * i) % 200 + 10 for i in range(120)]


def cache_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.safetensors"))


def test_a_cache_file_the_index_lacks_is_indexed_and_the_bound_holds(store_for, tmp_path):
    """A process killed between renaming a cache file into place and writing the index left the
    file unindexed and never evicted (9.45 MB held against a 5 MB bound)."""
    engine = edge0.load(store_for("qwen3_moe"), prompt_cache_dir=tmp_path)
    engine.generate(PROMPT, max_tokens=4, reuse_cache=True, ignore_eos=True)
    (saved,) = cache_files(tmp_path)
    orphan = saved.with_name("0" * 32 + ".safetensors")  # as if written by a process killed before its index
    shutil.copy(saved, orphan)
    os.utime(saved, (time.time() - 60,) * 2)
    (tmp_path / ".index.json.99999.tmp").write_text("{")  # an index write that died
    index = json.loads((tmp_path / "index.json").read_text())["entries"]
    index[next(iter(index))]["used"] = time.time() - 60
    (tmp_path / "index.json").write_text(json.dumps({"version": 1, "entries": index}))

    bound = saved.stat().st_size + 1000  # room for one of the two
    cache = DiskPromptCaches(tmp_path, engine.identity(), bound)
    assert cache_files(tmp_path) == [orphan]  # indexed, then the least recently used one evicted
    st = cache.stats()
    assert (st["entries"], st["evicted"]) == (1, 1) and st["bytes"] <= bound and "indexed" in st["note"]
    assert not list(tmp_path.glob(".index.json.*"))


def test_a_failed_index_write_leaves_no_file_and_no_temporary(store_for, tmp_path, monkeypatch):
    engine = edge0.load(store_for("qwen3_moe"), prompt_cache_dir=tmp_path)
    real = os.replace

    def full_disk(src, dst):
        if str(dst).endswith("index.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(promptcache.os, "replace", full_disk)
    engine.generate(PROMPT, max_tokens=4, reuse_cache=True, ignore_eos=True)
    st = engine.stats()["prompt_cache"]
    assert st["failed"] == 1 and "No space left" in st["note"]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [".lock", "index.json"]  # no temporary


def test_an_index_naming_a_file_outside_the_cache_is_rebuilt(store_for, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    root = tmp_path / "cache"
    engine = edge0.load(store_for("qwen3_moe"), prompt_cache_dir=root)
    entry = {"identity": engine.identity(), "tokens": [1, 2], "bytes": 10**9, "used": 0}
    (root / "index.json").write_text(json.dumps({"version": 1, "entries": {"../victim.txt": entry}}))
    cache = DiskPromptCaches(root, engine.identity(), 1000)
    assert victim.read_text() == "keep me" and cache.stats()["index_rebuilt"] == 1 and cache.stats()["entries"] == 0


# -- a full disk under edge0 convert -------------------------------------------------------------
def test_a_full_disk_during_convert_is_one_line_and_leaves_nothing(capsys, tmp_path, monkeypatch):
    from edge0.store import convert
    from tests.fixtures.make import fixture_dir

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert, "seal", full)  # the manifest's write, the last of the conversion
    code, err = run_verb(capsys, "convert", "--hf-path", str(fixture_dir("qwen3_moe")), "-o", str(tmp_path / "out"))
    assert_last_line_error(code, err, f"-o {tmp_path / 'out'}: no space left on", "free some space")  # after the bar
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no partial directory, no lock


def test_no_space_for_the_lock_leaves_no_lock(capsys, tmp_path, monkeypatch):
    from edge0.store import outdir
    from tests.fixtures.make import fixture_dir

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outdir.os, "write", full)
    code, err = run_verb(capsys, "convert", "--hf-path", str(fixture_dir("qwen3_moe")), "-o", str(tmp_path / "out"))
    assert_one_line_error(code, err, "no space left on")
    assert list(tmp_path.iterdir()) == []  # the lock file it created is gone (it stayed: .out.lock)


@pytest.mark.slow
def test_a_real_full_file_system(tmp_path):
    """On a 200 KB tmpfs (root only): the store does not fit, then not even the lock. Slow: two
    conversions in their own processes (the tests above inject the same errors in-process)."""
    import subprocess
    import sys

    from tests.fixtures.make import fixture_dir

    full = tmp_path / "full"
    full.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(full)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        src = fixture_dir("qwen3_moe")
        for fill in (False, True):
            if fill:
                fd = os.open(full / "fill", os.O_WRONLY | os.O_CREAT)
                with pytest.raises(OSError):  # until the file system is full
                    while True:
                        os.write(fd, b"\0" * 4096)
                os.close(fd)
            p = subprocess.run(
                [sys.executable, "-m", "edge0", "convert", "--hf-path", str(src), "-o", str(full / "out")],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
            assert p.stderr.strip().splitlines()[-1].startswith("edge0: error: -o ") and "no space left" in p.stderr
            assert [f.name for f in full.iterdir()] == (["fill"] if fill else [])
    finally:
        subprocess.run(["umount", str(full)])
