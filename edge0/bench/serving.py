"""`edge0 serve` against `mlx_lm.server` on the same weights at the same concurrency, one server
after the other in one run (`edge0 bench --concurrency`; docs/bench-suite.md#concurrency).

For each C, C prompts neither server has seen (no prompt cache answers them) go at once to
/v1/completions (streamed, greedy, the same token limit); per server and C: aggregate tok/s (every
generated token over the wall time from the first request to the last answer), mean per-stream
decode tok/s and mean time to first token. With a long prompt of N tokens, a short request goes
once the long one's prefill is under way: its time to first token against the long one's.
mlx_lm.server gets a float32 copy of the checkpoint (Edge0 computes in float32 on a CPU)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from edge0.bench.report import _f, table_head
from edge0.errors import Edge0Error

SERVERS = ("edge0", "mlx-lm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(kind: str, model, mlx_model: Path, port: int, edge0_args: list[str]) -> subprocess.Popen:
    if kind == "edge0":
        cmd = [sys.executable, "-m", "edge0", "serve", "--model", str(model.store), "--port", str(port)]
        cmd += ["--no-prompt-cache-dir", "--log-level", "warning", *edge0_args]
    else:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(mlx_model), "--port", str(port)]
        cmd += ["--log-level", "WARNING"]
    log = tempfile.TemporaryFile("w+")  # not a pipe: nothing reads it while the server runs
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    return proc


def _get(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_ready(kind: str, base: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc.log.seek(0)
            raise Edge0Error(f"{kind} server exited {proc.returncode}: {proc.log.read()[-1500:]}")
        try:  # a 200 is enough: mlx_lm.server's body is empty where there is no Hugging Face cache
            with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):  # not up yet
            time.sleep(0.2)
    raise Edge0Error(f"{kind} server did not answer /v1/models within {timeout_s:.0f} s")


def complete(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy completion: times of the request, first text and end; tokens counted
    by the server (the last event's usage) or, where it sends none, by text events."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first, events, usage, text = None, 0, None, []
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
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


def _together(base: str, model: str, prompts: list[str], max_tokens: int) -> list[dict]:
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
    if any(r is None for r in out):
        raise Edge0Error("a request to the server failed (see the traceback above)")
    return out


def concurrency_row(base: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    """len(prompts) requests at once."""
    runs = _together(base, model, prompts, max_tokens)
    start, end = min(r["t0"] for r in runs), max(r["end"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    per_stream = [
        (r["tokens"] - 1) / (r["end"] - r["first"]) for r in runs if r["tokens"] > 1 and r["end"] > r["first"]
    ]
    return {
        "concurrency": len(prompts),
        "generated_tokens": tokens,
        "wall_s": end - start,
        "aggregate_tps": tokens / (end - start),
        "per_stream_decode_tps": sum(per_stream) / len(per_stream) if per_stream else None,
        "mean_ttft_s": sum(r["first"] - r["t0"] for r in runs) / len(runs),
        "texts": [r["text"] for r in runs],
    }


def long_and_short(base: str, model: str, long_prompt: str, short_prompt: str, after_s: float) -> dict:
    """The long request, then the short one `after_s` later (the long one's prefill under way)."""
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


def prompts_from(store: Path, n: int, tokens: int) -> list[str]:
    """n different prompts of `tokens` tokens (as the model's tokenizer counts them)."""
    from edge0.backend.io import load_tokenizer
    from edge0.bench.child import prompts_for

    tok = load_tokenizer(store)
    return [tok.decode(ids) for ids in prompts_for(tok.encode, n, tokens)]


def serve_side_by_side(model, batches, max_tokens, prompt_tokens, long_prompt=None, edge0_args=()) -> dict:
    """Both servers, one after the other, at each concurrency in `batches` (see the docstring)."""
    from edge0.backend.io import float32_checkpoint

    mlx_model = float32_checkpoint(model.mlx)
    prompts = prompts_from(model.store, 2 + sum(batches), prompt_tokens)
    results = {}
    for kind in SERVERS:
        print(f"edge0 bench: --concurrency, {kind} server ...", flush=True, file=sys.stderr)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        proc = _start(kind, model, mlx_model, port, list(edge0_args))
        try:
            _wait_ready(kind, base, proc)
            # mlx_lm.server serves its --model under that path (its /v1/models lists the hub cache)
            name = _get(base + "/v1/models")["data"][0]["id"] if kind == "edge0" else str(mlx_model)
            complete(base, name, prompts[0], 4)  # first-call costs out of the way
            rows, used = [], 2
            for c in batches:
                rows.append(concurrency_row(base, name, prompts[used : used + c], max_tokens))
                used += c
                r = rows[-1]
                print(
                    f"edge0 bench: {kind} server, C={c}: {r['aggregate_tps']:.2f} tok/s, "
                    f"first token {r['mean_ttft_s']:.2f} s",
                    flush=True,
                    file=sys.stderr,
                )
            out = {"rows": rows}
            if long_prompt:
                long_text = " ".join(f"w{i % 997}" for i in range(long_prompt // 3))
                out["long_and_short"] = long_and_short(base, name, long_text, prompts[1][::-1], 2.0)
            if kind == "edge0":
                st = _get(base + "/v1/stats")
                out["batching"] = st["server"]["batching"]
                out["expert_cache_bytes"] = st["engine"]["expert_cache_bytes"]
            results[kind] = out
        finally:
            proc.terminate()
            proc.wait(30)
    a, b = (results[k]["rows"] for k in SERVERS)
    return {
        "mlx_model": str(mlx_model),
        "edge0_args": list(edge0_args),
        "long_prompt_tokens": long_prompt,
        "texts_identical": [ra["texts"] == rb["texts"] for ra, rb in zip(a, b)],
        "rows": [{"concurrency": ra["concurrency"], "edge0": _strip(ra), "mlx-lm": _strip(rb)} for ra, rb in zip(a, b)],
        **{k: {key: v for key, v in results[k].items() if key != "rows"} for k in SERVERS},
    }


def _strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("texts", "concurrency")}


def servers_markdown(s: dict) -> str:
    """The servers' table (and the long-and-short line, when run)."""
    lines = table_head(
        "C | edge0 serve, tok/s | mlx_lm.server, tok/s | ratio | first token, edge0 s | mlx-lm s | same text"
    )
    for r, same in zip(s["rows"], s["texts_identical"]):
        e, m = r["edge0"], r["mlx-lm"]
        lines.append(
            f"| {r['concurrency']} | {_f(e['aggregate_tps'])} | {_f(m['aggregate_tps'])} "
            f"| {_f(e['aggregate_tps'] / m['aggregate_tps'], '{:.2f}x')} | {_f(e['mean_ttft_s'])} "
            f"| {_f(m['mean_ttft_s'])} | {'yes' if same else '**no**'} |"
        )
    if s.get("long_prompt_tokens"):
        e, m = s["edge0"]["long_and_short"], s["mlx-lm"]["long_and_short"]
        lines.append("")
        lines.append(
            f"A short request sent {e['short_sent_after_s']:.1f} s into a {s['long_prompt_tokens']}-token prefill: "
            f"first token in {e['short_ttft_s']:.2f} s (edge0) / {m['short_ttft_s']:.2f} s (mlx_lm.server); "
            f"the long one's in {e['long_ttft_s']:.2f} s / {m['long_ttft_s']:.2f} s."
        )
    return "\n".join(lines)
