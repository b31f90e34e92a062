"""The real coding-agent clients (npm releases, pinned) against the real server, each run inside a
loopback-only network namespace, with the setup lines `edge0 serve` prints.

`python -m tests.agent_clients --client claude --prompt "run: echo hi" --out result.json` (run
it under `unshare -n`, as `run_client` does) brings the namespace's loopback up, serves the
scripted agent engine (tests/agent_engine.py) on a free port, runs the client with the setup line
for it, and writes the client's exit code and output and every request body the server received.

The clients are installed by `.ci/run` (`npm install --prefix DIR`); DIR is $EDGE0_AGENT_CLIENTS,
default ~/.cache/edge0/agent-clients.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Pinned npm releases: the versions whose request shapes docs/clients.md describes.
PACKAGES = {
    "claude": ("@anthropic-ai/claude-code", "2.1.197"),
    "codex": ("@openai/codex", "0.171.0"),
    "opencode": ("opencode-ai", "1.18.33"),
}
# Client libraries whose stream parsers read the server's keep-alives (tests/js/stream_keepalives.mjs).
LIBRARIES = {"openai": "6.49.0", "ai": "6.0.333", "@ai-sdk/openai-compatible": "2.0.92"}
SETUP_PREFIX = {"claude": "Claude Code: ", "codex": "Codex CLI: ", "opencode": "opencode: "}


def clients_dir() -> Path:
    return Path(os.environ.get("EDGE0_AGENT_CLIENTS") or Path.home() / ".cache" / "edge0" / "agent-clients")


def installed(client: str) -> str | None:
    """The client's executable, if the pinned version is installed (else None)."""
    package, version = PACKAGES[client]
    meta = clients_dir() / "node_modules" / package / "package.json"
    exe = clients_dir() / "node_modules" / ".bin" / client
    if not exe.exists() or not meta.exists() or json.loads(meta.read_text()).get("version") != version:
        return None
    return str(exe)


def libraries_installed() -> bool:
    """Whether the pinned LIBRARIES are installed under clients_dir()."""
    for package, version in LIBRARIES.items():
        meta = clients_dir() / "node_modules" / package / "package.json"
        if not meta.exists() or json.loads(meta.read_text()).get("version") != version:
            return False
    return True


def netns_problem() -> str | None:
    """Why a loopback-only network namespace cannot be made here (None: it can)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip (util-linux, iproute2) is not installed"
    p = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    return None if p.returncode == 0 else f"unshare -n failed: {p.stderr.strip()}"


def client_command(client: str, line: str, prompt: str, extra: list[str] = ()) -> tuple[dict, list[str]]:
    """(environment, argv) for running `client` non-interactively on `prompt`, from the setup
    line edge0 serve prints for it ("Claude Code: VAR=... claude", "Codex CLI: codex -c ..."),
    with `extra` arguments before the prompt's."""
    words = shlex.split(line.removeprefix(SETUP_PREFIX[client]))
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    exe = installed(client)
    assert words[0] == client and exe, (line, exe)
    argv = [exe, *words[1:], *extra]
    if client == "claude" and prompt.startswith("{"):  # a stream-json user message (an image block) on stdin
        argv += ["-p", "--input-format", "stream-json", "--output-format", "stream-json", "--verbose"]
    elif client == "claude":
        argv += ["-p", prompt, "--allowedTools", "Bash(echo:*)"]
    elif client == "codex":
        argv += ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", prompt]
    else:
        argv += ["run", prompt]
    return env, argv


class Recorder:
    """ASGI wrapper keeping (method, path, JSON body) of every request."""

    def __init__(self, app):
        self.app, self.requests = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks = []

        async def recording_receive():
            message = await receive()
            chunks.append(message.get("body", b""))
            return message

        try:
            await self.app(scope, recording_receive, send)
        finally:
            body = b"".join(chunks)
            try:
                parsed = json.loads(body) if body else None
            except ValueError:
                parsed = body.decode("utf-8", "replace")
            self.requests.append({"method": scope["method"], "path": scope["path"], "body": parsed})


