"""The default expert-cache budget: the memory probe's number (taken once the resident weights are
loaded) less the KV cache at the configured context, two layers of experts for prefill and a
headroom; a one-line error naming the --expert-cache that would fit when even one route does not."""

from __future__ import annotations

import pytest

import edge0
from edge0.backend import memory
from edge0.errors import Edge0Error
from edge0.streaming import budget as bud

MB = 10**6


def test_kv_bytes_per_token_of_each_attention_kind():
    gqa = {"num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}
    assert bud.kv_bytes_per_token(gqa, "float32") == 24 * 2 * 4 * 64 * 4
    assert bud.kv_bytes_per_token(gqa, "bfloat16") == 24 * 2 * 4 * 64 * 2
    # --kv-bits 8: one byte per value and a float32 scale and bias per group of 64
    assert bud.kv_bytes_per_token(gqa, "float32", kv_bits=8, kv_group_size=64) == 24 * 2 * 4 * 64 * (1 + 8 / 64)
    no_head_dim = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512}  # MHA, head_dim 64
    assert bud.kv_bytes_per_token(no_head_dim, "float32") == 2 * 2 * 8 * 64 * 4
    mla = {"num_hidden_layers": 3, "num_attention_heads": 8, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert bud.kv_bytes_per_token(mla, "float32") == 3 * (512 + 64) * 4
    hybrid = {**gqa, "full_attention_interval": 4}  # 6 of 24 layers keep a KV cache
    assert bud.kv_bytes_per_token(hybrid, "float32") == 6 * 2 * 4 * 64 * 4
    assert bud.context_tokens({"max_position_embeddings": 1024}, None) == 1024
    assert bud.context_tokens({"max_position_embeddings": 40960}, None) == bud.DEFAULT_CONTEXT
    assert bud.context_tokens({"max_position_embeddings": 1024}, 9000) == 9000


@pytest.mark.parametrize(
    "available, total, want",
    [
        (20_000 * MB, 2_000 * MB, 2_000 * MB),  # every expert fits
        (500 * MB, 2_000 * MB, 500 * MB - 100 * MB - 170 * MB - bud.HEADROOM_MIN),  # the 64 MiB floor
        (5_000 * MB, 9_000 * MB, 5_000 * MB - 100 * MB - 170 * MB - 500 * MB),  # 10% of what is available
        (300 * MB, 2_000 * MB, 0),  # nothing left
    ],
)
def test_default_budget_leaves_kv_prefill_and_headroom(monkeypatch, available, total, want):
    monkeypatch.setattr(memory, "available", lambda: (available, "cgroup limit 1.40 GB (test)"))
    b = bud.default_budget(total, 100 * MB, 4096, 170 * MB)
    assert b.bytes == want
    assert b.headroom == max(bud.HEADROOM_MIN, available // 10)
    assert "cgroup limit 1.40 GB (test)" in b.describe() and "at 4096 tokens" in b.describe()


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
