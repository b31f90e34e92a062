"""Engine and `edge0 generate` behaviour beyond token identity."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import edge0
from edge0.errors import Edge0Error

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine(store_for):
    return edge0.load(store_for("qwen3_moe"))


def test_k_override_reads_fewer_experts_and_changes_route(store_for):
    full = edge0.load(store_for("qwen3_moe"))
    narrow = edge0.load(store_for("qwen3_moe"), top_k=1)
    prompt = list(range(40, 60))
    a = full.generate(prompt, max_tokens=8, ignore_eos=True)
    b = narrow.generate(prompt, max_tokens=8, ignore_eos=True)
    assert narrow.k == 1 and full.k == full.spec.top_k == 2
    assert 0 < b.stats["expert_bytes_read"] < a.stats["expert_bytes_read"]
    assert not np.allclose(full.logits(prompt), narrow.logits(prompt))
    with pytest.raises(Edge0Error, match="--top-k 3 is out of range"):
        edge0.load(store_for("qwen3_moe"), top_k=3)


def test_top_k_rejected_for_universal_family(store_for):
    with pytest.raises(Edge0Error, match="universal"):
        edge0.load(store_for("olmoe"), top_k=1)


def test_stream_equals_generate_and_stats(engine):
    prompt = "once upon a time"
    res = engine.generate(prompt, max_tokens=12, ignore_eos=True)
    steps = list(engine.stream_generate(prompt, max_tokens=12, ignore_eos=True))
    assert [s.token for s in steps] == res.tokens and "".join(s.text for s in steps) == res.text
    assert res.finish_reason == "length" and len(res.tokens) == 12
    s = res.stats
    assert s["prompt_tokens"] == len(engine.encode(prompt)) and s["generation_tokens"] == 12
    for key in ("prefill_tps", "decode_tps", "peak_memory_bytes", "peak_rss_bytes", "expert_bytes_read"):
        assert s[key] > 0, key


def test_stop_string_cuts_text(engine):
    res = engine.generate("once upon a time", max_tokens=20, ignore_eos=True)
    assert len(res.text) > 4
    stop = res.text[2:4]
    cut = engine.generate("once upon a time", max_tokens=20, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == res.text[: res.text.find(stop)]
    # The last Step names the stop string that ended it (the server reports it as stop_sequence).
    steps = list(engine.stream_generate("once upon a time", max_tokens=20, ignore_eos=True, stop=["\x00", stop]))
    assert steps[-1].stop == stop and all(s.stop is None for s in steps[:-1])
    assert list(engine.stream_generate("once upon a time", max_tokens=3, ignore_eos=True))[-1].stop is None


def test_sampling_is_seeded(engine):
    a = engine.generate("hello", max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    b = engine.generate("hello", max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    assert a.tokens == b.tokens


def test_reuse_cache_prefills_only_new_tokens(engine):
    first = engine.encode("hello world once upon a time")
    r1 = engine.generate(first, max_tokens=4, reuse_cache=True, ignore_eos=True)
    second = first + r1.tokens + engine.encode(" and then")
    r2 = engine.generate(second, max_tokens=4, reuse_cache=True, ignore_eos=True)
    assert r2.stats["prompt_tokens"] == len(second)
    assert r2.stats["prefill_tokens"] == len(second) - len(first) - len(r1.tokens) + 1
    engine.reset_cache()
    fresh = engine.generate(second, max_tokens=4, ignore_eos=True)
    assert fresh.tokens == r2.tokens and fresh.stats["prefill_tokens"] == len(second)


def test_generate_cli_prints_text_and_stats(store_for):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge0",
            "generate",
            "--model",
            str(store_for("qwen3_moe")),
            "--prompt",
            "hello",
            "--max-tokens",
            "5",
            "--stats",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert (
        "tok/s" in p.stderr
        and "experts read" in p.stderr
        and "read_amplification" in p.stderr
        and "expert cache" in p.stderr
    )


def test_repo_id_offline_is_a_clear_error(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"}
    p = subprocess.run(
        [sys.executable, "-m", "edge0", "convert", "--hf-path", "nobody/not-a-model", "-o", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "nobody/not-a-model" in p.stderr and "Hugging Face" in p.stderr


def test_ids_the_vocabulary_skips_detokenize_as_empty_text(tmp_path):
    """The bench models' tokenizer has no token for a few ids (its vocabulary skips them), as some
    real ones do; a model can still sample them, which mlx-lm's BPE detokenizer failed on (a 500
    in the middle of a stream)."""
    import importlib.util

    from edge0.backend import io as bio

    spec = importlib.util.spec_from_file_location("make_bench_model", ROOT / "scripts" / "make_bench_model.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    maker.write_tokenizer(tmp_path, 400)
    tok = bio.load_tokenizer(tmp_path)
    hf = tok._tokenizer
    holes = [i for i, t in enumerate(hf.convert_ids_to_tokens(list(range(len(hf))))) if t is None]
    assert holes
    detok = tok.detokenizer
    for token in [
        *tok.encode("hi", add_special_tokens=False),
        holes[0],
        *tok.encode(" there", add_special_tokens=False),
    ]:
        detok.add_token(token)
    detok.finalize()
    assert detok.text == "hi there"
