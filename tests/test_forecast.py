"""`edge0 plan --hf-path`: fit and speed from config.json and the safetensors headers alone."""

from __future__ import annotations

import json

import pytest

from edge0.errors import Edge0Error
from edge0.planning.forecast import read_checkpoint, summarize
from tests.fixtures.make import fixture_dir, reference_dir


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_sizes_from_headers_match_the_converted_store(family, store_for):
    """Already quantized (mlx-lm layout): the store's bytes exactly; HF layout: the int4 estimate."""
    for src, store, tol in [
        (reference_dir(family), store_for(family, "mlx"), 0.002),
        (fixture_dir(family), store_for(family), 0.1),
    ]:
        ck = summarize(*read_checkpoint(str(src)), str(src))
        manifest = json.loads((store / "edge0-manifest.json").read_text())
        experts = sum(manifest["files"][l["file"]]["size"] for l in manifest["expert_layers"])
        per_expert = experts / (len(manifest["expert_layers"]) * manifest["expert_layers"][0]["num_experts"])
        resident = manifest["files"]["model.safetensors"]["size"]
        assert ck.moe_layers == len(manifest["expert_layers"]) and ck.num_experts == manifest["spec"]["num_experts"]
        # expert-major rows are padded to 4 KiB; the headers know the tensor bytes only
        assert abs(ck.expert_bytes - per_expert) <= 4096 + tol * per_expert, (src, ck.expert_bytes, per_expert)
        assert abs(ck.resident_store_bytes - resident) <= tol * resident + 64 * 1024, (
            src,
            ck.resident_store_bytes,
            resident,
        )


@pytest.mark.slow  # in the default suite's time budget: the forecast's numbers stay covered by the in-process tests
def test_plan_hf_path_prints_the_forecast(tmp_path, capsys):
    from edge0.cli.plan import main

    out = tmp_path / "f.json"
    assert main(["--hf-path", str(fixture_dir("qwen3_moe")), "--memory", "8GB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for field in ("store size", "resident", "expert cache", "tok/s", "longest context", "verdict"):
        assert field in text
    f = json.loads(out.read_text())
    assert f["verdict"] in ("FAST", "GOOD", "USABLE", "SLOW") and 0 < f["tok_s_low"] <= f["tok_s_high"]
    assert f["hit_rate_uniform"] <= f["hit_rate_local"] <= 1 and f["longest_context"] > 0
    kv = f["kv_bytes_at_max_context"]  # --kv-bits: 8 bits + a float32 scale and bias per 64 = 1.125 bytes
    assert kv["8-bit"] == pytest.approx(kv["float32"] * 1.125 / 4, rel=1e-6) and kv["4-bit"] < kv["8-bit"]
    assert "--kv-bits 4" in text

    assert main(["--hf-path", str(fixture_dir("qwen3_moe")), "--memory", "1MB", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["verdict"] == "DOES-NOT-FIT"


def test_hf_path_errors(tmp_path):
    from edge0.cli.plan import main

    with pytest.raises(Edge0Error, match="needs config.json"):
        main(["--hf-path", str(tmp_path)])
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(Edge0Error, match="not a directory"):
        main(["--hf-path", str(tmp_path / "a.txt")])
