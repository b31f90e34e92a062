"""Store format: streaming writer, mmap reader byte ranges, manifest checks, atomic convert."""

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from safetensors.numpy import load_file

from edge0.errors import Edge0Error
from edge0.store import VERSION, ExpertStore, open_manifest
from edge0.store.convert import convert
from edge0.store.writer import SafetensorsWriter
from tests.fixtures.make import fixture_dir, reference_dir


def test_streaming_writer_is_read_back_by_safetensors(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    b = np.arange(5, dtype=np.uint32)
    w = SafetensorsWriter(tmp_path / "t.safetensors", [("a", "F32", a.shape), ("b", "U32", b.shape)], {"format": "mlx"})
    w.write("a", a.tobytes())
    w.write("b", b.tobytes())
    info = w.close()
    assert info["size"] == (tmp_path / "t.safetensors").stat().st_size
    back = load_file(tmp_path / "t.safetensors")
    np.testing.assert_array_equal(back["a"], a)
    np.testing.assert_array_equal(back["b"], b)
    raw = (tmp_path / "t.safetensors").read_bytes()
    assert raw[w.offsets["b"] : w.offsets["b"] + 20] == b.tobytes()


def test_writer_rejects_out_of_order_and_short_tensors(tmp_path):
    w = SafetensorsWriter(tmp_path / "t.safetensors", [("a", "F32", (2,)), ("b", "F32", (2,))])
    with pytest.raises(ValueError, match="out of order"):
        w.write("b", b"\0" * 8)
    with pytest.raises(ValueError, match="bytes"):
        w.write("a", b"\0" * 4)


def test_reader_returns_exact_expert_byte_ranges(store_for):
    root = store_for("qwen3_moe")
    manifest = open_manifest(root)
    store = ExpertStore(root, manifest)
    layer = manifest["expert_layers"][0]
    stacked = mx.load(str(root / layer["file"]))
    got = store.read(layer["layer"], [5, 2])
    for name, (buf, st_dtype, shape) in got.items():
        if layer.get("layout") == "expert-major":  # one uint8 [E, expert_stride] tensor
            t = layer["tensors"][name]
            full = np.array(stacked[f"{layer['module']}.experts"])[
                :, t["expert_offset"] : t["expert_offset"] + t["expert_nbytes"]
            ]
        else:
            full = np.array(
                stacked[f"{layer['module']}.{name}"].view(mx.uint8)
                if st_dtype != "BF16"
                else stacked[f"{layer['module']}.{name}"].view(mx.uint16)
            )
            full = full.reshape(full.shape[0], -1).view(np.uint8)
        assert buf.shape == (2, full.shape[1])
        np.testing.assert_array_equal(buf[0], full[5])
        np.testing.assert_array_equal(buf[1], full[2])
    assert store.bytes_read == sum(b.nbytes for b, _, _ in got.values())


def test_manifest_records_format_spec_and_checksums(store_for):
    root = store_for("deepseek_v3")
    m = json.loads((root / "edge0-manifest.json").read_text())
    assert (m["format"], m["version"]) == ("edge0-store", VERSION)
    assert m["spec"]["routing"]["kind"] == "grouped"
    # every file of the store but the manifest (which carries a checksum of its own)
    every = {f.relative_to(root).as_posix() for f in root.rglob("*") if f.is_file()} - {"edge0-manifest.json"}
    assert set(m["files"]) == every and {"model.safetensors", "config.json", "tokenizer.json"} <= every
    assert len(m["manifest_sha256"]) == 64
    assert all(len(f["sha256"]) == 64 for f in m["files"].values())
    t = m["expert_layers"][0]["tensors"]["gate_proj.weight"]
    assert t["dtype"] == "U32" and t["shape"][-1] * 8 == 64  # int4 packed 8 per uint32
    open_manifest(root, verify=True)


def test_interrupted_convert_leaves_nothing_that_loads(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = SafetensorsWriter.write

    def flaky(self, name, data):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(self, name, data)

    monkeypatch.setattr(SafetensorsWriter, "write", flaky)
    out = tmp_path / "store"
    with pytest.raises(KeyboardInterrupt):
        convert(str(fixture_dir("qwen3_moe")), out, quiet=True)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(Edge0Error, match="no such directory"):
        open_manifest(out)


def test_raw_bytes_of_a_transposed_view_are_row_major():
    from edge0.backend import io as bio

    a = mx.arange(12, dtype=mx.float32).reshape(3, 4).T  # mlx-lm's sanitize swaps fused expert axes like this
    mx.eval(a)
    assert bytes(bio.raw_bytes(a)) == np.ascontiguousarray(np.array(a)).tobytes()


def test_unquantized_transposed_experts_convert_and_match_mlx_lm(tmp_path):
    """qwen3_vl_moe stores experts transposed; with an expert width group-64 quantization skips
    (32), mlx-lm keeps them float and swapped, and the store writes them row-major."""
    import edge0
    from tests.test_token_identity import PROMPT, mlx_lm_greedy

    hf = fixture_dir("qwen3_vl_moe", moe_intermediate_size=32)
    model, tok = mlx_lm.load(str(reference_dir("qwen3_vl_moe", moe_intermediate_size=32)))
    prompt = tok.encode(PROMPT)
    store = convert(str(hf), tmp_path / "s", quiet=True)
    assert edge0.load(store, dtype="float32").generate(prompt, max_tokens=8, ignore_eos=True).tokens == mlx_lm_greedy(
        model, prompt, 8
    )


def test_a_refused_family_is_refused_with_its_reason(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "muse_spark"}))
    with pytest.raises(Edge0Error, match="model_type 'muse_spark' is not supported: .*Metal kernel"):
        convert(str(src), tmp_path / "out", quiet=True)
