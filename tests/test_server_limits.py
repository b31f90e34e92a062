"""Issue 35, the server's bounds before the queue: every character a request makes the template
render is counted before it is rendered, tokenizations are bounded (running and waiting), and
connections are capped and timed out; under each attack /health keeps answering and the
process's memory comes back. The process tests use tests/fake_server.py, as the hostile battery does."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from edge0.server.config import ServerConfig
from edge0.server.connections import RESERVED_FDS, AcceptErrors, raise_fd_limit
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server, wait_until_healthy
from tests.fixtures.hostile import CHAT, COUNT, MESSAGES, MODEL, anthropic, chat
from tests.test_server_hostile import AUTH, KEY, check_error, rss_kib, send, server_process

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS and descriptors in /proc")

# Bounds the attacks below must stay within (measured values are printed with -s).
# The slowest /health answer during an attack: the attackers share the 2 CPU cores with the server
# (without the bounds, /health did not answer at all: it timed out). Alone it answered within
# 0.5 s; beside the rest of the suite on 2 cores, once in 2.9 s: the bound leaves room for that.
HEALTH_S = 5.0
RSS_BACK = 1.10  # RSS after an attack, against before it


def tool_with_keys(n: int, key_chars: int) -> dict:
    """A tool whose text is all in its parameter names (the values are empty schemas)."""
    props = {f"{'k' * key_chars}{i}": {} for i in range(n)}
    return {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}


@pytest.fixture(scope="module")
def small():
    """A server whose prompt limit is 2048 tokens (about 34,000 characters of the fake's vocabulary)."""
    engine = FakeEngine(tokenize_s=0.3)
    with running_server(engine, ServerConfig(max_prompt_tokens=2048, max_queue=4)) as base:
        yield engine, base


@pytest.mark.parametrize(
    "path, body",
    [
        pytest.param(CHAT, chat("hi", tools=[tool_with_keys(60, 1000)]), id="keys"),
        pytest.param(
            CHAT,
            chat("hi", tools=[{"type": "function", "function": {"name": "f", "parameters": {"enum": [""] * 40_000}}}]),
            id="empty-strings",
        ),
        pytest.param(CHAT, chat("hi", tools=[{"type": "function", "function": {"name": "f" * 40_000}}]), id="name"),
        pytest.param(
            COUNT,
            anthropic("hi", tools=[{"name": "f", "input_schema": {"properties": {"k" * 40_000: {}}}}]),
            id="count-tokens",
        ),
    ],
)
def test_text_in_tool_keys_counts_before_anything_is_rendered(small, path, body):
    engine, base = small
    before = engine.tokenizer.encoded_chars
    r = httpx.post(base + path, json=body, timeout=30)
    check_error(path, r, 400)
    assert "characters, more than this server's limit of 2048 tokens" in r.text
    assert engine.tokenizer.encoded_chars == before  # refused without rendering or tokenizing


def test_tokenizations_are_bounded_and_the_rest_refused_at_once(small):
    engine, base = small
    body = anthropic("hello")
    body.pop("max_tokens")

    before = engine.tokenizer.encoded_chars
    assert httpx.post(base + COUNT, json=body, timeout=30).status_code == 200
    one = engine.tokenizer.encoded_chars - before  # characters one request tokenizes

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda _: httpx.post(base + COUNT, json=body, timeout=30), range(20)))
    statuses = [r.status_code for r in results]
    assert engine.max_tokenizing == 2  # ServerConfig.tokenize_concurrency
    assert set(statuses) == {200, 429} and statuses.count(200) >= 6, statuses  # 2 running + 4 waiting (--max-queue)
    assert engine.tokenizer.encoded_chars - before == one * (1 + statuses.count(200))  # the refused: never rendered
    for r in results:
        if r.status_code == 429:
            check_error(COUNT, r, 429)
            assert "--max-queue" in r.json()["error"]["message"]
    stats = httpx.get(base + "/v1/stats", timeout=5).json()["server"]
    assert stats["tokenizing_peak"] == 2 and stats["tokenize_refused"] == statuses.count(429)


