"""Soak: many requests through the real server with the pre-router on, and the server's RSS along
the way. A per-step leak (state kept for every decode step) shows as RSS that keeps growing after
the first requests; the target is growth within 5% from request `--first` to the end.

    python scripts/soak_server.py [--requests 1000] [--first 50] [--max-tokens 8] [--model STORE]
        [--out docs/benchmarks/soak.json]

Without --model the bundled demo model is served (it ships pre-router heads, used by default).
The server runs as its own process (`python -m edge0 serve`); RSS is its VmRSS from /proc.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOPICS = (
    "the printing press",
    "tide pools",
    "the first railways",
    "how bread rises",
    "lighthouses",
    "the history of maps",
    "bees in winter",
    "glass making",
)


def rss_bytes(pid: int) -> int:
    """The resident set of process `pid` now (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def soak(url: str, requests: int, first: int, rss, max_tokens: int = 8, every: int = 50) -> dict:
    """Send `requests` chat completions one after another; `rss()` is sampled after request
    `first`, every `every` requests and at the end. Returns the samples, the growth after `first`
    and the tokens generated."""
    samples, tokens = [], 0
    with httpx.Client(base_url=url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for i in range(1, requests + 1):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} (note {i})."}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            r = client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]
            if i == first or i % every == 0 or i == requests:
                samples.append({"requests": i, "rss_bytes": rss()})
        stats = client.get("/v1/stats").json()
    base = next(s["rss_bytes"] for s in samples if s["requests"] == first)
    end = samples[-1]["rss_bytes"]
    return {
        "requests": requests,
        "first": first,
        "completion_tokens": tokens,
        "rss_after_first_bytes": base,
        "rss_end_bytes": end,
        "growth_after_first": (end - base) / base,
        "samples": samples,
        "prerouter": (stats["engine"].get("prerouter") or {}).get("heads"),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--first", type=int, default=50, help="RSS growth is measured from this request on")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--model", help="store directory (default: the bundled demo model)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "edge0", "serve", "--port", str(port), "--log-level", "warning"]
    cmd += ["--model", args.model] if args.model else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start (exit {server.poll()})")
            time.sleep(0.5)
        result = soak(url, args.requests, args.first, lambda: rss_bytes(server.pid), args.max_tokens)
    finally:
        server.terminate()
        server.wait(30)
    if not result["prerouter"]:
        raise SystemExit("the server ran without pre-router heads: this soak is about the pre-router's stager")
    result.update(
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        command="python scripts/soak_server.py " + " ".join(sys.argv[1:]),
        elapsed_s=time.perf_counter() - t0,
    )
    mib = 2**20
    print(
        f"{args.requests} requests, {result['completion_tokens']} tokens, pre-router {result['prerouter']}: RSS "
        f"{result['rss_after_first_bytes'] / mib:.1f} MiB after {args.first}, {result['rss_end_bytes'] / mib:.1f} "
        f"MiB at the end ({result['growth_after_first']:+.1%})"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