def serve_and_run(
    client: str, prompt: str, timeout: float, engine_kwargs: dict, keepalive_s: float = 15.0, extra: list[str] = ()
) -> dict:
    """Inside the namespace: the server in a thread, the client as a child process."""
    import uvicorn

    from edge0.server.app import create_app
    from edge0.server.clients import setup_lines
    from edge0.server.config import ServerConfig
    from tests.agent_engine import AgentEngine, FormatAgentEngine
    from tests.fixtures.formats import cases

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    kwargs = dict(engine_kwargs)
    if store := kwargs.pop("store", None):  # the real engine on a store (a VL fixture's)
        import edge0

        engine = edge0.load(store)
    elif name := kwargs.pop("format", None):  # the agent writes this family's chat format
        case = next(c for c in cases() if c.name == name)
        engine = FormatAgentEngine(case, Path(tempfile.mkdtemp(prefix=f"edge0-{name}-")), **kwargs)
    else:
        engine = AgentEngine(**kwargs)
    # the real engine's random fixture never ends a reply by itself: at most 16 tokens
    cap = {"max_tokens": 16} if store else {}
    config = ServerConfig(context_length=200_000, max_prompt_tokens=190_000, keepalive_s=keepalive_s, **cap)
    app = Recorder(create_app(engine, config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    serving.start()
    while not server.started:
        time.sleep(0.01)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    lines = setup_lines(base, engine.model_id, keyed=False)
    line = next(x for x in lines if x.startswith(SETUP_PREFIX[client]))
    env, argv = client_command(client, line, prompt, extra)
    with tempfile.TemporaryDirectory() as home:
        work = Path(home) / "work"
        work.mkdir()
        child_env = {
            "PATH": os.environ["PATH"],
            "HOME": home,
            "CODEX_HOME": str(Path(home) / ".codex"),
            "XDG_CONFIG_HOME": str(Path(home) / ".config"),
            "XDG_DATA_HOME": str(Path(home) / ".local/share"),
            "XDG_CACHE_HOME": str(Path(home) / ".cache"),
            "TERM": "dumb",
            **env,
        }
        Path(child_env["CODEX_HOME"]).mkdir()
        started = time.monotonic()
        try:
            given = {"input": prompt + "\n"} if prompt.startswith("{") else {"stdin": subprocess.DEVNULL}
            p = subprocess.run(argv, cwd=work, env=child_env, capture_output=True, text=True, timeout=timeout, **given)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = "timeout", e.stdout or "", e.stderr or ""
        wall = time.monotonic() - started
    server.should_exit = True
    if store:  # the real engine: its requests end (the server drains them), then its reader threads
        serving.join(timeout=60)
        engine.close()
    return {
        "client": client,
        "setup_line": line,
        "rc": rc,
        "stdout": out if isinstance(out, str) else out.decode("utf-8", "replace"),
        "stderr": err if isinstance(err, str) else err.decode("utf-8", "replace"),
        "wall_s": wall,
        "requests": app.requests,
        "generations": _generations(engine, app.requests),
    }


def _generations(engine, requests: list) -> int:
    """Generations the engine ran: the scripted engine counts its calls; the real one is asked
    through the server's requests (every POST to a generation endpoint ran one)."""
    calls = getattr(engine, "calls", None)
    if calls is not None:
        return len(calls)
    return sum(
        r["method"] == "POST" and r["path"] in ("/v1/messages", "/v1/chat/completions", "/v1/responses")
        for r in requests
    )


def run_client(
    client: str,
    prompt: str,
    tmp_path: Path,
    timeout: float = 120,
    keepalive_s: float = 15.0,
    extra: list[str] = (),
    **engine_kwargs,
) -> dict:
    """Run `client` on `prompt` in a fresh loopback-only network namespace; its result dict.
    `extra`: client arguments; `engine_kwargs`: AgentEngine's (delay, prefill_delay), and `format`:
    the name of a format case (tests/fixtures/formats) for the agent to write that family's format."""
    out = tmp_path / f"{client}-result.json"
    cmd = [sys.executable, "-m", "tests.agent_clients", "--client", client, "--prompt", prompt, "--out", str(out)]
    cmd += ["--timeout", str(timeout), "--engine", json.dumps(engine_kwargs), "--keepalive-s", str(keepalive_s)]
    cmd += [f"--client-arg={a}" for a in extra]
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(["unshare", "-n", *cmd], cwd=root, capture_output=True, text=True, timeout=timeout + 60)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def install() -> None:
    """npm-install the pinned clients that are missing into clients_dir() (what .ci/run calls)."""
    missing = [f"{package}@{version}" for client, (package, version) in PACKAGES.items() if not installed(client)]
    if not libraries_installed():
        missing += [f"{package}@{version}" for package, version in LIBRARIES.items()]
    if not missing:
        return
    clients_dir().mkdir(parents=True, exist_ok=True)
    cmd = ["npm", "install", "--prefix", str(clients_dir()), "--no-audit", "--no-fund", "--silent", *missing]
    subprocess.run(cmd, check=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--install", action="store_true", help="install the pinned clients, then exit")
    p.add_argument("--client", choices=sorted(PACKAGES))
    p.add_argument("--prompt")
    p.add_argument("--out")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--engine", default="{}", help="AgentEngine keyword arguments, as JSON")
    p.add_argument("--keepalive-s", type=float, default=15.0)
    p.add_argument("--client-arg", action="append", default=[], help="an argument for the client (repeatable)")
    args = p.parse_args(argv)
    if args.install:
        install()
        return
    if not (args.client and args.prompt and args.out):
        p.error("--client, --prompt and --out are needed")
    result = serve_and_run(
        args.client, args.prompt, args.timeout, json.loads(args.engine), args.keepalive_s, args.client_arg
    )
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
