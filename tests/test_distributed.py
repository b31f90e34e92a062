"""One model across ranks (edge0.distributed): two processes on 127.0.0.1 with MLX's ring backend
give the single process's greedy tokens, with and without pre-router heads (one predicting across
the stage boundary), each rank opening only its own layers' expert files; `edge0 generate` runs
under mlx.launch; a missing peer, a split that does not cover the layers, ranks with different
stores and a rank killed mid-request are one-line errors. Every family across ranks:
test_distributed_families.py; the server on ranks: test_distributed_serving.py."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import edge0
from edge0.errors import Edge0Error
from edge0.prerouter.train import train, write
from edge0.store.format import expert_file
from tests.test_lora import random_adapter

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "once upon a time, a tiny model"
TOKENS = 10
# rank 0 runs the last layers: deepseek_v3's layer 0 is dense, so "1,2" puts MoE layer 1 (a head's
# owner) on rank 1 and its consumer, MoE layer 2, on rank 0
SPLITS = {"qwen3_moe": "1,1", "deepseek_v3": "1,2"}
# deepseek_v41's stages pass on more than a hidden state: its hc_mult residual streams and the mix
# that collapses them, and what its compressed layers read from earlier ones (the compressed KV, the
# top-k rows). A stage that passed on the collapsed hidden state alone gave other tokens from the
# third on, with no error. The zoo fixture's 2 streams and uncompressed layers hide that (the streams
# stay nearly equal), so these have 4 streams and compressed layers; V41_WIDE adds a middle stage,
# which receives and sends the message, and a candidate mask that crosses a stage boundary.
V41 = {"hc_mult": 4, "compress_ratios": (4, 4), "kv_source_layer_ids": (0,), "index_source_layer_ids": (0,)}
V41_WIDE = {
    "num_hidden_layers": 4,
    "hc_mult": 4,
    "compress_ratios": (4, 4, 4, 4),
    "kv_source_layer_ids": (0, 2),
    "index_source_layer_ids": (0, 2),
    "candidate_source_layer_id": 0,
    "candidate_topk_blocks": 2,
    "candidate_block_size": 2,
}


@pytest.fixture(scope="module")
def heads(store_for, tmp_path_factory):
    """Quickly trained heads per family (their routes differ from the gates' often enough)."""
    out = {}
    text = "Once upon a time there was a tiny model that read its experts from disk. " * 40
    for family in SPLITS:
        engine = edge0.load(store_for(family), prerouter=False)
        tensors, meta, _ = train(engine, text, data_name="test", window=64, steps=40, progress=False)
        out[family] = write(tmp_path_factory.mktemp("heads") / f"{family}.safetensors", tensors, meta)
    return out


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def free_port_pair(lo: int = 20000, hi: int = 32000) -> int:
    """A port P with P and P + 1 free (mlx.launch's ring gives rank r P + r), below Linux's ephemeral
    range, where a client connection's TIME_WAIT (on even ports) cannot hold P + 1."""
    rng = random.Random()
    while True:
        port = rng.randrange(lo, hi)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def start(tmp_path, argvs: list[list[str]], ranks: int = 2) -> list[subprocess.Popen]:
    """Start `argvs[r]` as rank r of `ranks`, as mlx.launch does (MLX_HOSTFILE, MLX_RANK)."""
    hostfile = tmp_path / f"hosts-{time.monotonic_ns()}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "PYTHONPATH": str(ROOT)}
    return [
        subprocess.Popen(
            argv,
            env={**env, "MLX_RANK": str(r)},
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            # a rank answers Ctrl-C even when this run was started in the background, where a
            # shell starts commands with SIGINT ignored (and children inherit that)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        for r, argv in enumerate(argvs)
    ]


def finish(procs: list[subprocess.Popen], timeout: float = 60) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process; all are killed after `timeout` s."""
    try:
        deadline = time.monotonic() + timeout
        outputs = [p.communicate(timeout=max(1, deadline - time.monotonic())) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def launch(tmp_path, argvs: list[list[str]], ranks: int = 2, timeout: float = 60) -> list[tuple[int, str, str]]:
    return finish(start(tmp_path, argvs, ranks), timeout)


def wait_for_server(url: str, procs: list[subprocess.Popen], seconds: float = 90) -> None:
    """Until the server on rank 0 answers (two ranks load beside other test workers on 2 cores)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(f"{url}/models", timeout=2)
            return
        except OSError:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "server did not start"
            time.sleep(0.2)


def single(store, layerwise: bool = False, **options):
    """(tokens, stats) of one process prefilling as the ranks did (`layerwise`: layer by layer, else
    chunk by chunk), with the prompt's last token in the first step (rank 0 feeds it there, since
    every rank runs that step's hooks); stats["alone_layerwise"]: whether one process prefills this
    model layer by layer when left to itself."""
    engine = edge0.load(store, **options)
    alone = engine.prefiller.layerwise
    engine.prefiller.layerwise = layerwise
    engine.stepper.hooks.sees_first_forward = True
    res = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True)
    return res.tokens, {**engine.stats(), "alone_layerwise": alone}


# deepseek_v3 behind -m slow, with the three-rank test that runs its dense first layer too
@pytest.mark.parametrize("family", [f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.slow) for f in SPLITS])
def test_two_ranks_give_the_single_process_tokens_reading_only_their_layers(family, store_for, heads, tmp_path):
    store = store_for(family)
    runs = [
        {"store": str(store), "options": {"prerouter": False}},  # split balanced by bytes
        {"store": str(store), "options": {"prerouter": str(heads[family]), "pipeline_split": SPLITS[family]}},
    ]
    if family == "qwen3_moe":
        # each rank adapts its own layers' linears
        adapter, _, random_adapter_paths = random_adapter(store, tmp_path / "lora.safetensors")
        runs.append({"store": str(store), "options": {"prerouter": False, "lora": str(adapter)}})
        # a tied head: the embedding on rank 1, and again on rank 0 as the head
        runs.append({"store": str(store_for(family, tie_word_embeddings=True)), "options": {"prerouter": False}})
        # deepseek_v41 rides along (a launch's start-up is most of its cost): its stages pass on
        # their residual streams and compressed state (V41)
        runs.append({"store": str(store_for("deepseek_v41", **V41)), "options": {"prerouter": False}})
    for run in runs:
        run.update(prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True)
    # reused KV across requests: a conversation, an unrelated one, the first one extended (a cache
    # of another conversation taken from the memory pool gave other tokens across ranks)
    first = PROMPT * 12  # over a pool block
    # ... and a next turn that branches off inside the last reply (deepseek_v41's cache cannot be
    # cut back: it starts again, on every rank)
    turns = [first, "an unrelated request about disks " * 16, first + " and then", first + " and then more"]
    runs[0]["turns"] = runs[-1]["turns"] = turns
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    argv = [sys.executable, str(ROOT / "tests" / "dist_worker.py"), str(tmp_path / "runs.json")]
    done = launch(tmp_path, [argv + [str(tmp_path / f"out-{r}.json")] for r in range(2)])
    assert [rc for rc, _, _ in done] == [0, 0], [err[-2000:] for _, _, err in done]
    out = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(2)]
    # a peer machine gone silent (asleep, off the network) is found by the kernel's keepalive
    # probes in about --peer-timeout (60 s): first after 30 s of silence, every 10 s, 3 unanswered
    want_alive = {"keepalive": 1, "TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3, "TCP_USER_TIMEOUT": 60000}
    for o in out:
        assert o[0]["keepalive"] and all(k == want_alive for k in o[0]["keepalive"]), o[0]["keepalive"]

    for i, run in enumerate(runs):
        alone = {k: v for k, v in run["options"].items() if k != "pipeline_split"}  # one process has no split
        got = out[0][i]
        # mlx-lm pipelines these families: each rank feeds its layers a span at a time, and reads
        # each layer's experts once per span, as one process does (compared per layer below)
        # (deepseek_v41's stages run mlx-lm's layers in their own forward: chunk by chunk)
        v41 = "deepseek_v41" in Path(run["store"]).name
        assert [o[i]["layerwise"] for o in out] == [not v41] * 2, f"run {i}"
        want, want_stats = single(run["store"], got["layerwise"], **alone)
        manifest = json.loads((Path(run["store"]) / "edge0-manifest.json").read_text())
        assert got["tokens"] == want, f"run {i} ({Path(run['store']).name})"
        if "turns" in run:
            cold = edge0.load(run["store"], **alone)
            cold.prefiller.layerwise = False
            want_turns = [cold.generate(t, max_tokens=TOKENS, ignore_eos=True).tokens for t in run["turns"]]
            assert got["turns"] == want_turns, f"run {i} turns"
        # the same calls, routed experts, host syncs, drops and reads beyond the misses (a
        # prefill's) per layer as in one process, less what was read ahead for nothing (a layer
        # reads ahead for the next one on its own rank only: here each rank holds one; a
        # prediction takes a slot when it is read, so which routes hit may differ)
        keys = ("calls", "host_syncs", "dropped")

        def per_layer(layers):
            return {
                int(l): [s[k] for k in keys]
                + [s["hits"] + s["misses"], s["loads"] - s["lookahead_reads"] + s["lookahead_used"] - s["misses"]]
                for l, s in layers.items()
            }

        assert per_layer(got["layer_stats"]) == per_layer(want_stats["layers"]), f"run {i}"
        # each rank opened exactly its own MoE layers' expert files, each once
        ranks = [o[i] for o in out]
        assert sorted(ranks[0]["moe_layers"] + ranks[1]["moe_layers"]) == [
            l["layer"] for l in manifest["expert_layers"]
        ]
        for r in ranks:
            assert r["moe_layers"] and sorted(r["opened"]) == sorted(Path(expert_file(l)).name for l in r["moe_layers"])
        assert [r["rank"] for r in got["ranks"]] == [0, 1]
        if "lora" in run["options"]:  # the adapter's linears, each on the rank that runs its layer
            assert sorted(ranks[0]["lora"] + ranks[1]["lora"]) == sorted(random_adapter_paths)
            assert all(int(p.split(".")[2]) in r["layers"] for r in ranks for p in r["lora"])
    # with heads, a layer on rank 0 is routed by the head of the layer before it, on rank 1
    boundary = str(out[0][1]["moe_layers"][0])
    assert out[0][1]["prerouter"]["routed_by_head"][boundary] == TOKENS - 1
    assert out[0][1]["layer_stats"][boundary]["dropped"] == 0


@pytest.mark.slow  # one launch
def test_on_two_ranks_only_a_prompt_with_no_row_decoding_seeds_the_decode_slots(store_for, tmp_path):
    """A prefill's whole-layer reads seed the decode slots on every rank as in one process, and
    a prompt prefilled while another decodes seeds none on any rank: rank 0 tells the others.
    Each rank's share of the budget gives its layers 4 slots of 8, as one process's whole budget
    does; no lookahead, so every rank's slots hold what one process's hold."""
    store = store_for("qwen3_moe")
    probe = edge0.load(store, prerouter=False)
    per_slot = sum(probe.store.expert_nbytes(l) for l in probe.store.layers)
    assert len(probe.store.layers) % 2 == 0 and len({probe.store.expert_nbytes(l) for l in probe.store.layers}) == 1
    batch = [PROMPT * 3, "the sea and the sky " * 6]
    options = {"prerouter": False, "lookahead": "off", "decode_executor": "staged"}
    run = {"store": str(store), "options": {**options, "expert_cache": 2 * per_slot}, "batch": batch}
    run.update(prompt=PROMPT * 3, max_tokens=TOKENS, ignore_eos=True)
    (tmp_path / "runs.json").write_text(json.dumps([run]))
    argv = [sys.executable, str(ROOT / "tests" / "dist_worker.py"), str(tmp_path / "runs.json")]
    done = launch(tmp_path, [argv + [str(tmp_path / f"out-{r}.json")] for r in range(2)])
    assert [rc for rc, _, _ in done] == [0, 0], [err[-2000:] for _, _, err in done]
    got = json.loads((tmp_path / "out-0.json").read_text())[0]
    engine = edge0.load(store, **options, expert_cache=4 * per_slot)
    engine.prefiller.layerwise = got["layerwise"]
    engine.stepper.hooks.sees_first_forward = True
    assert engine.generate(run["prompt"], max_tokens=TOKENS, ignore_eos=True).tokens == got["tokens"]
    after_one = {int(l): s["seeded"] for l, s in engine.stats()["layers"].items()}
    assert got["batch"] == [r.tokens for r in engine.generate_batch(batch, max_tokens=TOKENS, ignore_eos=True)]
    want = {int(l): s["seeded"] for l, s in engine.stats()["layers"].items()}
    assert {int(l): s["seeded"] for l, s in got["layer_stats"].items()} == after_one
    assert {int(l): s["seeded"] for l, s in got["batch_layer_stats"].items()} == want
    # the first MoE layer (on rank 1) seeded for the prompt and for the batch's first prompt (the
    # last, which computes only a prompt's last token in a layer-major prefill, reads nothing whole)
    first = min(after_one)
    assert 0 < after_one[first] < want[first]


@pytest.mark.slow  # 7-11 s of launches: behind -m slow to keep the suite under 5 minutes on 2 cores
def test_deepseek_v41_three_ranks_carry_the_streams_and_compressed_state_through_a_middle_stage(store_for, tmp_path):
    # rank 1 runs layers 1-2: it receives the message of layer 0's stage and sends layer 2's on
    store = store_for("deepseek_v41", **V41_WIDE)
    options = {"prerouter": False, "pipeline_split": "1,2,1"}
    (tmp_path / "runs.json").write_text(
        json.dumps(
            [{"store": str(store), "options": options, "prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True}]
        )
    )
    argv = [sys.executable, str(ROOT / "tests" / "dist_worker.py"), str(tmp_path / "runs.json")]
    done = launch(tmp_path, [argv + [str(tmp_path / f"out-{r}.json")] for r in range(3)], ranks=3)
    assert [rc for rc, _, _ in done] == [0, 0, 0], [err[-2000:] for _, _, err in done]
    out = [json.loads((tmp_path / f"out-{r}.json").read_text())[0] for r in range(3)]
    assert [o["layers"] for o in out] == [[3], [1, 2], [0]]
    assert out[0]["tokens"] == single(store, prerouter=False)[0]


def test_a_family_whose_stages_pass_on_more_than_the_hidden_state_is_refused_without_an_adapter(store_for):
    from edge0.backend import io as bio
    from edge0.backend import stages as bstages

    config = json.loads((store_for("deepseek_v41") / "config.json").read_text())
    model = bio.build_model(config, store_for("deepseek_v41"))
    assert bstages.num_layers(model) == 2  # carried: its stages run HyperConnectionStage
    model.model_type = "deepseek_v41_next"  # the same exchange, but no adapter here
    with pytest.raises(Edge0Error, match=r"'deepseek_v41_next': mlx-lm's pipeline passes more than the hidden state"):
        bstages.num_layers(model)


@pytest.mark.slow  # 7-11 s of launches: behind -m slow to keep the suite under 5 minutes on 2 cores
def test_three_ranks_pass_the_hidden_state_through_a_middle_stage(store_for, heads, tmp_path):
    # deepseek_v3: rank 2 runs the dense layer 0 (no experts at all), rank 1 the head's owner
    # (MoE layer 1), rank 0 its consumer (MoE layer 2)
    store = store_for("deepseek_v3")
    options = {"prerouter": str(heads["deepseek_v3"]), "pipeline_split": "1,1,1"}
    (tmp_path / "runs.json").write_text(
        json.dumps(
            [{"store": str(store), "options": options, "prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True}]
        )
    )
    argv = [sys.executable, str(ROOT / "tests" / "dist_worker.py"), str(tmp_path / "runs.json")]
    done = launch(tmp_path, [argv + [str(tmp_path / f"out-{r}.json")] for r in range(3)], ranks=3)
    assert [rc for rc, _, _ in done] == [0, 0, 0], [err[-2000:] for _, _, err in done]
    out = [json.loads((tmp_path / f"out-{r}.json").read_text())[0] for r in range(3)]
    assert [o["moe_layers"] for o in out] == [[2], [1], []] and out[2]["opened"] == []
    assert out[0]["tokens"] == single(store, prerouter=options["prerouter"])[0]


@pytest.mark.slow  # 7-11 s of launches: behind -m slow to keep the suite under 5 minutes on 2 cores
def test_generate_under_mlx_launch_prints_the_single_process_text(store_for, tmp_path):
    launcher = Path(sys.executable).parent / "mlx.launch"  # installed with mlx
    if not launcher.is_file():
        pytest.skip(f"no {launcher}")
    store = store_for("qwen3_moe")
    prompt = ["--prompt", PROMPT, "--max-tokens", str(TOKENS), "--no-chat-template"]
    engine = edge0.load(store)
    want = engine.generate(PROMPT, max_tokens=TOKENS).text
    port = free_port_pair()
    p = subprocess.run(
        [
            str(launcher),
            "-n",
            "2",
            "--backend",
            "ring",
            "--starting-port",
            str(port),
            "--",
            sys.executable,
            "-m",
            "edge0",
            "generate",
            "--model",
            str(store),
            *prompt,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout == want + "\n"  # only rank 0 writes the text
    assert "rank 0 of 2: layers 1-1 + norm and head:" in p.stderr and "rank 1 of 2: layers 0-0 + embedding:" in p.stderr


@pytest.mark.slow  # in the default suite's time budget: a rank's one-line stop stays covered by the kill test
def test_a_missing_peer_is_a_one_line_error(store_for, tmp_path):
    argv = [
        sys.executable,
        "-m",
        "edge0",
        "generate",
        "--model",
        str(store_for("qwen3_moe")),
        "--prompt",
        "hi",
        "--peer-timeout",
        "1",
    ]
    [(rc, out, err)] = launch(tmp_path, [argv], ranks=2, timeout=30)  # rank 0 accepts: its timeout applies
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "edge0: error: rank 0 of 2: could not reach its peers at 127.0.0.1:" in err


def under_way(procs: list[subprocess.Popen]) -> None:
    """Until rank 0 of `edge0 generate` has streamed some of its reply: the request is under way
    on both ranks."""
    fd = procs[0].stdout.fileno()
    os.set_blocking(fd, False)
    deadline, text = time.monotonic() + 90, b""
    while len(text) < 40:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no tokens came"
        try:
            text += os.read(fd, 4096)
        except BlockingIOError:
            time.sleep(0.05)
    os.set_blocking(fd, True)


def signal_mid_request(store, tmp_path, rank: int, sig, peer_timeout: str | None = None):
    """`edge0 generate` on 2 ranks; once the request is under way, `sig` to `rank`: (the processes,
    the other rank's process, its stderr, the seconds it took to exit). Nothing is left running."""
    argv = [sys.executable, "-m", "edge0", "generate", "--model", str(store)]
    argv += ["--peer-timeout", peer_timeout] if peer_timeout else []
    argv += ["--prompt", PROMPT, "--no-chat-template", "--max-tokens", "100000"]
    procs = start(tmp_path, [argv, argv])
    try:
        under_way(procs)
        os.killpg(procs[rank].pid, sig)
        t0 = time.monotonic()
        other = procs[1 - rank]
        _, err = other.communicate(timeout=30)
        return procs, other, err, time.monotonic() - t0
    finally:
        if procs[rank].poll() is None:  # a stopped process takes SIGKILL
            os.killpg(procs[rank].pid, signal.SIGKILL)
        finish(procs, 5)


@pytest.mark.parametrize("killed", [pytest.param(0, marks=pytest.mark.slow), 1])  # rank 0 killed: -m slow (suite time)
def test_killing_either_rank_mid_request_stops_the_other_with_one_line(killed, store_for, tmp_path):
    procs, other, err, waited = signal_mid_request(store_for("qwen3_moe"), tmp_path, killed, signal.SIGKILL)
    errors = [line for line in err.splitlines() if "error" in line.lower() and not line.startswith("[ring]")]
    assert other.returncode == 2, err[-2000:]
    assert waited < 20 and "Traceback" not in err
    assert errors == [errors[0]] and errors[0].startswith(f"edge0: error: rank {1 - killed} of 2: lost a peer rank")
    assert other.poll() is not None and procs[killed].poll() is not None  # nothing left running


@pytest.mark.parametrize(
    "stopped", [pytest.param(0, marks=pytest.mark.slow), 1]
)  # rank 0 stopped: -m slow (suite time)
def test_a_rank_stopped_mid_request_stops_the_other_with_one_line_within_the_peer_timeout(stopped, store_for, tmp_path):
    """SIGSTOP: the process is stuck but its machine answers (TCP keepalives are no help); its
    heartbeat stops, and the rank waiting for it gives up after --peer-timeout seconds."""
    _, other, err, waited = signal_mid_request(store_for("qwen3_moe"), tmp_path, stopped, signal.SIGSTOP, "3")
    errors = [line for line in err.splitlines() if "error" in line.lower() and not line.startswith("[ring]")]
    assert other.returncode == 2, err[-2000:]
    assert 2.5 < waited < 15 and "Traceback" not in err
    assert errors == [
        f"edge0: error: rank {1 - stopped} of 2: rank {stopped} sent no heartbeat for 3 s (--peer-timeout): "
        "it is stopped or stuck while its machine still answers; stop it (its own output may say why) "
        "and start every rank again"
    ], errors


@pytest.mark.slow  # in the default suite's time budget: a rank's one-line stop stays covered by the kill test
def test_ranks_with_different_stores_stop_with_one_line(store_for, tmp_path):
    argvs = [
        [sys.executable, "-m", "edge0", "generate", "--model", str(store_for(f)), "--prompt", "hi"]
        for f in ("qwen3_moe", "deepseek_v3")
    ]
    for rank, (rc, out, err) in enumerate(launch(tmp_path, argvs)):
        assert rc == 2 and out == ""
        assert (
            err.count("\n") == 1
            and f"edge0: error: rank {rank}: the store (manifest hash) differs between ranks" in err
        )
