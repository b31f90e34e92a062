"""Several streams served at once: `edge0 serve` (continuous batching, --max-batch) against
`mlx_lm.server` (its own batching, --decode-concurrency) on the same weights, in one run
(issue 34, docs/benchmarks.md "Serving several streams").

Concurrency runs: for each C, C prompts not sent before (no prompt cache answers them) are sent
at once to /v1/completions (greedy, the same token limit); per server and C: aggregate tok/s
(every generated token over the wall time from the first request to the last answer), mean
per-stream tok/s, and mean time to first token. With --long-prompt N, a request of N prompt
tokens is sent, and once its prefill is under way a short one: the short one's time to first
token against the long one's (and the span).
Each server runs in its own process, one after the other; the machine is otherwise idle.

    python scripts/bench_serve.py /work/bench-quick --concurrency 1,4,8 --tokens 32 --out out.json
    python scripts/bench_serve.py FIXTURE --long-prompt 8192 --edge0-arg=--prefill-span=512
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

SERVERS = ("edge0", "mlx-lm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def float32_copy(mlx_dir: Path) -> Path:
    """The mlx-lm checkpoint with its floating tensors (scales, biases, norms, embeddings) in
    float32, beside it (once): edge0 computes in float32 on a CPU, and mlx_lm.server has no dtype
    option (bf16 scales run its quantized matmuls about 9x slower here, DESIGN.md)."""
    import shutil

    import mlx.core as mx

    out = mlx_dir.with_name(mlx_dir.name + "-float32")
    if out.exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in mlx_dir.iterdir():
        if f.suffix == ".safetensors":
            arrays = mx.load(str(f))
            arrays = {k: v.astype(mx.float32) if v.dtype in (mx.bfloat16, mx.float16) else v for k, v in arrays.items()}
            mx.save_safetensors(str(tmp / f.name), arrays, metadata={"format": "mlx"})
        elif f.is_file():
            shutil.copy2(f, tmp / f.name)
    tmp.replace(out)
    return out


def start(kind: str, model: Path, port: int, args) -> subprocess.Popen:
    if kind == "edge0":
        cmd = [sys.executable, "-m", "edge0", "serve", "--model", str(model / "store"), "--port", str(port)]
        cmd += ["--no-prompt-cache-dir", "--log-level", "warning", *args.edge0_arg]
    else:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(args.mlx_model), "--port", str(port)]
        cmd += ["--log-level", "WARNING", *args.mlx_arg]
    log = tempfile.TemporaryFile("w+")  # not a pipe: nothing reads it while the server runs
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    return proc


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc.log.seek(0)
            sys.exit(f"bench_serve: the server exited {proc.returncode}: {proc.log.read()[-2000:]}")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    sys.exit("bench_serve: the server did not start")


def complete(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy completion: times of the request, first text and end; tokens counted
    by the server (the last event's usage) or, where it sends none, by text events."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first, events, usage, text = None, 0, None, []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
            if piece:
                events += 1
                text.append(piece)
                first = first or time.perf_counter()
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else events
    return {"t0": t0, "first": first or end, "end": end, "tokens": tokens, "text": "".join(text)}


def together(base: str, model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    out = [None] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def one(i):
        gate.wait()
        out[i] = complete(base, model, prompts[i], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def concurrency_row(base: str, model: str, prompts: list[str], c: int, max_tokens: int) -> dict:
    runs = together(base, model, prompts[:c], max_tokens)
    start, end = min(r["t0"] for r in runs), max(r["end"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    per_stream = [
        (r["tokens"] - 1) / (r["end"] - r["first"]) for r in runs if r["tokens"] > 1 and r["end"] > r["first"]
    ]
    return {
        "concurrency": c,
        "generated_tokens": tokens,
        "wall_s": end - start,
        "aggregate_tps": tokens / (end - start),
        "per_stream_decode_tps": sum(per_stream) / len(per_stream) if per_stream else None,
        "mean_ttft_s": sum(r["first"] - r["t0"] for r in runs) / c,
        "texts": [r["text"] for r in runs],
    }


def long_and_short(base: str, model: str, long_prompt: str, short_prompt: str, after_s: float) -> dict:
    """The long request, then the short one `after_s` later (its prefill under way)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(long=complete(base, model, long_prompt, 4)))
    t.start()
    time.sleep(after_s)
    out["short"] = complete(base, model, short_prompt, 4)
    t.join()
    lg, sh = out["long"], out["short"]
    return {
        "long_ttft_s": lg["first"] - lg["t0"],
        "short_sent_after_s": sh["t0"] - lg["t0"],
        "short_ttft_s": sh["first"] - sh["t0"],
        "short_done_before_long_first_token": sh["end"] < lg["first"],
    }


