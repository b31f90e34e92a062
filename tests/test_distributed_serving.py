"""The server across ranks (edge0.distributed): it listens on rank 0 while the other rank follows,
decodes concurrent requests together, keeps an agent's conversations in the pool of prompt caches
(mirrored on the other ranks), and exits with one line when the other rank is killed. Launches and
helpers from test_distributed.py."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

import edge0
from tests.test_distributed import PROMPT, ROOT, TOKENS, finish, free_ports, start, wait_for_server


def test_the_server_listens_on_rank_0_and_the_other_rank_follows(store_for, tmp_path):
    store = store_for("qwen3_moe")
    want = edge0.load(store).generate(PROMPT, max_tokens=TOKENS).text
    port = free_ports(1)[0]
    argv = [sys.executable, "-m", "edge0.serve", "--model", str(store), "--port", str(port), "--log-level", "warning"]
    procs = start(tmp_path, [argv, argv])
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_for_server(url, procs)
        body = json.dumps({"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/completions", body, {"content-type": "application/json"})
        got = json.load(urllib.request.urlopen(req, timeout=30))["choices"][0]["text"]
        stats = json.load(urllib.request.urlopen(f"{url}/stats", timeout=10))["engine"]
        procs[0].send_signal(signal.SIGINT)  # rank 0 shuts down and releases rank 1
    finally:
        done = finish(procs, 20)
    assert got == want
    assert [r["rank"] for r in stats["ranks"]] == [0, 1] and all(r["forwards"] > 0 for r in stats["ranks"])
    # rank 0 was interrupted (130, as for any verb), after ending its requests and releasing rank 1
    assert [rc for rc, _, _ in done] == [130, 0], [err[-2000:] for _, _, err in done]
    assert "Traceback" not in done[0][2] + done[1][2]


def test_the_server_on_two_ranks_decodes_four_requests_together_each_as_alone(store_for, tmp_path):
    """Continuous batching across ranks: four concurrent requests share decode steps (each rank
    runs the batch's rows for its layers) and each gets the reply it gets alone in one process."""
    from concurrent.futures import ThreadPoolExecutor

    store = store_for("qwen3_moe")
    prompts = [PROMPT, "the sea " * 9, PROMPT + " and a dragon", "why " * 3]
    alone = edge0.load(store, prerouter=False)
    alone.prefiller.layerwise = False
    want = [alone.generate(p, max_tokens=TOKENS, ignore_eos=True).text for p in prompts]
    port = free_ports(1)[0]
    argv = [sys.executable, "-m", "edge0.serve", "--model", str(store), "--port", str(port), "--no-prerouter"]
    argv += ["--max-batch", "4"]
    procs = start(tmp_path, [argv + ["--log-level", "warning"]] * 2)
    url = f"http://127.0.0.1:{port}/v1"

    def complete(prompt):
        body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(
            f"{url}/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        return json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["text"]

    try:
        wait_for_server(url, procs)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(complete, prompts))
        stats = json.load(urllib.request.urlopen(f"{url}/stats", timeout=10))
        procs[0].send_signal(signal.SIGINT)
    finally:
        done = finish(procs, 20)
    assert got == want
    batching = stats["server"]["batching"]
    assert batching["max_batch"] == 4 and batching["most_rows"] == 4, batching
    assert [rc for rc, _, _ in done] == [130, 0], [err[-2000:] for _, _, err in done]


def _agent_session(url: str) -> list[tuple[str, int]]:
    """An agent's chat requests (its main thread, a side request, a subagent with the same system
    prompt, the main thread's next turn, the subagent's next turn): (reply, cached prompt tokens)."""
    system = {"role": "system", "content": PROMPT * 8}
    main = [system, {"role": "user", "content": "count the stars"}]
    sub = [system, {"role": "user", "content": "count the moons"}]
    out = []

    def chat(messages):
        body = {"messages": messages, "max_tokens": TOKENS, "temperature": 0}
        req = urllib.request.Request(
            f"{url}/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        r = json.load(urllib.request.urlopen(req, timeout=60))
        reply = r["choices"][0]["message"]["content"]
        out.append((reply, r["usage"]["prompt_tokens_details"]["cached_tokens"]))
        return {"role": "assistant", "content": reply}

    main.append(chat(main))
    chat([{"role": "user", "content": "a title for this chat"}])
    sub.append(chat(sub))
    chat(main + [{"role": "user", "content": "and the planets"}])
    chat(sub + [{"role": "user", "content": "and the suns"}])
    return out


def test_an_agent_session_on_a_hybrid_family_reuses_its_prefixes_on_two_ranks_as_in_one_process(store_for, tmp_path):
    """Linear attention beside KV caches (qwen3_next): each conversation's next turn finds its
    earlier turn in the pool of prompt caches, which rank 1 mirrors for its layers."""
    store = store_for("qwen3_next")
    argv = [sys.executable, "-m", "edge0.serve", "--model", str(store), "--no-prerouter", "--log-level", "warning"]
    sessions = []
    for ranks in (1, 2):
        port = free_ports(1)[0]
        cmd = argv + ["--port", str(port), "--prompt-cache-dir", str(tmp_path / f"pc-{ranks}")]
        if ranks == 1:
            env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")} | {"PYTHONPATH": str(ROOT)}
            procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, text=True, stderr=subprocess.PIPE)]
        else:
            procs = start(tmp_path, [cmd] * 2)
        url = f"http://127.0.0.1:{port}/v1"
        try:
            wait_for_server(url, procs)
            sessions.append(_agent_session(url))
            procs[0].send_signal(signal.SIGINT)
        finally:
            finish(procs, 20)
    one, two = sessions
    assert two == one
    assert all(cached > 0 for _, cached in one[3:])  # the later turns reuse their first turns' prefixes


