"""Experts striped over several directories (store/stripes.py): every expert's row cut into one
part per directory, read from all of them at once, the same bytes and tokens as one directory."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import edge0
from edge0.errors import Edge0Error
from edge0.store import ExpertStore, open_manifest
from edge0.store.convert import convert
from edge0.store.format import manifest_hash, verify_store
from edge0.store.readers import STRATEGIES
from edge0.store.relayout import relayout_store
from edge0.store.stripes import layer_parts, row_parts
from edge0.store.writer import write_expert_layer, write_expert_parts

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "edge0", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture(scope="module")
def plain(store_for):
    return store_for("qwen3_moe")


@pytest.fixture(scope="module")
def striped(plain, tmp_path_factory):
    """The fixture store cut over two more directories (three parts: the fixture's 2-page rows
    leave the third part empty, which must read as nothing)."""
    base = tmp_path_factory.mktemp("striped")
    return relayout_store(plain, base / "store", stripes=[base / "disk1" / "parts", base / "disk2" / "parts"])


def test_row_parts_are_whole_pages_as_even_as_they_go():
    assert row_parts(5 * 4096, 2) == [(0, 3 * 4096), (3 * 4096, 2 * 4096)]
    assert row_parts(4 * 4096, 2) == [(0, 2 * 4096), (2 * 4096, 2 * 4096)]
    assert row_parts(2 * 4096, 3) == [(0, 4096), (4096, 4096), (8192, 0)]


def test_a_striped_store_keeps_its_identity_and_places_parts_in_each_directory(plain, striped):
    m = open_manifest(striped, verify=True)
    assert manifest_hash(striped) == manifest_hash(plain)  # heads and adapters made for it fit
    assert verify_store(striped)[1] == []
    dirs = [Path(striped), *map(Path, m["stripes"]["dirs"])]
    assert [d.parent.name for d in dirs[1:]] == ["disk1", "disk2"]
    for entry in m["expert_layers"]:
        parts = layer_parts(entry)
        assert [p["dir"] for p in parts] == [0, 1, 2]
        assert [p["row_bytes"] for p in parts] == [4096, 4096, 0]
        for p in parts:
            f = dirs[p["dir"]] / p["file"]
            assert f.stat().st_size == p["offset"] + entry["num_experts"] * p["row_bytes"]
    assert not list(Path(striped, "experts").glob("*part-1*"))  # only part 0 in the store itself


@pytest.mark.parametrize("io", STRATEGIES)
def test_every_strategy_reads_the_same_bytes_from_the_parts(plain, striped, io):
    a = ExpertStore(plain, open_manifest(plain), io="pread")
    b = ExpertStore(striped, open_manifest(striped), io=io, queue_depth=2)
    for layer, info in a.layers.items():
        last = info["num_experts"] - 1
        for ids in ([0], [last], [last, 0, 3], [2, 3, 4, 1], list(range(last + 1)), []):
            got, want = b.read(layer, ids), a.read(layer, ids)
            assert got.keys() == want.keys()
            for k in want:
                np.testing.assert_array_equal(got[k][0], want[k][0], err_msg=f"{layer} {ids} {k}")
        whole, want = b.read_layer(layer), a.read_layer(layer)
        for k in want:
            np.testing.assert_array_equal(whole[k][0], want[k][0])
    s = b.io_stats()
    # both non-empty parts were read, each from its own directory's reader
    assert [d["reads"] > 0 for d in s["dirs"]] == [True, True, False]
    assert s["reads"] == sum(d["reads"] for d in s["dirs"]) and s["direct_fallbacks"] == 0
    assert s["bytes_read"] == a.io_stats()["bytes_read"]
    assert "striped over 3 directories" in b.describe_io()
    a.close()
    b.close()


@pytest.mark.parametrize("parts", [2, 3])
def test_odd_rows_cut_in_parts_read_back_whole(tmp_path, parts):
    """Tensors of odd sizes (row padding, a tensor across a part boundary) in 3-page rows."""
    rng = np.random.default_rng(1)
    module, num = "m.experts", 5
    arrays = {
        f"{module}.a": rng.integers(0, 255, (num, 5000), dtype=np.uint8),
        f"{module}.b": rng.standard_normal((num, 7, 3)).astype(np.float16),
        f"{module}.c": rng.integers(0, 255, (num, 4097), dtype=np.uint8),
    }
    dt = {np.uint8: "U8", np.float16: "F16"}
    tensors = [(k, dt[a.dtype.type], a.shape) for k, a in arrays.items()]
    one, fields = write_expert_layer(tmp_path / "one.safetensors", module, tensors, lambda k: arrays[k].tobytes())
    paths = [tmp_path / f"p{k}.safetensors" for k in range(parts)]
    infos, cut = write_expert_parts(paths, module, tensors, lambda k: arrays[k].tobytes())
    assert fields["expert_stride"] == cut["expert_stride"] == 3 * 4096
    assert cut["expert_crc32"] == fields["expert_crc32"] and cut["tensor_major"] == fields["tensor_major"]
    rows = np.fromfile(tmp_path / "one.safetensors", dtype=np.uint8)[fields["offset"] :].reshape(num, -1)
    for p, path in zip(cut["parts"], paths):  # each part holds its bytes of every row
        got = np.fromfile(path, dtype=np.uint8)[p["offset"] :].reshape(num, -1)
        np.testing.assert_array_equal(got, rows[:, p["row_start"] : p["row_start"] + p["row_bytes"]])
    assert [i["size"] for i in infos] == [path.stat().st_size for path in paths]


def test_engine_tokens_equal_the_unstriped_stores_with_each_executor(plain, striped):
    prompt = "The quick brown fox"
    for executor in ("exact", "staged"):
        want = edge0.load(plain, decode_executor=executor, expert_cache="64KB").generate(
            prompt, max_tokens=8, ignore_eos=True
        )
        got = edge0.load(striped, decode_executor=executor, expert_cache="64KB").generate(
            prompt, max_tokens=8, ignore_eos=True
        )
        assert got.tokens == want.tokens, executor
        assert got.stats["expert_bytes_read"] == want.stats["expert_bytes_read"] > 0


def test_paced_reads_pace_each_directory_as_its_own_disk(striped):
    rate = 50_000_000
    store = ExpertStore(striped, open_manifest(striped), io="pread", pace_reads=rate)
    store.read_layer(0)
    s = store.io_stats()
    assert s["paced"]["rate_bytes_per_s"] == 3 * rate  # the store reads from three disks at once
    assert [d["paced"]["rate_bytes_per_s"] for d in s["dirs"]] == [rate] * 3
    assert [d["paced"]["reads"] > 0 for d in s["dirs"]] == [True, True, False]
    assert "paced as a 50 MB/s disk each" in store.describe_io()
    store.close()


def test_relayout_joins_the_parts_back_into_the_same_files(plain, striped, tmp_path):
    back = relayout_store(striped, tmp_path / "joined")
    m, want = open_manifest(back, verify=True), open_manifest(plain)
    assert "stripes" not in m and manifest_hash(back) == manifest_hash(plain)
    for entry, ref in zip(m["expert_layers"], want["expert_layers"]):
        assert "parts" not in entry
        assert m["files"][entry["file"]]["sha256"] == want["files"][ref["file"]]["sha256"]


def test_convert_with_stripes_and_its_errors(plain, tmp_path):
    from tests.fixtures.make import fixture_dir

    src = fixture_dir("qwen3_moe")
    r = run_cli("convert", "--hf-path", src, "-o", tmp_path / "s", "--stripe", tmp_path / "d1")
    assert r.returncode == 0, r.stderr
    assert manifest_hash(tmp_path / "s") == manifest_hash(plain)
    assert json.loads((tmp_path / "d1" / "edge0-stripe-1.json").read_text())["id"]
    assert verify_store(tmp_path / "s")[1] == []
    # a stripe directory that exists already: one line, exit 2, nothing written
    (tmp_path / "taken").mkdir()
    r = run_cli("convert", "--hf-path", src, "-o", tmp_path / "t", "--stripe", tmp_path / "taken")
    assert r.returncode == 2 and "already exists" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists() and list((tmp_path / "taken").iterdir()) == []
    r = run_cli("relayout", tmp_path / "s", tmp_path / "u", "--stripe", tmp_path / "d2", "--stripe", tmp_path / "d2")
    assert r.returncode == 2 and "twice" in r.stderr and not (tmp_path / "u").exists()
    r = run_cli("relayout", tmp_path / "s", tmp_path / "u", "--stripe", tmp_path / "u" / "parts")
    assert r.returncode == 2 and "inside it" in r.stderr and not (tmp_path / "u").exists()


def test_an_interrupted_conversion_leaves_no_stripe_directory(tmp_path, monkeypatch):
    from edge0.store import writer
    from tests.fixtures.make import fixture_dir

    calls = []

    def boom(*a, **kw):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **kw)

    real = writer.write_expert_parts
    monkeypatch.setattr(writer, "write_expert_parts", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(str(fixture_dir("qwen3_moe")), tmp_path / "s", quiet=True, stripes=[tmp_path / "d1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no store, no stripe directory, no partials


def test_a_missing_or_wrong_stripe_directory_is_one_line_at_load(striped, tmp_path):
    store = tmp_path / "store"
    m = json.loads((Path(striped) / "edge0-manifest.json").read_text())
    moved = [tmp_path / f"d{k}" for k in (1, 2)]
    shutil.copytree(striped, store)
    for src, dst in zip(m["stripes"]["dirs"], moved):
        shutil.copytree(src, dst)
    # the copy still names the original directories: it loads from them
    assert open_manifest(store)["stripes"]["dirs"] == m["stripes"]["dirs"]
    m2 = json.loads((store / "edge0-manifest.json").read_text())
    m2["stripes"]["dirs"] = [str(moved[0]), str(tmp_path / "gone")]
    from edge0.store.format import seal

    (store / "edge0-manifest.json").write_text(
        json.dumps(seal({k: v for k, v in m2.items() if k != "manifest_sha256"}))
    )
    r = run_cli("generate", "--model", store, "--prompt", "hi", "--max-tokens", "2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{tmp_path / 'gone'}: missing" in r.stderr and "part 3 of 3" in r.stderr
    # a directory that is another store's (or no store's) stripe
    m2["stripes"]["dirs"] = [str(moved[1]), str(moved[0])]
    (store / "edge0-manifest.json").write_text(
        json.dumps(seal({k: v for k, v in m2.items() if k != "manifest_sha256"}))
    )
    with pytest.raises(Edge0Error, match="edge0-stripe-1.json: missing or not this store's"):
        open_manifest(store)
    # a damaged part on another disk: edge0 verify names it
    m2["stripes"]["dirs"] = [str(moved[0]), str(moved[1])]
    (store / "edge0-manifest.json").write_text(
        json.dumps(seal({k: v for k, v in m2.items() if k != "manifest_sha256"}))
    )
    part = moved[0] / "experts" / "layer-001.part-1.safetensors"
    with open(part, "r+b") as fh:
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 1]))
    r = run_cli("verify", store)
    assert r.returncode != 0 and str(part) in r.stdout + r.stderr


def test_a_manifest_cannot_place_other_files_on_a_stripe_directory(striped, tmp_path):
    from edge0.store.format import seal

    store = tmp_path / "store"
    shutil.copytree(striped, store)
    m = json.loads((store / "edge0-manifest.json").read_text())
    m["files"]["config.json"]["dir"] = 1
    (store / "edge0-manifest.json").write_text(json.dumps(seal({k: v for k, v in m.items() if k != "manifest_sha256"})))
    with pytest.raises(Edge0Error, match="holds only expert parts"):
        open_manifest(store)


def test_the_bench_limits_and_measures_every_directory_of_a_striped_store(striped):
    from edge0.bench.cgroup import block_device, stripe_dirs
    from edge0.bench.roofline import measure_read_rate

    m = open_manifest(striped)
    assert stripe_dirs(striped) == [Path(striped), *map(Path, m["stripes"]["dirs"])]
    # here all three are on one disk: one limit line, so the store's rate is not counted thrice
    assert len({block_device(d) for d in stripe_dirs(striped)}) == 1
    r = measure_read_rate(striped, queue_depth=2, seconds=1.0, warm=True)
    assert r["bytes"] == sum(p["row_bytes"] * e["num_experts"] for e in m["expert_layers"] for p in layer_parts(e))
    assert r["read_size"] == 4096 and r["queue_depth"] == 2 * 3


def test_a_stripe_directory_made_by_someone_else_meanwhile_fails_the_run_and_keeps_theirs(tmp_path, monkeypatch):
    """The second stripe directory appears while converting: the run fails in one line, removes
    the first one it had renamed, and leaves the other's directory and file alone."""
    from edge0.store import stripes
    from tests.fixtures.make import fixture_dir

    real = stripes.StripeDirs.commit

    def commit(self):
        self.final[1].mkdir()
        (self.final[1] / "theirs.txt").write_text("keep")
        real(self)

    monkeypatch.setattr(stripes.StripeDirs, "commit", commit)
    with pytest.raises(Edge0Error, match="created by another process"):
        convert(str(fixture_dir("qwen3_moe")), tmp_path / "s", quiet=True, stripes=[tmp_path / "d1", tmp_path / "d2"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d2"]
    assert (tmp_path / "d2" / "theirs.txt").read_text() == "keep"
