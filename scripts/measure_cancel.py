"""How soon a client that leaves during a long prefill frees `edge0 serve` (docs/server.md).

One server on STORE. A streamed completion with a prompt of about --prompt-tokens tokens is
sent and the connection closed --leave-after seconds into its prefill; at once a short request
(one token) is sent. Its latency, less the latency of the same short request on an idle server,
is how long the cancelled prefill still held the engine. It is compared with the compute of one
layer of that prefill (an uncancelled prefill of the same prompt, divided by the layer count).

    PYTHONPATH=$PWD python scripts/measure_cancel.py --model STORE [--prompt-tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_cache_ttft import start  # noqa: E402

WORDS = "the history of the printing press begins in the fifteenth century when movable type arrived "


def prompt_of(store: Path, n: int) -> str:
    """WORDS repeated to about `n` tokens of the store's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(store / "tokenizer.json"))
    per = len(tok.encode(WORDS).ids)
    return WORDS * max(1, n // per)


def completion(base: str, prompt: str, max_tokens: int) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = httpx.post(
        base + "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=3600,
    )
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


def leave_during_prefill(base: str, prompt: str, after: float) -> None:
    """Stream a completion and close the connection when `after` seconds pass with nothing read
    (the prefill is still running then)."""
    timeout = httpx.Timeout(3600, read=after)
    with httpx.Client(timeout=timeout) as client:
        try:
            with client.stream(
                "POST", base + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": True}
            ) as resp:
                for line in resp.iter_lines():
                    data = line[len("data:") :].strip() if line.startswith("data:") else ""
                    if data and data != "[DONE]" and json.loads(data)["choices"][0].get("text"):
                        raise SystemExit("a token arrived before the client left: use a longer prompt")
        except httpx.ReadTimeout:
            pass  # leaving the block closed the connection


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--leave-after", type=float, default=5.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    proc, base = start(args.model, None)
    try:
        stats = httpx.get(base + "/v1/stats", timeout=10).json()["engine"]
        layers = len(stats["layers"])
        prompt = prompt_of(Path(args.model), args.prompt_tokens)
        short = "Hello there"
        completion(base, short, 1)  # warm-up
        idle, _ = completion(base, short, 1)
        full, body = completion(base, prompt, 1)
        n_prompt = body["usage"]["prompt_tokens"]
        layer_s = full / layers
        leave_during_prefill(base, "Again: " + prompt, args.leave_after)  # no prefix in common: a whole prefill
        busy, _ = completion(base, short, 1)
        held = busy - idle
        result = {
            "model": args.model,
            "prompt_tokens": n_prompt,
            "moe_layers": layers,
            "uncancelled_prefill_s": full,
            "one_layer_s": layer_s,
            "left_after_s": args.leave_after,
            "short_request_idle_s": idle,
            "short_request_after_leave_s": busy,
            "engine_held_after_leave_s": held,
            "measured_at": time.strftime("%Y-%m-%d %H:%M"),
        }
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