class Health:
    """/health probed every 50 ms in a thread while an attack runs: the slowest answer."""

    def __init__(self, base: str):
        self.base, self.times, self.stop = base, [], threading.Event()
        self.thread = threading.Thread(target=self._probe)

    def _probe(self):
        with httpx.Client(timeout=10) as client:
            while not self.stop.wait(0.05):
                started = time.monotonic()
                try:
                    ok = client.get(self.base + "/health").status_code == 200
                except httpx.TransportError:
                    ok = False
                self.times.append(time.monotonic() - started if ok else float("inf"))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(15)

    @property
    def slowest(self) -> float:
        return max(self.times)


ATTACK = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
import httpx
base, path, n, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
body = sys.stdin.buffer.read()
headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
with ThreadPoolExecutor(n) as pool:
    answers = pool.map(lambda _: httpx.post(base + path, content=body, headers=headers, timeout=120), range(n))
    print(json.dumps([r.status_code for r in answers]))
"""


def attack(base: str, path: str, body: dict, n: int) -> list[int]:
    """`n` copies of `body` sent at once from another process (so that the senders' threads do not
    hold this process's GIL while it times /health); their statuses."""
    out = subprocess.run(
        [sys.executable, "-c", ATTACK, base, path, str(n), KEY],
        input=json.dumps(body).encode(),
        capture_output=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout)


def warm(base: str) -> None:
    assert send(base, CHAT, chat("hi")).status_code == 200
    assert send(base, CHAT, chat("x" * 300_000)).status_code == 400


def test_prompt_attacks_keep_health_answering_and_give_memory_back(capsys):
    """64 prompts just under the character check at once (each tokenized, then refused for its
    token count), then six tools of 3.9 MB of parameter names."""
    args = ["--api-key", KEY, "--max-prompt-tokens", "16384", "--max-queue", "4", "--tokenize-s", "0.02"]
    with server_process(*args) as (proc, base):
        warm(base)
        time.sleep(0.3)
        idle = rss_kib(proc.pid)
        with Health(base) as health:
            # the limit is 16384 tokens x 16 characters = 262,144: tokenized, then refused
            statuses = attack(base, CHAT, chat("x" * 250_000), 64)
            tool_statuses = attack(base, CHAT, chat("hi", tools=[tool_with_keys(3_900, 1_000)]), 6)
        peak = rss_kib(proc.pid, "VmHWM")
        time.sleep(0.5)
        after = rss_kib(proc.pid)
        stats = httpx.get(base + "/v1/stats", headers=AUTH, timeout=5).json()["server"]
    with capsys.disabled():
        print(
            f"\nprompt attack: RSS idle {idle / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB, "
            f"after {after / 1024:.1f} MiB; "
            f"slowest /health {health.slowest * 1000:.0f} ms; statuses {sorted(set(statuses))}, "
            f"tokenizing peak {stats['tokenizing_peak']}, refused {stats['tokenize_refused']}"
        )
    # how many arrive while 6 are in (2 tokenizing, 4 waiting) depends on the machine's load: 58 on
    # an idle one, 36 seen beside a parallel test suite; each 429 is one the bound refused
    assert set(statuses) <= {400, 429} and statuses.count(429) >= 16, statuses
    assert stats["tokenize_refused"] >= statuses.count(429)
    assert tool_statuses == [400] * 6
    assert stats["tokenizing_peak"] <= 2
    assert health.slowest < HEALTH_S and after <= idle * RSS_BACK


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def many_sockets(base: str, n: int):
    """`n` connections to the server that send nothing (raising this process's descriptor limit
    above what it holds already: a test worker that ran other files may hold hundreds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = fd_count(os.getpid()) + n + 512
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, need)), hard))
    host, port = base.removeprefix("http://").split(":")
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection((host, int(port)), timeout=5)
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def closed_by_server(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_cannot_lock_clients_out(capsys):
    """1,000 connections that send nothing, against a cap of 32: the oldest idle ones are closed
    to make room, so /health and a chat still answer, and the server holds at most the cap."""
    cap = 32
    with server_process("--max-connections", str(cap), "--header-timeout-s", "1.5") as (proc, base):
        warm(base)
        time.sleep(0.3)
        idle_rss, idle_fds = rss_kib(proc.pid), fd_count(proc.pid)
        with many_sockets(base, 1000) as socks, Health(base) as health:
            # until the server has accepted them all (under load that takes longer than 0.5 s)
            deadline = time.monotonic() + 20
            while httpx.get(base + "/v1/stats", timeout=5).json()["server"]["connections_evicted"] < 1000 - cap:
                assert time.monotonic() < deadline, "the server did not accept the 1,000 connections in 20 s"
                time.sleep(0.1)
            time.sleep(0.2)  # an evicted connection's descriptor closes on the event loop's next turn
            held_fds = fd_count(proc.pid)
            started = time.monotonic()
            assert send(base, CHAT, chat("hi")).status_code == 200
            chat_s = time.monotonic() - started
            closed = sum(closed_by_server(s) for s in socks)
        stats = httpx.get(base + "/v1/stats", timeout=5).json()["server"]
        after = rss_kib(proc.pid)
    with capsys.disabled():
        print(
            f"\nidle connections: 1000 opened, {closed} closed by the server, descriptors {idle_fds} idle -> "
            f"{held_fds} held; slowest /health {health.slowest * 1000:.0f} ms, chat {chat_s * 1000:.0f} ms; "
            f"RSS {idle_rss / 1024:.1f} -> {after / 1024:.1f} MiB; {stats['connections_evicted']} evicted"
        )
    assert held_fds <= idle_fds + cap + 4
    assert closed >= 1000 - cap and stats["connections_evicted"] >= 1000 - cap
    assert health.slowest < HEALTH_S and chat_s < HEALTH_S and after <= idle_rss * RSS_BACK


def health_on(s: socket.socket) -> bytes:
    """GET /health on an open connection: the whole answer (its body is a JSON object)."""
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = b""
    while not answer.endswith(b"}"):
        chunk = s.recv(4096)
        assert chunk, answer
        answer += chunk
    return answer


def stream_lines(base: str, body: dict) -> list[str]:
    with httpx.stream("POST", base + CHAT, json=body, timeout=30) as r:
        return [line for line in r.iter_lines() if line.startswith("data:")]


def test_headers_and_bodies_that_trickle_are_cut_off_and_a_stream_outlives_every_timeout():
    args = ["--header-timeout-s", "1", "--body-timeout-s", "1", "--idle-timeout-s", "2.5", "--delay", "0.01"]
    with server_process(*args) as (proc, base):
        # a streamed reply of 290 tokens at 10 ms (2.9 s), alongside: longer than each timeout
        lines, started = [], time.monotonic()
        stream = threading.Thread(target=lambda: lines.extend(stream_lines(base, chat("count 100", stream=True))))
        stream.start()
        host, port = base.removeprefix("http://").split(":")
        headers = socket.create_connection((host, int(port)), timeout=5)
        headers.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never ends its headers
        body = socket.create_connection((host, int(port)), timeout=5)
        body.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        started = time.monotonic()
        assert headers.recv(100) == b"" and 0.9 < time.monotonic() - started < 3
        answer = b""
        while chunk := body.recv(4096):  # the server closes it after the answer
            answer += chunk
        answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408") and "--body-timeout-s" in answer and "connection: close" in answer
        idle = socket.create_connection((host, int(port)), timeout=5)  # between requests: not a header wait
        assert health_on(idle).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)
        assert health_on(idle).startswith(b"HTTP/1.1 200")
        for s in (headers, body, idle):
            s.close()
        stream.join(30)
    assert lines[-1] == "data: [DONE]" and len(lines) > 250 and time.monotonic() - started > 2.5


def test_accept_errors_are_logged_once_a_minute(caplog):
    handler = AcceptErrors()
    context = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    with caplog.at_level(logging.WARNING, logger="edge0.server"):
        for _ in range(1000):
            handler(None, context)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "Too many open files" in lines[0] and "--max-connections" in lines[0]
    assert handler.count == 999  # the rest, reported with the next line


def test_descriptor_limit_is_raised_to_fit_the_cap():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (RESERVED_FDS + 10, hard))
        assert raise_fd_limit(128) == 128
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= RESERVED_FDS + 128
        if hard != resource.RLIM_INFINITY:
            assert raise_fd_limit(hard) == hard - RESERVED_FDS  # what the hard limit leaves
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_no_page_loads_a_script_from_elsewhere(small):
    """FastAPI's /docs and /redoc load scripts from a CDN on the origin that holds the chat page's key."""
    _, base = small
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert httpx.get(base + path, timeout=5).status_code == 404
    assert httpx.get(base + "/openapi.json", timeout=5).json()["info"]["title"] == "edge0"
    for path in ("/", "/ui/app.js", "/ui/markdown.js", "/ui/stats.js", "/ui/api.js", "/ui/store.js"):
        r = httpx.get(base + path, timeout=5)
        assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
        assert "http://" not in r.text.replace("http://127.0.0.1", "") and "https://" not in r.text, path


def test_a_lone_surrogate_quoted_in_an_error_is_escaped():
    """JSON may carry a lone surrogate (\\ud800), which UTF-8 cannot encode: quoting one in an
    error message made the error itself a 500."""
    with running_server(FakeEngine(), ServerConfig(strict_model_name=True)) as base:
        for path, body, status in (
            (CHAT, chat("hi", model="\ud800"), 404),
            (MESSAGES, anthropic("hi", model="\udcff"), 404),
            (CHAT, chat("hi", model=MODEL, logit_bias={"\ud800": 1}), 400),
        ):
            r = httpx.post(base + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
            check_error(path, r, status)
            message = r.json()["error"]["message"]
            assert "\\ud800" in message or "\\udcff" in message, message


@pytest.mark.parametrize(
    "argv, env, needle",
    [
        pytest.param(["--api-key", ""], {}, "is empty", id="empty-flag"),
        pytest.param([], {"EDGE0_API_KEY": ""}, "is empty", id="empty-env"),
        pytest.param(["--api-key", "clé-secrète"], {}, "outside printable ASCII", id="non-ascii"),
        pytest.param(["--api-key", "two words"], {}, "a space", id="space"),
    ],
)
def test_an_api_key_that_cannot_work_is_a_usage_error(capsys, monkeypatch, argv, env, needle):
    """Before, an empty key silently served without auth, and a non-ASCII one answered 401 to everyone."""
    from tests.test_errors import assert_one_line_error
    from tests.test_hardening import run_verb

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err = run_verb(capsys, "serve", "--model", "/nonexistent", *argv)
    assert_one_line_error(code, err, "--api-key", needle)
    assert "secr" not in err  # the key is never printed


@pytest.mark.slow
def test_real_bundled_model_under_both_attacks(capsys):
    """`python -m edge0.serve` with the bundled model (context 4096: at most 155,648 characters):
    the numbers in docs/server.md. Run with `python -m pytest -m slow tests/test_server_limits.py -s`."""
    from tests.test_server_hostile import _free_port

    port = _free_port()
    base, out = f"http://127.0.0.1:{port}", {}
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(tempfile.TemporaryFile("w+"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "edge0.serve", "--port", str(port), "--log-level", "warning", "--api-key", KEY],
            cwd=Path(__file__).resolve().parents[1],
            stdout=log,
            stderr=log,
        )
        stack.callback(lambda: proc.poll() is None and (proc.kill(), proc.wait(10)))
        wait_until_healthy(base, proc, 300, 0.2)
        model = httpx.get(base + "/v1/models", headers=AUTH).json()["data"][0]["id"]
        words = " ".join(open(Path(__file__).resolve().parents[1] / "data" / "valid.txt").read().split())
        near = {"model": model, "messages": [{"role": "user", "content": (words * 20)[:150_000]}]}
        assert send(base, CHAT, {**near, "max_tokens": 1}, timeout=300).status_code == 400  # tokenized, too long
        time.sleep(0.5)
        out["cold"] = rss_kib(proc.pid)
        # Warm-up, as the hostile battery does: the first round grows the tokenizer's caches and a second
        # tokenizing thread's heap once (measured: 159 -> 197 MiB, then 197 and 198 MiB after later rounds).
        assert set(attack(base, CHAT, near, 64)) <= {400, 429}
        time.sleep(1)
        out["idle"] = rss_kib(proc.pid)
        with Health(base) as health:
            out["near"] = attack(base, CHAT, near, 64)
            out["keys"] = attack(base, CHAT, {**chat("hi", tools=[tool_with_keys(3_900, 1_000)]), "model": model}, 6)
        out["peak"] = rss_kib(proc.pid, "VmHWM")
        time.sleep(1)
        out["after"] = rss_kib(proc.pid)
        with many_sockets(base, 2_100), Health(base) as idle_health:
            time.sleep(2)
            out["fds"] = fd_count(proc.pid)
        stats = httpx.get(base + "/v1/stats", headers=AUTH, timeout=10).json()["server"]
    with capsys.disabled():
        print(
            f"\nbundled model: RSS cold {out['cold'] / 1024:.0f} MiB, idle after warm-up {out['idle'] / 1024:.0f} MiB, "
            f"peak {out['peak'] / 1024:.0f} MiB, after "
            f"{out['after'] / 1024:.0f} MiB; 64 near-limit prompts: {sorted(set(out['near']))} "
            f"({out['near'].count(429)} x 429), tokenizing peak {stats['tokenizing_peak']}; 6 tools of 3.9 MB of "
            f"keys: {out['keys']}; slowest /health {health.slowest * 1000:.0f} ms; 2,100 idle connections: "
            f"{out['fds']} descriptors, slowest /health {idle_health.slowest * 1000:.0f} ms"
        )
    assert set(out["near"]) <= {400, 429} and out["keys"] == [400] * 6 and stats["tokenizing_peak"] <= 2
    assert out["after"] <= out["idle"] * RSS_BACK and health.slowest < HEALTH_S and idle_health.slowest < HEALTH_S


@pytest.mark.parametrize("path", ["/health", pytest.param(CHAT, marks=pytest.mark.slow)])  # 5 s each
def test_connections_that_never_send_their_body_cannot_lock_clients_out(path):
    """As many connections as the cap send a POST's headers with a large Content-Length and no
    body: a route that takes no body answers them at once, and a connection still waiting for its
    body is evicted for a new one, so /health answers from new connections."""
    cap = 16
    with server_process("--max-connections", str(cap), "--body-timeout-s", "60") as (proc, base):
        warm(base)
        with many_sockets(base, cap) as socks:
            for s in socks:
                s.sendall(
                    f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    "Content-Length: 100000\r\n\r\n".encode()
                )
            time.sleep(0.3)
            answered = 0
            for _ in range(10):
                with contextlib.suppress(httpx.TransportError):
                    answered += httpx.get(base + "/health", timeout=5).status_code == 200
    print(f"{cap} connections sent POST {path} headers and no body: /health answered {answered} of 10")
    assert answered >= 9, answered


def closed_within(sock: socket.socket, timeout_s: float, trickle: bool) -> float | None:
    """Seconds until the server closes `sock` (None: still open after `timeout_s`), reading and
    dropping what it sends; with `trickle`, a byte of body is sent every 0.2 s meanwhile."""
    started = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - started < timeout_s:
        try:
            if trickle:
                sock.sendall(b"x")
            if not sock.recv(4096):
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:  # reset, or a broken pipe on the send: closed
            return time.monotonic() - started
    return None


@pytest.mark.slow  # in the default suite's time budget: the other connection-timeout tests stay
def test_a_route_that_takes_no_body_answers_without_it_and_the_connection_stays_timed():
    """GET /health with a large Content-Length and no body is answered at once (before: it waited
    for the body until the body timeout). uvicorn then keeps the connection and drops the body as
    it comes: the keep-alive timeout closes it if the body never comes, the header timeout if it
    trickles in."""
    closed = []
    with server_process("--idle-timeout-s", "1", "--header-timeout-s", "2") as (proc, base):
        for trickle in (False, True):
            with many_sockets(base, 1) as (s,):
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n")
                assert s.recv(4096).startswith(b"HTTP/1.1 200 OK")
                closed.append(closed_within(s, 10, trickle))
    silent, trickling = closed
    assert silent is not None and trickling is not None and trickling > 1.5, closed
    print(f"unread body: the server closed the connection after {silent:.1f} s silent, {trickling:.1f} s trickling")
