"""The real server around tests/fake_engine.py: in a thread (`running_server`), or as its own
process (`python -m tests.fake_server`, for signals and memory), started the way `edge0 serve`
starts it (edge0.server.app.run).

As a process it prints `port N` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from edge0.server.app import create_app, run, uvicorn_config
from edge0.server.config import ServerConfig
from tests.fake_engine import FakeEngine


@contextlib.contextmanager
def running_server(engine, config, host="127.0.0.1", **app_kwargs):
    """A real uvicorn server on a free port of `host`, in a thread; yields its base URL.
    `app_kwargs` go to create_app (e.g. read_memory)."""
    sock = socket.socket()
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn_config(create_app(engine, config, **app_kwargs), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def wait_until_healthy(base: str, proc, timeout_s: float, poll_s: float = 0.2) -> None:
    """Wait for the server process `proc` at `base` to answer /health with 200 (a test failure
    if it exits or `timeout_s` passes first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
        time.sleep(poll_s)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--api-key")
    p.add_argument("--delay", type=float, default=0.0, help="seconds per generated token")
    p.add_argument("--prefill-delay", type=float, default=0.0, help="seconds per prompt token")
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--max-prompt-tokens", type=int, default=4096)
    p.add_argument("--max-connections", type=int, default=ServerConfig.max_connections)
    p.add_argument("--header-timeout-s", type=float, default=ServerConfig.header_timeout_s)
    p.add_argument("--body-timeout-s", type=float, default=ServerConfig.body_timeout_s)
    p.add_argument("--idle-timeout-s", type=float, default=ServerConfig.idle_timeout_s)
    p.add_argument("--tokenize-s", type=float, default=0.0, help="seconds each chat template render takes")
    args = p.parse_args(argv)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = ServerConfig(
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
    )
    engine = FakeEngine(delay=args.delay, prefill_delay=args.prefill_delay, tokenize_s=args.tokenize_s)
    app = create_app(engine, config)
    print(f"port {sock.getsockname()[1]}", flush=True)
    run(app, log_level="warning", sock=sock)


if __name__ == "__main__":
    main()
