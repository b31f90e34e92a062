"""Expert-major layer files (store format 2) and the read strategies: same bytes from every
strategy and layout, O_DIRECT fallback counted, concurrent reads, older stores still load."""

import errno
import json
import mmap
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

import edge0
from edge0.backend import core as B
from edge0.backend.memory import available as memory_available
from edge0.backend.memory import cgroup_available
from edge0.errors import Edge0Error
from edge0.store import VERSION, ExpertStore, open_manifest
from edge0.store.format import ALIGN, EXPERT_MAJOR, manifest_hash, seal
from edge0.store.readers import STRATEGIES, aligned_empty, choose_io
from edge0.store.relayout import relayout_store
from edge0.store.writer import SafetensorsWriter, write_expert_layer
from edge0.streaming.exact import to_device

ROOT = Path(__file__).resolve().parents[1]


def tensor_major_copy(src: Path, out: Path) -> Path:
    """A version 1 (tensor-major) copy of expert-major store `src`, written as the version 1
    converter did (read through safetensors, not through the store's reader)."""
    shutil.copytree(src, out)
    m = json.loads((src / "edge0-manifest.json").read_text())
    layers = []
    for entry in m["expert_layers"]:
        with safe_open(str(src / entry["file"]), framework="numpy") as f:
            rows = f.get_tensor(f"{entry['module']}.experts")
        names = [f"{entry['module']}.{n}" for n in entry["tensors"]]
        w = SafetensorsWriter(
            out / entry["file"],
            [(k, t["dtype"], tuple(t["shape"])) for k, t in zip(names, entry["tensors"].values())],
            {"format": "mlx"},
        )
        for k, t in zip(names, entry["tensors"].values()):
            w.write(
                k, np.ascontiguousarray(rows[:, t["expert_offset"] : t["expert_offset"] + t["expert_nbytes"]]).tobytes()
            )
        m["files"][entry["file"]] = w.close()
        layers.append(
            {k: entry[k] for k in ("layer", "module", "file", "num_experts")}
            | {
                "tensors": {
                    n: {
                        "dtype": t["dtype"],
                        "shape": t["shape"],
                        "offset": w.offsets[k],
                        "expert_nbytes": t["expert_nbytes"],
                    }
                    for (n, t), k in zip(entry["tensors"].items(), names)
                }
            }
        )
    m.pop("manifest_sha256", None)  # version 1 manifests carried no checksum of their own
    (out / "edge0-manifest.json").write_text(json.dumps({**m, "version": 1, "expert_layers": layers}))
    return out


@pytest.fixture(scope="module")
def stores(store_for, tmp_path_factory):
    """(a tensor-major store, the same store expert-major), whichever layout the converter writes."""
    conv = store_for("qwen3_moe")
    if open_manifest(conv)["expert_layers"][0].get("layout") == EXPERT_MAJOR:
        return tensor_major_copy(conv, tmp_path_factory.mktemp("v1") / "store"), conv
    return conv, relayout_store(conv, tmp_path_factory.mktemp("v2") / "store")


def reference(root, layer: int) -> dict[str, np.ndarray]:
    """Every expert's bytes per tensor, [E, expert_nbytes], straight from the tensor-major file."""
    info = {int(l["layer"]): l for l in open_manifest(root)["expert_layers"]}[layer]
    raw = np.fromfile(root / info["file"], dtype=np.uint8)
    num = info["num_experts"]
    return {
        name: raw[t["offset"] : t["offset"] + num * t["expert_nbytes"]].reshape(num, -1)
        for name, t in info["tensors"].items()
    }


def check(got: dict, ref: dict, ids) -> None:
    assert got.keys() == ref.keys()
    for name, (buf, _, _) in got.items():
        np.testing.assert_array_equal(buf, ref[name][list(ids)], err_msg=name)


