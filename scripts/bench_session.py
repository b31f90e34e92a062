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
from edge0.bench.session import SessionShape, TextMaker, run_session  # noqa: E402


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


def one(name: str, store: str, mlx: str, shape: SessionShape, seed: int, tmp: Path, extra: list[str]) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    if name == "edge0":
        cmd = [sys.executable, "-m", "edge0.serve", "--model", store, "--port", str(port), "--log-level", "warning"]
        cmd += ["--prompt-cache-dir", str(tempfile.mkdtemp(dir=tmp)), *extra]
    else:
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", mlx, "--port", str(port), "--log-level", "WARNING"]
    proc = serve(cmd, base, tmp / f"{name}.log")
    try:
        tokenizer = load_tokenizer(store)
        maker = TextMaker(lambda text: len(tokenizer.encode(text)), seed)
        result = run_session(base, mlx if name == "mlx_lm" else "session", shape, maker)
    finally:
        proc.terminate()
        proc.wait(60)
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
    for f in fields(SessionShape):
        p.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default)
    args = p.parse_args(argv)
    shape = SessionShape(**{f.name: getattr(args, f.name) for f in fields(SessionShape)})
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in args.servers.split(","):
                run = one(name, args.store, args.mlx_model, shape, args.seed, Path(tmp), args.edge0_arg)
                run["repeat"] = repeat
                runs.append(run)
                print(
                    f"{name:7s} repeat {repeat}: wall {run['wall_s']:.1f} s, prefilled {run['prefilled_tokens']} of "
                    f"{run['prompt_tokens']} prompt tokens, recompute ratio {run['recompute_ratio']:.2f}",
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