@pytest.mark.slow  # suite time: test_killing_either_rank_mid_request stays
def test_the_server_exits_with_one_line_when_the_other_rank_is_killed_mid_request(store_for, tmp_path):
    port = free_ports(1)[0]
    argv = [sys.executable, "-m", "edge0.serve", "--model", str(store_for("qwen3_moe")), "--port", str(port)]
    procs = start(tmp_path, [argv + ["--log-level", "warning"]] * 2)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_for_server(url, procs)
        body = json.dumps({"prompt": PROMPT, "max_tokens": 100000, "temperature": 0, "stream": True}).encode()
        req = urllib.request.Request(f"{url}/completions", body, {"content-type": "application/json"})
        stream = urllib.request.urlopen(req, timeout=30)
        for _ in range(5):  # tokens are coming: the request runs on both ranks
            assert stream.readline().startswith(b"data: {") and stream.readline() == b"\n"
        os.killpg(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        rest = stream.read().decode()
        _, err = procs[0].communicate(timeout=30)
        waited = time.monotonic() - t0
    finally:
        finish(procs, 5)
    assert procs[0].returncode == 2 and waited < 20, err[-2000:]
    assert '"error"' in rest  # the open stream ends with an error event
    ours = [line for line in err.splitlines() if not line.startswith("[ring]")]  # MLX's own lines aside
    assert ours[-1].startswith("edge0: error: rank 0 of 2: lost a peer rank")
    assert "Traceback" not in err and sum("error" in line.lower() for line in ours) == 1, err[-2000:]


def test_a_rank_low_on_memory_shrinks_its_own_expert_cache_between_generations(store_for, tmp_path):
    """Rank 1's memory watcher (as `edge0 serve --memory-low` starts on every rank) reads no memory
    left: between generations its expert cache shrinks to one route's slots, and rank 0 frees the
    other conversations' KV caches of its pool, which rank 1 holds its share of; the tokens stay
    one process's."""
    from tests.test_distributed import launch, single
    from tests.test_distributed_families import agent_session

    store = store_for("qwen3_moe")
    options = {"prerouter": False, "prompt_cache_memory": "64MB"}
    runs = [{"store": str(store), "options": options, "follower_memory_low": True}]
    runs[0].update(prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True, turns=[PROMPT + " again"])
    runs[0]["session"] = agent_session()
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    argv = [sys.executable, str(ROOT / "tests" / "dist_worker.py"), str(tmp_path / "runs.json")]
    done = launch(tmp_path, [argv + [str(tmp_path / f"out-{r}.json")] for r in range(2)])
    assert [rc for rc, _, _ in done] == [0, 0], [err[-2000:] for _, _, err in done]
    rank0, rank1 = (json.loads((tmp_path / f"out-{r}.json").read_text())[0] for r in range(2))
    assert rank0["tokens"] == single(store, rank0["layerwise"], prerouter=False)[0]
    cache = rank1["expert_cache"]
    assert cache["slots_per_layer"] == cache["min_slots"] < cache["configured_slots"]
    # rank 1 asked, rank 0 freed: its pool's bound came down and conversations left every rank
    ranks, pool = rank0["after_session"]["ranks"], rank0["after_session"]["pool"]
    assert ranks[1]["kv_free_wanted"] > 0 and ranks[0]["kv_freed_for_others"] > 0
    assert pool["evicted"] > 0 and pool["max_bytes"] == 0  # no memory left on rank 1: the bound went to 0
