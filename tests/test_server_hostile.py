"""The server as its own process (tests/fake_server.py: the real app and `edge0.server.app.run`
around the fake engine): SIGTERM mid-stream, and a battery of hostile requests after which the
process must still answer and give its memory back."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.fake_engine import FakeEngine
from tests.fake_server import wait_until_healthy
from tests.fixtures.hostile import CHAT, COMPLETIONS, HOSTILE, MESSAGES, RESPONSES, anthropic, chat, responses, user

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-hostile"
MODEL = FakeEngine.model_id
AUTH = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")


@contextlib.contextmanager
def server_process(*args):
    """`python -m tests.fake_server ARGS`; yields (process, base URL); kills it if still alive."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fake_server", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True
        )
        try:
            base = f"http://127.0.0.1:{int(proc.stdout.readline().split()[1])}"
            wait_until_healthy(base, proc, 30, 0.05)
            yield proc, base
        except BaseException:
            log.seek(0)
            print(log.read()[-5000:], file=sys.stderr)
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def check_error(path: str, r: httpx.Response, status: int) -> None:
    """`r` is a JSON error of `status` in the shape of `path`'s API."""
    assert r.status_code == status, (path, r.status_code, r.text[:300])
    body = r.json()
    if path.startswith(MESSAGES):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]


def send(base: str, path: str, body, headers=None, timeout: float = 10) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        base + path,
        content=content,
        timeout=timeout,
        headers={**AUTH, "Content-Type": "application/json", **(headers or {})},
    )


def read_stream(base: str, path: str, body: dict, out: list, started: threading.Event | None = None) -> None:
    """Collect the lines of an SSE response into `out` until it ends."""
    with httpx.stream("POST", base + path, json=body, headers=AUTH, timeout=30) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            out.append(line)
            if started and sum(l.startswith("data:") for l in out[1:]) >= 4:
                started.set()


def test_sigterm_ends_open_streams_with_an_error_event_and_exits():
    with server_process("--delay", "0.01") as (proc, base):  # "count 2000": 20 s of tokens
        running = threading.Event()
        streams = {path: [] for path in (CHAT, MESSAGES, RESPONSES)}
        bodies = {
            CHAT: chat("count 2000", stream=True, max_tokens=4000),
            MESSAGES: anthropic("count 2000", stream=True, max_tokens=4000),
            RESPONSES: responses("count 2000", stream=True, max_output_tokens=4000),
        }
        threads = [threading.Thread(target=read_stream, args=(base, CHAT, bodies[CHAT], streams[CHAT], running))]
        threads[0].start()
        assert running.wait(10)  # the chat stream is generating; the others queue behind it
        threads += [
            threading.Thread(target=read_stream, args=(base, p, bodies[p], streams[p])) for p in (MESSAGES, RESPONSES)
        ]
        for t in threads[1:]:
            t.start()
        queued = {}
        waiter = threading.Thread(target=lambda: queued.update(r=send(base, CHAT, chat("count 10"), timeout=30)))
        waiter.start()
        deadline = time.monotonic() + 10  # all four admitted (a fixed sleep was too short under a loaded CI)
        with httpx.Client(base_url=base, timeout=5) as probe:
            while probe.get("/health").json()["requests_in_flight"] < 4:
                assert time.monotonic() < deadline, "the requests were not all admitted"
                time.sleep(0.02)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        exited = time.monotonic() - sent
        for t in threads + [waiter]:
            t.join(10)
            assert not t.is_alive()
    assert exited < 5, f"the process took {exited:.1f} s to exit"
    assert proc.returncode == -signal.SIGTERM  # uvicorn re-raises the signal once it has stopped
    last = {path: [l for l in lines[1:] if l][-1] for path, lines in streams.items()}
    assert all(lines[0] == 200 for lines in streams.values())
    chat_error = json.loads(last[CHAT].removeprefix("data: "))["error"]
    assert chat_error["code"] == "server_shutting_down" and "shutting down" in chat_error["message"]
    assert len(streams[CHAT]) < 1000  # it was cut short, not run to its end
    for path, kind in ((MESSAGES, "overloaded_error"), (RESPONSES, "error")):
        event, data = [l for l in streams[path][1:] if l][-2:]
        assert event == "event: error", (path, streams[path][-4:])
        data = json.loads(data.removeprefix("data: "))
        assert (data["error"]["type"] if path == MESSAGES else data["type"]) == kind
    check_error(CHAT, queued["r"], 503)
    assert queued["r"].json()["error"]["code"] == "server_shutting_down"