def prompts_from(model: Path, n: int, tokens: int) -> list[str]:
    """n different prompts of `tokens` tokens (as the model's tokenizer counts them): the bench
    text rotated by a word each."""
    from edge0.backend.io import load_tokenizer
    from edge0.bench.child import PROMPT_TEXT

    tok = load_tokenizer(model / "store")
    words = PROMPT_TEXT.split()
    texts = [" ".join((words[i:] + words[:i]) * (1 + tokens // len(words))) for i in range(n)]
    return [tok.decode(tok.encode(t)[:tokens]) for t in texts]


def long_text(n_tokens: int) -> str:
    return " ".join(f"w{i % 997}" for i in range(n_tokens // 3))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="a directory with store/ (edge0) and mlx/ (mlx-lm) of the same weights")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, help="also: a short request during a prefill of this many tokens")
    ap.add_argument("--after-s", type=float, default=2.0, help="the short request this long after the long one")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--edge0-arg", action="append", default=[], help="an extra `edge0 serve` flag (repeatable)")
    ap.add_argument("--mlx-arg", action="append", default=[], help="an extra mlx_lm.server flag (repeatable)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--mlx-dtype", choices=["float32", "checkpoint"], default="float32", help="mlx-lm's weights")
    args = ap.parse_args(argv)
    args.mlx_model = float32_copy(args.model / "mlx") if args.mlx_dtype == "float32" else args.model / "mlx"
    # every request of the run its own prompt: neither server's prompt cache answers any of them
    prompts = prompts_from(args.model, 1 + sum(args.concurrency), args.prompt_tokens)
    results = {}
    for kind in args.servers.split(","):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start(kind, args.model, port, args)
        try:
            wait_ready(base, proc)
            # mlx_lm.server serves its --model under that path (its /v1/models lists the hub cache)
            model = httpx.get(base + "/v1/models").json()["data"][0]["id"] if kind == "edge0" else str(args.mlx_model)
            complete(base, model, prompts[0], 4)  # first-call costs out of the way
            rows, used = [], 1
            for c in args.concurrency:
                rows.append(concurrency_row(base, model, prompts[used : used + c], c, args.tokens))
                used += c
                row = {k: v for k, v in rows[-1].items() if k != "texts"}
                print(kind, json.dumps(row), file=sys.stderr, flush=True)
            out = {"rows": rows}
            if args.long_prompt:
                out["long_and_short"] = long_and_short(
                    base, model, long_text(args.long_prompt), prompts[1][::-1], args.after_s
                )
                print(kind, json.dumps(out["long_and_short"]), file=sys.stderr, flush=True)
            if kind == "edge0":
                out["server_stats"] = httpx.get(base + "/v1/stats").json()["server"]["batching"]
            results[kind] = out
        finally:
            proc.terminate()
            proc.wait(30)
    same = None
    if len(results) == 2:
        a, b = (results[k]["rows"] for k in SERVERS)
        same = [ra["texts"] == rb["texts"] for ra, rb in zip(a, b)]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python scripts/bench_serve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "texts_identical": same,
        **results,
    }
    text = json.dumps(report, indent=1)
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)
    print(text)


if __name__ == "__main__":
    main()