def test_expert_major_file_is_aligned_safetensors_and_keeps_identity(stores):
    v1, v2 = stores
    m = open_manifest(v2, verify=True)
    assert m["version"] == VERSION == 2
    assert manifest_hash(v2) == manifest_hash(v1)  # heads and adapters made for v1 still fit
    for entry in m["expert_layers"]:
        assert entry["layout"] == EXPERT_MAJOR and entry["offset"] % ALIGN == 0 and entry["expert_stride"] % ALIGN == 0
        with safe_open(str(v2 / entry["file"]), framework="numpy") as f:
            rows = f.get_tensor(f"{entry['module']}.experts")
        assert rows.shape == (entry["num_experts"], entry["expert_stride"])
        for name, want in reference(v1, entry["layer"]).items():
            t = entry["tensors"][name]
            np.testing.assert_array_equal(rows[:, t["expert_offset"] : t["expert_offset"] + t["expert_nbytes"]], want)


@pytest.mark.parametrize("layout", ["v1", "v2"])
@pytest.mark.parametrize("io", STRATEGIES)
def test_every_strategy_reads_the_same_bytes(stores, layout, io):
    root = stores[0] if layout == "v1" else stores[1]
    ref_root = stores[0]
    for qd in (1, 4):
        store = ExpertStore(root, open_manifest(root), io=io, queue_depth=qd)
        for layer, info in store.layers.items():
            ref, last = reference(ref_root, layer), info["num_experts"] - 1
            for ids in ([0], [last], [last, 0, 3], [2, 3, 4, 1], list(range(last + 1)), []):
                got = store.read(layer, ids)
                check(got, ref, ids)
                assert all(b.shape == (len(ids), info["tensors"][n]["expert_nbytes"]) for n, (b, _, _) in got.items())
            check(store.read_layer(layer), ref, range(last + 1))
        s = store.io_stats()
        assert s["reader"] == io and s["reads"] > 0 and s["max_queue_depth"] <= max(qd, 1)
        # direct on tensor-major files: unaligned ranges, read with pread and counted
        assert s["direct_fallbacks"] == (len(store.layers) if (io, layout) == ("direct", "v1") else 0)
        store.close()


