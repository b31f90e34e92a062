"""An agent session against `edge0 serve` and `mlx_lm.server` on the same weights, one after the
other in one run (edge0/bench/session.py): per request prompt, cached and prefilled tokens and
TTFT; per session the recompute ratio (prefilled / new tokens) and the wall time.

    python scripts/bench_session.py --store STORE --mlx-model MLX_DIR --out docs/benchmarks/session.json

STORE is an edge0 store and MLX_DIR mlx-lm's `convert -q` output of the same checkpoint (the
tests' fixtures build both: tests/fixtures/make.py). Each server starts fresh (edge0 with an empty
prompt-cache directory), serves one session, and stops; `--repeats N` alternates them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge0.backend.io import load_tokenizer  # noqa: E402
from edge0.bench.session import SessionShape, TextMaker, request, run_session  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(cmd: list[str], base: str, log: Path):
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[2]} exited {proc.returncode}; see {log}")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[2]} did not start in 600 s; see {log}")


def command(name: str, store: str, mlx: str, port: int, cache_dir: Path, extra: list[str]) -> list[str]:
    if name == "edge0":
        cmd = [sys.executable, "-m", "edge0.serve", "--model", store, "--port", str(port), "--log-level", "warning"]
        return cmd + ["--prompt-cache-dir", str(cache_dir), *extra]
    return [sys.executable, "-m", "mlx_lm.server", "--model", mlx, "--port", str(port), "--log-level", "WARNING"]


def one(name: str, args, shape: SessionShape, tmp: Path) -> dict:
    """One session against a fresh server; with --restart-after K (edge0), the server is stopped
    (SIGTERM) after K requests and started again on the same prompt-cache directory, and the first
    request after it is sent once more to a server with an empty one (a cold prefill)."""
    cache_dir = Path(tempfile.mkdtemp(dir=tmp))
    port = free_port()
    cmd = command(name, args.store, args.mlx_model, port, cache_dir, args.edge0_arg)
    state = {"proc": serve(cmd, f"http://127.0.0.1:{port}", tmp / f"{name}.log"), "messages": None}
    restart = args.restart_after if name == "edge0" else None

    def before(i, messages):
        if i != restart:
            return None
        state["proc"].terminate()
        state["proc"].wait(600)
        port = free_port()
        state["proc"] = serve(
            command(name, args.store, "", port, cache_dir, args.edge0_arg),
            f"http://127.0.0.1:{port}",
            tmp / f"{name}-2.log",
        )
        state["messages"] = messages
        return f"http://127.0.0.1:{port}"

    model = args.mlx_model if name == "mlx_lm" else "session"
    try:
        tokenizer = load_tokenizer(args.store)
        maker = TextMaker(lambda text: len(tokenizer.encode(text)), args.seed)
        result = run_session(f"http://127.0.0.1:{port}", model, shape, maker, before=before)
    finally:
        state["proc"].terminate()
        state["proc"].wait(600)
    if state["messages"] is not None:
        port = free_port()
        cold_cmd = command(name, args.store, "", port, Path(tempfile.mkdtemp(dir=tmp)), args.edge0_arg)
        proc = serve(cold_cmd, f"http://127.0.0.1:{port}", tmp / f"{name}-cold.log")
        try:
            with httpx.Client(timeout=3600) as client:
                cold = request(client, f"http://127.0.0.1:{port}", model, state["messages"], shape.reply_tokens)
        finally:
            proc.terminate()
            proc.wait(600)
        cold.pop("reply")
        result["restart"] = {"after": restart, "restored": result["requests"][restart], "cold": cold}
    return {"server": name, "command": cmd, **result}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--mlx-model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--servers", default="edge0,mlx_lm", help="which to run, in order (default edge0,mlx_lm)")
    p.add_argument("--edge0-arg", action="append", default=[], help="an extra edge0 serve argument (repeatable)")
    p.add_argument(
        "--restart-after",
        type=int,
        default=None,
        metavar="K",
        help="stop and restart edge0 serve after K requests (its disk tier restores the conversations)",
    )
    for f in fields(SessionShape):
        p.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default)
    args = p.parse_args(argv)
    shape = SessionShape(**{f.name: getattr(args, f.name) for f in fields(SessionShape)})
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in args.servers.split(","):
                run = one(name, args, shape, Path(tmp))
                run["repeat"] = repeat
                runs.append(run)
                print(
                    f"{name:7s} repeat {repeat}: wall {run['wall_s']:.1f} s, prefilled {run['prefilled_tokens']} of "
                    f"{run['prompt_tokens']} prompt tokens, recompute ratio {run['recompute_ratio']:.2f}",
                    flush=True,
                )
                if "restart" in run:
                    r, c = run["restart"]["restored"], run["restart"]["cold"]
                    print(
                        f"  after the restart: {r['cached_tokens']} of {r['prompt_tokens']} tokens restored, TTFT "
                        f"{r['ttft_s']:.2f} s; cold {c['ttft_s']:.2f} s",
                        flush=True,
                    )
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "command": " ".join(sys.argv),
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
