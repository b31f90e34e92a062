"""Time to first token of a restarted `edge0 serve` on a conversation whose prefix it saved
(--prompt-cache-dir), against a cold server on the same conversation (docs/server.md).

Three server processes in turn, on the same store: (1) with DIR, answers a long first turn and
saves it, (2) without DIR, answers the conversation extended by one turn (cold), (3) with DIR,
restarted, answers the same extended conversation (restored). TTFT is from sending the streamed
request to its first content chunk; the page cache is warm for both (2) and (3).

    PYTHONPATH=$PWD python scripts/prompt_cache_ttft.py [--model DIR] [--prompt-tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def start(model, cache_dir):
    """An `edge0 serve` process on a free port, once it answers /health; (process, base URL)."""
    with socket.socket() as sock:  # a free port (another process could take it first: rerun then)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "edge0", "serve", "--port", str(port), "--log-level", "warning"]
    argv += ["--model", model] if model else []
    argv += ["--prompt-cache-dir", cache_dir] if cache_dir else []
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"edge0 serve exited with {proc.returncode}")
        time.sleep(0.2)
    raise SystemExit("edge0 serve did not start")


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def ask(base, messages, max_tokens=16):
    """(seconds to the first content chunk, text, usage) of a streamed greedy chat request."""
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0, ttft, text, usage = time.perf_counter(), None, "", None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - t0
                    text += choice["delta"]["content"]
    return ttft, text, usage


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="store directory (default: the bundled demo model)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="about this many tokens in the first turn")
    args = p.parse_args()
    import edge0

    tok = edge0.load(args.model, prerouter=False, lora=False).tokenizer
    source = (ROOT / "docs" / "architecture.md").read_text() + (ROOT / "docs" / "server.md").read_text()
    words, text = source.split(), ""
    for i in range(0, len(words), 50):  # grow the text until the chat prompt is long enough
        text = " ".join(words[: i + 50])
        if (
            len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
            >= args.prompt_tokens
        ):
            break
    first = [{"role": "user", "content": text}]
    with tempfile.TemporaryDirectory() as cache_dir:
        proc, base = start(args.model, cache_dir)
        ttft1, reply, usage1 = ask(base, first)
        deadline = time.monotonic() + 60
        while (pc := httpx.get(base + "/v1/stats").json()["engine"]["prompt_cache"])["saved"] < 1:
            assert time.monotonic() < deadline, pc
            time.sleep(0.05)
        stop(proc)
        follow = first + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Say more about the pool."},
        ]
        proc, base = start(args.model, None)
        cold, cold_text, cold_usage = ask(base, follow)
        stop(proc)
        proc, base = start(args.model, cache_dir)
        warm, warm_text, warm_usage = ask(base, follow)
        stats = httpx.get(base + "/v1/stats").json()["engine"]["prompt_cache"]
        stop(proc)
    print(
        json.dumps(
            {
                "model": args.model or "bundled",
                "first_turn_prompt_tokens": usage1["prompt_tokens"],
                "first_turn_ttft_s": round(ttft1, 3),
                "save_s": round(pc["last_save_s"], 4),
                "saved_bytes": pc["bytes"],
                "follow_prompt_tokens": cold_usage["prompt_tokens"],
                "cold_ttft_s": round(cold, 3),
                "restored_ttft_s": round(warm, 3),
                "restored_cached_tokens": warm_usage["prompt_tokens_details"]["cached_tokens"],
                "restored": stats["restored"],
                "same_text": cold_text == warm_text,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
