"""The checks of a model across ranks that need no launch: the layer split (balanced by bytes,
the runs of layers that share KV, a given split's errors), speculation's refusals across ranks,
and the ring connections' keepalive."""

import os
import socket

import pytest

import edge0
from edge0.distributed.split import balanced_split, check_split
from edge0.errors import Edge0Error


def test_a_split_must_cover_every_layer(store_for):
    with pytest.raises(Edge0Error, match=r"--pipeline-split 1: covers 1 layer, but the model has 2 \(layers 0-1\)"):
        edge0.load(store_for("qwen3_moe"), pipeline_split="1")
    with pytest.raises(Edge0Error, match="2 counts, but this process runs alone"):
        edge0.load(store_for("qwen3_moe"), pipeline_split=[1, 1])
    with pytest.raises(Edge0Error, match="covers 5 layers, but the model has 4"):
        check_split((2, 3), 4, 2)
    with pytest.raises(Edge0Error, match="each >= 1"):
        edge0.load(store_for("qwen3_moe"), pipeline_split="2,0")
    assert edge0.load(store_for("qwen3_moe"), pipeline_split="2").stage is None  # one rank, every layer


def test_the_runs_of_layers_that_share_kv_come_from_the_model():
    """gemma4's KV-shared layers (mlx-lm's previous_kvs) and hunyuan's pairs give the runs a stage
    holds whole; a family without either may be cut anywhere; gemma4's per-layer inputs (from the
    token ids, on the first stage only) are refused across ranks naming the field."""
    from edge0.backend.stages import layer_groups, num_layers
    from tests.fixtures.make import build_model, fixture_config

    types = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    assert layer_groups(build_model(fixture_config("gemma4_text"))) == (3,)  # layer 2 reuses layer 0's KV
    assert layer_groups(build_model(fixture_config("gemma4_text", num_hidden_layers=5, layer_types=types))) == (1, 1, 3)
    assert layer_groups(build_model(fixture_config("gemma4", num_hidden_layers=5, layer_types=types))) == (1, 1, 3)
    assert layer_groups(build_model(fixture_config("hunyuan", num_hidden_layers=4))) == (2, 2)
    assert layer_groups(build_model(fixture_config("qwen3_moe"))) is None
    per_layer = fixture_config("gemma4_text", hidden_size_per_layer_input=16, vocab_size_per_layer_input=64)
    with pytest.raises(Edge0Error, match="per-layer inputs .*hidden_size_per_layer_input 16.*one process"):
        num_layers(build_model(per_layer))


def test_keepalive_stays_within_the_kernel_s_bounds_and_says_when_it_cannot():
    from edge0.backend import distributed as bdist

    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as conn:
            assert bdist.keep_alive([conn.fileno()], 10**6) is None  # a long --peer-timeout: clamped
            got = bdist.keep_alive_settings([conn.fileno()])[0]
            assert got["keepalive"] == 1 and got["TCP_KEEPIDLE"] == got["TCP_KEEPINTVL"] == 32767
            assert bdist.keep_alive([conn.fileno()], 6) is None
            assert bdist.keep_alive_settings([conn.fileno()])[0]["TCP_KEEPIDLE"] == 3
    with open(os.devnull) as f:  # not a socket: the reason, for the stats, not an error
        assert "not set" in bdist.keep_alive([f.fileno()], 60)


def test_speculation_across_ranks_is_refused_where_a_rank_cannot_rewind_or_heads_would_replay():
    from types import SimpleNamespace

    from edge0.engine.speculative import check_speculation

    def engine(problem=None, replays=False, heads=False):
        traits = {"rewind_problem": problem, "replays": replays, "drop_tails": True}
        return SimpleNamespace(
            pipeline=SimpleNamespace(traits=traits), prerouting=object() if heads else None, model_id="m"
        )

    check_speculation(engine())
    check_speculation(engine(replays=True))  # every rank goes back and feeds the kept tokens again
    check_speculation(engine(heads=True))
    with pytest.raises(Edge0Error, match="rank 1: its ChunkedKVCache layers cannot be rewound"):
        check_speculation(engine(problem="rank 1: its ChunkedKVCache layers cannot be rewound"))
    with pytest.raises(Edge0Error, match="pre-router heads, rejected drafts fed again .* --no-prerouter"):
        check_speculation(engine(replays=True, heads=True))