@pytest.mark.parametrize("layout", ["v1", "v2"])
@pytest.mark.parametrize("io", STRATEGIES)
def test_a_read_into_given_rows_fills_them_and_returns_the_rest(stores, layout, io):
    """`into` rows (scattered, as a slot set's are; page-aligned or not) get their tensors' bytes
    in place, checked against their crc32 like any read; the other tensors come back as usual."""
    root = stores[0] if layout == "v1" else stores[1]
    store = ExpertStore(root, open_manifest(root), io=io)
    layer, info = next(iter(store.layers.items()))
    ref, last = reference(stores[0], layer), info["num_experts"] - 1
    name = sorted(info["tensors"])[0]
    size = info["tensors"][name]["expert_nbytes"]
    ids = [last, 0, 1, 2]
    for skew in (0, 8):  # direct I/O fills aligned rows in place, others through its bounce buffer
        slots = aligned_empty(ALIGN + 6 * -(-size // ALIGN) * ALIGN)[skew:]
        rows = [slots[i * -(-size // ALIGN) * ALIGN :][:size] for i in (5, 0, 3, 1)]  # out of order
        got = store.read(layer, ids, {name: rows})
        assert name not in got
        check(got, {n: r for n, r in ref.items() if n != name}, ids)
        for row, e in zip(rows, ids):
            np.testing.assert_array_equal(row, ref[name][e])
    with pytest.raises(ValueError, match="contiguous uint8 rows"):
        store.read(layer, ids, {name: rows[:2]})
    store.close()


def test_a_whole_layer_buffer_is_its_own_mapping():
    a = aligned_empty(3 * ALIGN + 5, mapped=True)
    assert a.nbytes == 3 * ALIGN + 5 and a.ctypes.data % ALIGN == 0 and a.flags.writeable
    assert isinstance(a.base.obj, mmap.mmap)  # unmapped with the array, not kept in the C heap
    a[:] = 7
    assert int(a.sum()) == 7 * a.nbytes


@pytest.mark.parametrize("sizes", ["odd", "pages"])
def test_sizes_round_trip_through_both_layouts(tmp_path, sizes, monkeypatch):
    """ "odd": per-expert sizes that are not multiples of 64 or 4096, in every dtype width (rows
    with padding; direct reads go through its bounce buffer). "pages": every tensor a multiple of
    4 KiB (as on real models), so direct reads scatter straight into the output arrays."""
    from edge0.store.readers import DirectReader

    rng = np.random.default_rng(0)
    module, num = "m.experts", 5
    if sizes == "odd":
        arrays = {
            f"{module}.a.weight": rng.integers(0, 2**32, (num, 3, 7), dtype=np.uint32),
            f"{module}.a.scales": rng.standard_normal((num, 3, 1)).astype(np.float16),
            f"{module}.b": rng.integers(0, 255, (num, 4097), dtype=np.uint8),
            f"{module}.c": rng.standard_normal((num, 11)).astype(np.float32),
        }
    else:
        arrays = {
            f"{module}.a.weight": rng.integers(0, 2**32, (num, 8, 256), dtype=np.uint32),
            f"{module}.a.scales": rng.standard_normal((num, 2048)).astype(np.float16),
        }
        monkeypatch.setattr(DirectReader, "_bounce", lambda self, n: pytest.fail("aligned tensors were bounced"))
    dt = {np.uint32: "U32", np.float16: "F16", np.uint8: "U8", np.float32: "F32"}
    tensors = [(k, dt[a.dtype.type], a.shape) for k, a in arrays.items()]
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    w = SafetensorsWriter(tmp_path / "v1" / "l.safetensors", tensors, {"format": "mlx"})
    for k, a in arrays.items():
        w.write(k, a.tobytes())
    v1_info = w.close()
    calls = []

    def get_bytes(name):
        calls.append(name)
        return arrays[name].tobytes()

    info, fields = write_expert_layer(tmp_path / "v2" / "l.safetensors", module, tensors, get_bytes)
    assert calls == list(arrays)  # one stacked tensor at a time, in order
    assert fields["tensor_major"] == v1_info
    assert (
        fields["expert_stride"] == 2 * ALIGN if sizes == "odd" else 3 * ALIGN
    )  # odd: 84+6+4097+44 bytes, 64-aligned starts
    assert (
        info["size"]
        == (tmp_path / "v2" / "l.safetensors").stat().st_size
        == fields["offset"] + num * fields["expert_stride"]
    )
    assert [p.name for p in (tmp_path / "v2").iterdir()] == ["l.safetensors"]  # no partial file left
    v1_entry = {
        "layer": 0,
        "module": module,
        "file": "l.safetensors",
        "num_experts": num,
        "tensors": {
            k[len(module) + 1 :]: {
                "dtype": d,
                "shape": list(s),
                "offset": w.offsets[k],
                "expert_nbytes": arrays[k][0].nbytes,
            }
            for k, d, s in tensors
        },
    }
    v2_entry = {"layer": 0, "module": module, "file": "l.safetensors", **fields}
    for root, entry in ((tmp_path / "v1", v1_entry), (tmp_path / "v2", v2_entry)):
        for io in STRATEGIES:
            store = ExpertStore(root, {"expert_layers": [entry]}, io=io, queue_depth=3)
            for ids in ([4], [0, 1, 2], [3, 0], list(range(num))):
                for name, (buf, st_dtype, shape) in store.read(0, ids).items():
                    want = arrays[f"{module}.{name}"][ids]
                    got = buf.view(want.dtype).reshape(len(ids), *shape)
                    np.testing.assert_array_equal(got, want)
            store.close()


def test_interrupted_expert_layer_write_leaves_nothing(tmp_path):
    def boom(name):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_expert_layer(tmp_path / "l.safetensors", "m", [("m.a", "U8", (2, 3))], boom)
    assert list(tmp_path.iterdir()) == []


def test_arrays_are_contiguous_and_separate(stores):
    """mx.array of a strided numpy view copies (and keeps) its whole base buffer: every tensor
    must come back as its own contiguous array, whatever the layout and reader."""
    for root in stores:
        for io in STRATEGIES:
            store = ExpertStore(root, open_manifest(root), io=io)
            for got in (store.read(0, [6, 1, 2]), store.read_layer(0)):
                bufs = [b for b, _, _ in got.values()]
                assert all(b.flags.c_contiguous for b in bufs)
                assert not any(np.shares_memory(a, b) for i, a in enumerate(bufs) for b in bufs[i + 1 :])
            store.close()
    v1, v2 = stores
    ra, rb = (ExpertStore(r, open_manifest(r), io="pread").read(0, [6, 1, 2]) for r in (v1, v2))
    pa, pb = to_device(ra, 3, "float32"), to_device(rb, 3, "float32")
    for proj in pa:
        for part in pa[proj]:
            np.testing.assert_array_equal(np.array(pa[proj][part]), np.array(pb[proj][part]))
    del pa, pb
    B.reset_peak_memory()
    base = mx.get_active_memory()  # arrays other tests keep count towards the peak too
    to_device(rb, 3, "float32")
    assert B.peak_memory() - base <= 2 * sum(b.nbytes for b, _, _ in rb.values())  # one copy each, not their bases


def test_engine_tokens_match_on_both_layouts_and_every_reader(stores):
    v1, v2 = stores
    prompt = list(range(3, 43))  # >= 32 tokens: whole-layer prefill, then staged decode
    want = edge0.load(v1, lora=False).generate(prompt, max_tokens=8, ignore_eos=True).tokens
    for kw in (
        {},
        {"decode_executor": "exact", "prefill_executor": "exact"},
        {"io": "mmap"},
        {"io": "pread"},
        {"io": "direct"},
    ):
        e = edge0.load(v2, lora=False, **kw)
        assert e.generate(prompt, max_tokens=8, ignore_eos=True).tokens == want
        assert "expert-major layout" in e.store.describe_io()


def test_older_store_loads_and_names_the_relayout(stores):
    v1, _ = stores
    store = ExpertStore(v1, open_manifest(v1), io="pread")
    line = store.describe_io()
    assert "\n" not in line and "format version 1" in line and "edge0 relayout" in line


def test_relayout_cli_and_damaged_source(stores, tmp_path):
    v1, _ = stores
    out = tmp_path / "cli"
    r = subprocess.run(
        [sys.executable, "-m", "edge0", "relayout", str(v1), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr
    assert manifest_hash(out) == manifest_hash(v1)
    r = subprocess.run(
        [sys.executable, "-m", "edge0", "relayout", str(v1), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 2 and "already exists" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad"
    shutil.copytree(v1, bad)
    layer = open_manifest(bad)["expert_layers"][0]["file"]
    with open(bad / layer, "r+b") as fh:  # same size, one flipped byte
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 1]))
    with pytest.raises(Edge0Error, match="sha256"):
        relayout_store(bad, tmp_path / "bad-v2")
    assert not (tmp_path / "bad-v2").exists() and not list(tmp_path.glob(".bad-v2*"))


def test_layout_that_does_not_match_the_file_is_one_line_error(stores, tmp_path):
    _, v2 = stores
    copy = tmp_path / "s"
    shutil.copytree(v2, copy)
    m = json.loads((copy / "edge0-manifest.json").read_text())
    m["expert_layers"][0]["expert_stride"] += ALIGN
    (copy / "edge0-manifest.json").write_text(json.dumps(m))
    with pytest.raises(Edge0Error, match="changed after conversion"):  # its own checksum catches the edit
        open_manifest(copy)
    m.pop("manifest_sha256")  # checksummed again (the edit passes its own checksum): the layout check
    (copy / "edge0-manifest.json").write_text(json.dumps(seal(m)))
    with pytest.raises(Edge0Error, match="layout in the manifest does not match") as e:
        open_manifest(copy)
    assert "\n" not in str(e.value) and "edge0 convert" in str(e.value)


def _refuse_o_direct(monkeypatch):
    real = os.open

    def fake(path, flags, *a, **kw):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", fake)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")
def test_direct_falls_back_with_a_counted_visible_note(stores, monkeypatch):
    _, v2 = stores
    _refuse_o_direct(monkeypatch)
    store = ExpertStore(v2, open_manifest(v2), io="direct")
    for layer in store.layers:
        check(store.read(layer, [1, 5]), reference(stores[0], layer), [1, 5])
        store.read(layer, [0])
    s = store.io_stats()
    assert s["direct_fallbacks"] == len(store.layers)  # once per file, not per read
    assert any("refused (EINVAL on open)" in r for r in s["direct_fallback_reasons"])
    assert "fell back to pread for 2 files" in store.describe_io()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")
def test_direct_read_refused_falls_back(stores, monkeypatch):
    """Some file systems accept O_DIRECT on open and refuse the read (tmpfs before Linux 6.6)."""
    import fcntl

    real = os.preadv

    def fake(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", fake)
    store = ExpertStore(stores[1], open_manifest(stores[1]), io="direct", queue_depth=4)
    check(store.read(0, [7, 0, 2, 5]), reference(stores[0], 0), [7, 0, 2, 5])
    s = store.io_stats()
    assert s["direct_fallbacks"] == 1 and "O_DIRECT read refused (EINVAL)" in s["direct_fallback_reasons"][0]


@pytest.mark.parametrize("io", STRATEGIES)
def test_concurrent_reads_return_the_right_bytes(stores, io):
    v1, v2 = stores
    store = ExpertStore(v2, open_manifest(v2), io=io, queue_depth=4)
    refs = {l: reference(v1, l) for l in store.layers}
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(30):
                layer = int(rng.choice(list(store.layers)))
                num = store.layers[layer]["num_experts"]
                if rng.random() < 0.1:
                    check(store.read_layer(layer), refs[layer], range(num))
                    continue
                ids = rng.choice(num, size=int(rng.integers(1, 6)), replace=False).tolist()
                check(store.read(layer, ids), refs[layer], ids)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    store.close()


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_cold_reads_drop_each_range(stores, io, monkeypatch):
    v1, v2 = stores
    dropped = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: dropped.append((off, n, advice)))
    store = ExpertStore(v2, open_manifest(v2), io=io, cold_reads=True)
    check(store.read(0, [4, 2]), reference(v1, 0), [4, 2])
    stride = store.layers[0]["expert_stride"]
    assert sorted(n for _, n, _ in dropped) == [stride, stride]
    assert {a for _, _, a in dropped} == {os.POSIX_FADV_DONTNEED}


def test_auto_choice_follows_memory():
    assert choose_io(10 * 2**30, (64 * 2**30, "MemAvailable"))[0] == "pread"
    io, reason = choose_io(40 * 2**30, (64 * 2**30, "cgroup /x limit 68.72 GB"))
    assert io == "direct" and "exceed" in reason and "cgroup" in reason
    avail, source = memory_available()
    assert avail > 0 and source
    assert "auto: " in ExpertStore(ROOT, {"expert_layers": []}).io_stats()["reason"]


def test_cgroup_limit_is_seen_inside_a_memory_cgroup():
    from edge0.bench.cgroup import MemoryCgroup

    parent, why = MemoryCgroup.available()
    if parent is None:
        pytest.skip(why)
    cg = MemoryCgroup.create(parent, 300 * 2**20)
    try:
        code = (
            "from edge0.backend.memory import available, cgroup_available; print(cgroup_available()[0], available()[1])"
        )
        r = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            preexec_fn=cg.enter,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert r.returncode == 0, r.stderr
        avail, source = r.stdout.split(maxsplit=1)
        assert 0 < int(avail) <= 300 * 2**20 and source.startswith("cgroup")
    finally:
        cg.remove()
    assert cgroup_available() is None or cgroup_available()[0] > 0
