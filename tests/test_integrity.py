"""Integrity: every file of a store is hashed in its manifest, the manifest carries a checksum of
its own, `edge0 verify` reports every damaged file, and each expert is checked (crc32) the first
time a process reads it, so damage is an error, never garbage output."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import edge0
from edge0.cli import main as cli_main
from edge0.errors import Edge0Error
from edge0.store import ExpertStore, open_manifest
from edge0.store.format import seal
from tests.test_errors import run_cli


@pytest.fixture
def store(store_for, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(store_for("qwen3_moe"), dst)
    return dst


def expert_row(root, layer: int, expert: int) -> tuple:
    """(file, offset of the expert's gate_proj.scales bytes, their length) in an expert-major file."""
    e = open_manifest(root)["expert_layers"][layer]
    t = e["tensors"]["gate_proj.scales"]
    return root / e["file"], e["offset"] + expert * e["expert_stride"] + t["expert_offset"], t["expert_nbytes"]


def damage(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def test_damaged_expert_is_an_error_when_read_naming_layer_expert_and_verify(store):
    f, off, n = expert_row(store, 1, 5)
    damage(f, off, np.full(n // 4, np.nan, np.float32).tobytes()[:n])  # NaN scales
    s = ExpertStore(store, open_manifest(store))  # sizes are fine: the load does not notice
    s.read(1, [4, 6])  # its neighbours are intact
    with pytest.raises(Edge0Error, match=r"layer 1 expert 5 does not match its checksum.*edge0 verify"):
        s.read(1, [3, 5])
    with pytest.raises(Edge0Error, match="layer 1 expert 5"):
        s.read_layer(1)
    assert s.io_stats()["experts_checked"] >= 3
    unchecked = ExpertStore(store, open_manifest(store), check_experts=False)
    unchecked.read(1, [5])  # opting out reads what is there
    code, err = run_cli(
        "generate",
        "--model",
        str(store),
        "--prompt",
        "hello world once upon a time",
        "--max-tokens",
        "4",
        "--no-prerouter",
        "--no-lora",
    )
    assert code == 2 and "Traceback" not in err and err.splitlines()[-1].startswith("edge0: error: ")
    assert "expert 5 does not match its checksum" in err.splitlines()[-1]


def test_checked_engine_gives_the_same_tokens_and_counts_its_checks(store_for):
    store = store_for("qwen3_moe")
    on = edge0.load(store, prerouter=False, lora=False)
    off = edge0.load(store, prerouter=False, lora=False, check_experts=False)
    a = on.generate("hello world", max_tokens=8, ignore_eos=True)
    b = off.generate("hello world", max_tokens=8, ignore_eos=True)
    assert a.tokens == b.tokens
    assert on.stats()["io"]["experts_checked"] > 0 and off.stats()["io"]["experts_checked"] == 0
    assert "experts checked (crc32)" in on.describe() and "resident weights (crc32) at load" in on.describe()


def test_damaged_resident_weights_are_an_error_at_load(store, capsys):
    resident = store / "model.safetensors"
    damage(resident, resident.stat().st_size // 2, b"\xff" * 8)  # the size is right: only the hash sees it
    with pytest.raises(SystemExit) as e:  # `edge0 generate` in this process
        cli_main(["generate", "--model", str(store), "--prompt", "hello", "--max-tokens", "2"])
    code, err = e.value.code, capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert str(resident) in err and f"edge0 verify {store}" in err and "does not match its checksum (crc32" in err
    off = edge0.load(store, prerouter=False, lora=False, check_experts=False)  # the same switch turns it off
    assert "resident weights" not in off.describe()
    # a store converted before manifests carried resident_crc32: the file's sha256 is checked
    path = store / "edge0-manifest.json"
    m = json.loads(path.read_text())
    path.write_text(json.dumps(seal({k: v for k, v in m.items() if k not in ("resident_crc32", "manifest_sha256")})))
    with pytest.raises(Edge0Error, match=r"model.safetensors does not match its checksum \(sha256.*edge0 verify"):
        edge0.load(store, prerouter=False, lora=False)


def test_changed_manifest_offset_is_caught_at_load_and_by_verify(store):
    path = store / "edge0-manifest.json"
    m = json.loads(path.read_text())
    m["expert_layers"][0]["tensors"]["gate_proj.weight"]["expert_offset"] += 64
    path.write_text(json.dumps(m))
    with pytest.raises(Edge0Error, match="changed after conversion"):
        open_manifest(store)
    code, err = run_cli("verify", str(store))
    assert code == 2 and "changed after conversion" in err


def test_verify_reports_every_damaged_file_config_tokenizer_and_sidecars_included(store):
    f, off, _ = expert_row(store, 0, 2)
    damage(f, off, b"\xff\xff")
    damage(store / "model.safetensors", 100, b"\x00\x01")
    (store / "tokenizer.json").write_text((store / "tokenizer.json").read_text().replace('"', "'", 1))
    cfg = json.loads((store / "config.json").read_text())
    (store / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1.0}, indent=2))
    code, err = run_cli("verify", str(store))
    assert code == 2 and "Traceback" not in err
    for name in ("layer-000.safetensors", "model.safetensors", "tokenizer.json", "config.json"):
        assert name in err, name
    assert "4 problems" in err.splitlines()[-1]


def test_verify_ok_on_an_intact_store(store):
    code, err = run_cli("verify", str(store))
    assert code == 0, err