def test_balanced_split_evens_out_bytes_rank_0_first():
    assert balanced_split([1] * 8, 2) == (4, 4)
    # the embedding (first stage, the last rank) and the head (last stage, rank 0) count too
    assert balanced_split([1] * 8, 2, first_extra=2) == (5, 3)
    assert balanced_split([1] * 8, 2, last_extra=4) == (2, 6)
    assert balanced_split([4, 1, 1, 1, 1], 2) == (4, 1)
    with pytest.raises(Edge0Error, match="at most 2"):
        balanced_split([1, 1], 3)


def test_layers_that_share_kv_stay_on_one_stage():
    """hunyuan's cross-layer attention: each pair's second layer reuses the first's KV, so a stage
    holds whole pairs; gemma4's KV-shared layers reuse the KV of an earlier layer, which one stage
    holds with them and every layer between. The balanced split plans over those runs of layers,
    and a given split that cuts one is refused naming where stages may start."""
    pairs = (2, 2, 2, 2)
    assert balanced_split([1] * 8, 2, groups=pairs) == (4, 4)
    assert balanced_split([1] * 8, 2, last_extra=3, groups=pairs) == (2, 6)  # (3, 5) would cut a pair
    assert balanced_split([1] * 6, 3, groups=(2, 2, 2)) == (2, 2, 2)
    with pytest.raises(Edge0Error, match="at most 2 ranks"):
        balanced_split([1] * 4, 3, groups=(2, 2))
    check_split((2, 2), 4, 2, groups=(2, 2))
    with pytest.raises(
        Edge0Error, match=r"starts a stage at layer 1, inside layers that share KV \(0-1, 2-3.*layers 2$"
    ):
        check_split((3, 1), 4, 2, groups=(2, 2))
    # gemma4: layers 4 and 5 attend with the KV of layers 2 and 3, so layers 2-5 stay together
    shared = (1, 1, 4)
    assert balanced_split([1] * 6, 2, groups=shared) == (4, 2)  # (3, 3) would cut them
    assert balanced_split([5, 1, 1, 1, 1, 1], 2, groups=shared) == (5, 1)
    assert balanced_split([1] * 6, 3, groups=shared) == (4, 1, 1)
    check_split((4, 2), 6, 2, groups=shared)
    with pytest.raises(Edge0Error, match="starts a stage at layer 3.*start stages only at layers 1, 2"):
        check_split((3, 3), 6, 2, groups=shared)


def test_a_heartbeat_answers_a_peer_it_hears_first_at_once(tmp_path, monkeypatch):
    """A peer whose beats all came before this rank listened (it may be stopped before its next)
    still hears from this rank: the first beat heard from it is answered at once, not at the next
    beat 0.5 s later. Before, rank 0 in about 1 run of 5 never heard a rank stopped early on."""
    import json
    import time

    from edge0.backend import distributed as bdist

    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # rank 1, played by the test
    peer.bind(("127.0.0.1", 0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port0 = s.getsockname()[1]
    hosts = [[f"127.0.0.1:{port0}"], [f"127.0.0.1:{peer.getsockname()[1]}"]]
    (tmp_path / "hosts.json").write_text(json.dumps(hosts))
    monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "hosts.json"))
    monkeypatch.setenv("MLX_RANK", "0")
    peer.settimeout(5)
    rank0 = bdist.Heartbeat(30)  # beats every 0.5 s
    try:
        assert rank0.interval == 0.5
        first = peer.recv(64)
        sent = time.monotonic()
        peer.sendto(first.partition(b" ")[0] + b" 1", ("127.0.0.1", port0))
        peer.settimeout(0.4)
        assert peer.recv(64) == first and time.monotonic() - sent < 0.4  # the answer, not the next beat
        assert rank0.unheard() == []
    finally:
        rank0.stop()
        peer.close()


def test_a_heartbeat_judges_only_a_peer_it_has_heard(tmp_path, monkeypatch):
    """Two ranks' heartbeats in one process: a peer never heard (its UDP blocked) is not called
    silent; one heard and then quiet for the timeout is."""
    import json
    import time

    from edge0.backend import distributed as bdist

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    (tmp_path / "hosts.json").write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "hosts.json"))
    monkeypatch.setenv("MLX_RANK", "0")
    rank0 = bdist.Heartbeat(0.6)
    try:
        time.sleep(0.8)
        assert rank0.silent() is None and rank0.unheard() == [1]  # never heard: not judged
        monkeypatch.setenv("MLX_RANK", "1")
        rank1 = bdist.Heartbeat(0.6)
        deadline = time.monotonic() + 5  # its first beats, within a few intervals (0.06 s) on a busy machine
        while rank0.unheard() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rank0.unheard() == [] and rank0.silent() is None
        rank1.stop()
        deadline = time.monotonic() + 5
        while rank0.silent() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank0.silent() == 1
    finally:
        rank0.stop()
