"""The default expert-cache budget: the memory probe's number (taken once the resident weights are
loaded) less the KV cache at the configured context, two layers of experts for prefill and a
headroom; a one-line error naming the --expert-cache that would fit when even one route does not.
The KV bytes `edge0 plan` and the budget count are those the engine's caches hold."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

import edge0
from edge0.backend import kvcache as bkv
from edge0.backend import memory
from edge0.backend.kvcache import prompt_cache_nbytes
from edge0.errors import Edge0Error
from edge0.planning.forecast import read_checkpoint, summarize
from edge0.server.config import DEFAULT_MAX_PROMPT_TOKENS
from edge0.streaming import budget as bud
from edge0.units import format_size
from tests.fixtures import ALL_FAMILIES, fixture_dir

MB = 10**6


# One fixture per kind of KV cache: grouped-query attention, latent attention (MLA), sliding
# windows, linear attention beside full attention, Mamba, chunked local attention, DeepSeek-V4.1's
# window state, KV shared across layers, cross-layer attention; -m slow runs every family.
KV_KINDS = (
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
    "qwen3_5_moe",
    "jamba",
    "llama4",
    "deepseek_v41",
    "gemma4",
    "hunyuan",
)
CONTEXT = 1024  # a multiple of mlx-lm's 256-token KV allocation step


def _check_kv(family, store_for):
    src = fixture_dir(family)
    planned = summarize(*read_checkpoint(str(src)), str(src)).kv.bytes_at(CONTEXT)  # what `edge0 plan` uses
    engine = edge0.load(store_for(family), dtype="float32", prerouter=False, lora=False, context_tokens=CONTEXT)
    engine.generate([(7 * i) % 200 + 10 for i in range(CONTEXT)], max_tokens=1, reuse_cache=True)
    allocated = prompt_cache_nbytes(engine.kv.newest.cache)  # the arrays the engine's caches hold after CONTEXT tokens
    assert allocated > 0 and abs(planned - allocated) <= 0.05 * allocated, (family, planned, allocated)
    assert engine.streaming.default.kv == planned  # the default expert cache leaves the same room


@pytest.mark.parametrize("family", KV_KINDS)
def test_plan_and_budget_kv_bytes_equal_the_engines_kv_cache(family, store_for):
    _check_kv(family, store_for)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(ALL_FAMILIES) - set(KV_KINDS)))
def test_plan_and_budget_kv_bytes_equal_the_engines_kv_cache_every_family(family, store_for):
    _check_kv(family, store_for)


def test_kv_footprint_with_kv_bits_and_windows():
    fp = bkv.KVFootprint(per_token=(256, 256, 0), caps=(None, 8, None), fixed=1000, quantizable=(True, False, False))
    assert fp.bytes_at(100) == 1000 + 256 * 100 + 256 * 8
    assert fp.longest(fp.bytes_at(300), 10_000) == 300 and fp.longest(999, 10_000) == 0
    q8 = fp.with_bits(8, 64)  # one byte per value and a float32 scale and bias per group of 64
    assert q8.per_token == (72, 256, 0) and q8.bytes_at(10) == 1000 + 720 + 256 * 8
    assert bud.context_tokens({"max_position_embeddings": 1024}, None) == 1024
    assert bud.context_tokens({"max_position_embeddings": 40960}, None) == bud.DEFAULT_CONTEXT
    assert bud.context_tokens({"max_position_embeddings": 1024}, 9000) == 9000


ROOM = 500 * MB - 100 * MB - 170 * MB - bud.HEADROOM_MIN  # 500 MB available, less KV, prefill and headroom
# the working KV at a 4096-token context (100 MB), the other conversations' at the 16,384 tokens served (400 MB each)
RESERVE = bud.Reserve(kv=100 * MB, context=4096, served_kv=400 * MB, served=16384)


@pytest.mark.parametrize(
    "available, total, want, sized_for",
    [
        (20_000 * MB, 2_000 * MB, 2_000 * MB, "two 16,384-token contexts"),  # every expert fits
        # the 64 MiB headroom floor; the other conversations' caches take a quarter of what is left
        (
            500 * MB,
            2_000 * MB,
            ROOM - ROOM // 4,
            "a quarter of the memory left for experts; two 16,384-token contexts would take 800.00 MB",
        ),
        # 10% headroom; two served contexts' KV (800 MB), not two at the 4096-token context (200 MB)
        (5_000 * MB, 9_000 * MB, 5_000 * MB - 100 * MB - 170 * MB - 500 * MB - 800 * MB, "two 16,384-token contexts"),
        (
            300 * MB,
            2_000 * MB,
            0,
            "a quarter of the memory left for experts; two 16,384-token contexts would take 800.00 MB",
        ),
    ],
)
def test_default_budget_leaves_kv_prompt_caches_prefill_and_headroom(monkeypatch, available, total, want, sized_for):
    monkeypatch.setattr(memory, "available", lambda: (available, "cgroup limit 1.40 GB (test)"))
    b = bud.default_budget(total, RESERVE, 170 * MB)
    assert b.bytes == want
    assert b.headroom == max(bud.HEADROOM_MIN, available // 10)
    room = max(0, available - 100 * MB - 170 * MB - b.headroom)
    assert b.prompt_caches == min(bud.POOL_CONTEXTS * 400 * MB, room // 4) and b.prompt_caches_for == sized_for
    d = b.describe()
    assert "cgroup limit 1.40 GB (test)" in d and "at 4096 tokens" in d and f"({sized_for}; --prompt-cache-memory)" in d
    given = bud.default_budget(total, replace(RESERVE, prompt_caches=0), 170 * MB)
    assert given.prompt_caches == 0 and given.bytes == min(total, max(0, room))
    assert "prompt caches 0 B (--prompt-cache-memory)" in given.describe()


def test_the_served_context_is_the_models_own_or_a_longer_context_tokens():
    assert bud.served_context({"max_position_embeddings": 65536}, None) == 65536
    assert bud.served_context({"max_position_embeddings": 65536}, 4096) == 65536
    assert bud.served_context({"max_position_embeddings": 1024}, 9000) == 9000
    assert bud.served_context({"text_config": {"max_position_embeddings": 40960}}, None) == 40960
    # a model that declares none: the context the server takes for it
    assert bud.served_context({}, None) == bud.UNDECLARED_CONTEXT == DEFAULT_MAX_PROMPT_TOKENS


def test_the_prompt_caches_default_is_two_served_contexts_and_shrinks_the_expert_cache(monkeypatch, store_for):
    """A 65,536-token model's prompt caches hold two conversations of its whole context, not two of
    the 4096 tokens the working KV is sized for (issue 48: 6.29 MB held none of 11 caches of a
    39k-token conversation); the expert cache's default gives that room up; a given
    --prompt-cache-memory is kept as given, and --expert-cache leaves the default share as it is."""
    store = store_for("qwen3_moe", max_position_embeddings=65536)
    monkeypatch.setattr(memory, "available", lambda: (10_000 * MB, "MemAvailable"))
    e = edge0.load(store, prerouter=False, lora=False)
    fp = bkv.kv_footprint(e.model, None, 64, e.compute_dtype)
    want = 2 * fp.bytes_at(65536)
    assert want == 32 * fp.bytes_at(4096) > 0  # its KV grows with the tokens: 16 times the 4096-token context, twice
    b = e.streaming.default
    assert (b.context, b.kv, b.prompt_caches, b.prompt_caches_for) == (
        4096,
        fp.bytes_at(4096),
        want,
        "two 65,536-token contexts",
    )
    assert b.free == 10_000 * MB - b.kv - b.prefill - b.headroom - want
    assert e.kv.pool.max_bytes == want and e.kv.context_bytes == fp.bytes_at(4096)
    assert f"prompt caches: memory {format_size(want)} (two 65,536-token contexts; --prompt-cache-memory)" in (
        e.describe()
    )
    given = edge0.load(store, prerouter=False, lora=False, prompt_cache_memory="32MB")
    assert given.kv.pool.max_bytes == 32 * MB and given.streaming.default.prompt_caches == 32 * MB
    assert "prompt caches: memory 32.00 MB (--prompt-cache-memory)" in given.describe()
    assert given.streaming.default.free - b.free == want - 32 * MB  # the expert cache's room, given back
    fixed = edge0.load(store, prerouter=False, lora=False, expert_cache="2MB")
    assert fixed.kv.pool.max_bytes == want and "(two 65,536-token contexts; --prompt-cache-memory)" in fixed.describe()


def test_no_room_for_one_route_names_the_expert_cache_that_would_fit(monkeypatch, store_for):
    store = store_for("qwen3_moe")
    monkeypatch.setattr(memory, "available", lambda: (bud.HEADROOM_MIN, "cgroup limit 0.20 GB (test)"))
    with pytest.raises(Edge0Error) as e:
        edge0.load(store, prerouter=False, lora=False)
    msg = str(e.value)
    assert "\n" not in msg and "cgroup limit 0.20 GB (test)" in msg and "--context-tokens" in msg
    suggested = msg.split("--expert-cache ")[1].split()[0]
    ok = edge0.load(store, prerouter=False, lora=False, expert_cache=suggested)
    assert ok.expert_cache()["slots_per_layer"] >= ok.expert_cache()["min_slots"]  # one route fits
    exact = edge0.load(store, prerouter=False, lora=False, decode_executor="exact")  # no slots: nothing to size
    assert exact.expert_cache()["slots_per_layer"] == 0


def test_describe_names_the_probe_and_the_terms(monkeypatch, store_for):
    store = store_for("qwen3_moe")
    monkeypatch.setattr(memory, "available", lambda: (10_000 * MB, "MemAvailable"))
    e = edge0.load(store, prerouter=False, lora=False, context_tokens=100)
    d = e.describe()
    assert "available after loading (MemAvailable)" in d and "at 100 tokens" in d
    assert e.expert_cache()["budget_bytes"] == e.streaming.total_expert_bytes  # all experts fit
    given = edge0.load(store, prerouter=False, lora=False, expert_cache="2MB")
    assert "available after loading" not in given.describe()
    with pytest.raises(Edge0Error, match="--context-tokens 0"):
        edge0.load(store, context_tokens=0)


def test_a_deepseek_v3_sized_model_counts_its_latent_cache_without_building_weights():
    """DeepSeek-V3's real sizes, built from its config alone: MLA caches one 512-wide latent and one
    64-wide rope key per layer and token (the plan once counted 128 heads' K and V: 85x more), and
    measuring it evaluates none of the 671B parameters."""
    from edge0.backend import io as bio
    from tests.fixtures.make import fixture_config

    real = dict(hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256)
    real.update(num_experts_per_tok=8, moe_intermediate_size=2048, intermediate_size=18432, vocab_size=129280)
    real.update(num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512)
    real.update(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4)
    before = mx.get_peak_memory()
    fp = bkv.kv_footprint(bio.build_model(fixture_config("deepseek_v3", **real), Path(".")))
    assert fp.bytes_at(4096) == 61 * (512 + 64) * 4 * 4096
    assert mx.get_peak_memory() - before < 64 << 20  # nothing of the model was evaluated