def server_counters(base: str) -> dict:
    return httpx.get(base + "/v1/stats", headers=AUTH, timeout=5).json()["server"]


def drained(base: str) -> None:
    """Wait (up to 10 s) until the server has no request in flight."""
    deadline = time.monotonic() + 10
    while httpx.get(base + "/health", timeout=5).json()["requests_in_flight"]:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)


def _stream_and_leave(base: str, path: str, body: dict, after_lines: int) -> None:
    with httpx.stream("POST", base + path, json=body, headers=AUTH, timeout=10) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i + 1 >= after_lines:
                break


def test_hostile_battery_leaves_the_server_answering_and_its_memory_back(capsys):
    args = [
        "--api-key",
        KEY,
        "--delay",
        "0.002",
        "--prefill-delay",
        "0.0005",
        "--max-queue",
        "4",
        "--max-body-bytes",
        "65536",
        "--max-prompt-tokens",
        "2048",
    ]
    with server_process(*args) as (proc, base):
        ok = [
            (CHAT, chat("hi")),
            (CHAT, chat("hi", stream=True)),
            (COMPLETIONS, {"model": MODEL, "prompt": "hi"}),
            (MESSAGES, anthropic("hi")),
            (MESSAGES, anthropic("hi", stream=True)),
            (RESPONSES, responses("hi")),
            (RESPONSES, responses("hi", stream=True)),
        ]
        for _ in range(2):  # warm up every route, then every error path, before the idle measurement
            for path, body in ok:
                assert send(base, path, body).status_code == 200
        for path, body, headers, status in HOSTILE:
            send(base, path, body, headers)
        time.sleep(0.5)
        idle = rss_kib(proc.pid)
        samples, sampling = [idle], threading.Event()

        def sample():
            while not sampling.wait(0.02):
                samples.append(rss_kib(proc.pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            assert len(HOSTILE) >= 110
            for path, body, headers, status in HOSTILE:
                check_error(path, send(base, path, body, headers), status)

            def burst_one(i):
                path, body = [
                    (CHAT, chat(f"count {30 + i}")),
                    (MESSAGES, anthropic(f"count {30 + i}")),
                    (RESPONSES, responses(f"count {30 + i}")),
                ][i % 3]
                r = send(base, path, body, timeout=30)
                if r.status_code != 200:
                    check_error(path, r, 429)
                return r.status_code

            with ThreadPoolExecutor(30) as pool:
                statuses = list(pool.map(burst_one, range(30)))
            assert set(statuses) == {200, 429} and statuses.count(200) >= 5, statuses
            drained(base)  # the burst's refused requests may still be leaving the queue

            cancelled = server_counters(base)["cancelled"]
            long_prompt = "p" * 1500  # 0.75 s of prefill
            for path, body in [
                (CHAT, chat(long_prompt, stream=True)),
                (MESSAGES, anthropic(long_prompt, stream=True)),
                (RESPONSES, responses(long_prompt, stream=True)),
            ] * 2:
                _stream_and_leave(base, path, body, 1)  # during prefill
                drained(base)  # the server notices the client left, and its slot frees
            for path, body in [
                (CHAT, chat("count 500", stream=True, max_tokens=1000)),
                (MESSAGES, anthropic("count 500", stream=True, max_tokens=1000)),
                (RESPONSES, responses("count 500", stream=True)),
            ] * 2:
                _stream_and_leave(base, path, body, 8)  # during decode
                drained(base)
            for path, body in [(CHAT, chat(long_prompt)), (MESSAGES, anthropic("count 500", max_tokens=1000))]:
                with pytest.raises(httpx.ReadTimeout):  # non-streamed, the client gives up
                    send(base, path, body, timeout=0.3)

            drained(base)
            # every request whose client left was cancelled, none run to its end
            assert server_counters(base)["cancelled"] - cancelled == 6 + 6 + 2
            for path, body in ok:  # everything still answers, quickly
                started = time.monotonic()
                assert send(base, path, body).status_code == 200
                assert time.monotonic() - started < 2
        finally:
            sampling.set()
            sampler.join()
        time.sleep(0.5)
        after, peak = rss_kib(proc.pid), max(samples + [rss_kib(proc.pid)])
        stats = httpx.get(base + "/v1/stats", headers=AUTH, timeout=5).json()["server"]
    with capsys.disabled():
        print(
            f"\nhostile battery: RSS idle {idle / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB, "
            f"after {after / 1024:.1f} MiB ({100 * (after - idle) / idle:+.1f}%); server counters {stats}"
        )
    assert after <= idle * 1.1  # issue 35: RSS back within 10% of its start


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_real_bundled_model_refuses_a_4mb_prompt_cancels_prefill_and_stops_on_sigterm(capsys):
    """`python -m edge0.serve` with the bundled model (context 4096): the numbers in docs/server.md.
    Run with `python -m pytest -m slow tests/test_server_hostile.py -s`."""
    port = _free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edge0.serve", "--port", str(port), "--log-level", "warning"],
            cwd=ROOT,
            stdout=log,
            stderr=log,
        )
        base, out = f"http://127.0.0.1:{port}", {}
        try:
            wait_until_healthy(base, proc, 120, 0.2)
            model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            ask = {"model": model, "prompt": "The Python tutorial", "max_tokens": 8, "temperature": 0}
            assert httpx.post(base + COMPLETIONS, json=ask, timeout=120).status_code == 200
            out["idle"] = rss_kib(proc.pid)

            started = time.monotonic()
            r = httpx.post(base + CHAT, json={"model": model, "messages": user("x" * 4_000_000)}, timeout=60)
            out["reject_s"] = time.monotonic() - started
            check_error(CHAT, r, 400)
            assert r.json()["error"]["code"] == "context_length_exceeded"
            out["after_4mb"] = rss_kib(proc.pid)

            words = open(ROOT / "data" / "valid.txt", encoding="utf-8").read().split()
            long = {"model": model, "prompt": " ".join(words[:2400]), "max_tokens": 8, "stream": True}
            with httpx.stream("POST", base + COMPLETIONS, json=long, timeout=120) as r:
                assert r.status_code == 200
                time.sleep(2)  # the client gives up during prefill
            left = time.monotonic()
            assert httpx.post(base + COMPLETIONS, json=ask, timeout=120).status_code == 200
            out["freed_s"] = time.monotonic() - left

            lines = []
            reader = threading.Thread(target=read_stream, args=(base, COMPLETIONS, long, lines))
            reader.start()
            time.sleep(3)  # mid-prefill
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            out["exit_s"] = time.monotonic() - sent
            reader.join(10)
            assert lines[0] == 200 and "server_shutting_down" in [l for l in lines[1:] if l][-1]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.seek(0)
            text = log.read()
    with capsys.disabled():
        print(
            f"\nbundled model: RSS idle {out['idle'] / 1024:.0f} MiB; 4 MB prompt refused in {out['reject_s']:.2f} s, "
            f"RSS after {out['after_4mb'] / 1024:.0f} MiB; client gone 2 s into prefill -> next answer after "
            f"{out['freed_s']:.1f} s; SIGTERM mid-prefill -> exit in {out['exit_s']:.1f} s"
        )
    assert out["reject_s"] < 2 and out["after_4mb"] <= out["idle"] * 1.2, text[-3000:]
    assert out["exit_s"] < 15, text[-3000:]
