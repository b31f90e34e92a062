"""Capture the request bodies the real coding-agent clients send (tests/fixtures/clients/*.json).

Runs each pinned client (tests/agent_clients.py) in a loopback-only network namespace against the
server on the scripted agent engine, with a prompt that makes a tool round trip, and keeps every
request it sent. Strings longer than 200 characters (system prompts, tool descriptions) are cut:
the fixtures keep the shapes the clients send, which tests/test_server_clients.py replays, not
their prompt texts.

    EDGE0_AGENT_CLIENTS=DIR python scripts/capture_client_requests.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.agent_clients import PACKAGES, installed, run_client  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "clients"
LONGEST = 200


def trimmed(value):
    if isinstance(value, str):  # the trailing whitespace stays: it separates text blocks that are joined
        return value if len(value) <= LONGEST else value[:LONGEST] + " [cut]" + value[len(value.rstrip()) :]
    if isinstance(value, dict):
        return {k: trimmed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [trimmed(v) for v in value]
    return value


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for client, (package, version) in PACKAGES.items():
        if installed(client) is None:
            sys.exit(f"{package}@{version} is not installed under $EDGE0_AGENT_CLIENTS; see .ci/run")
        with tempfile.TemporaryDirectory() as tmp:
            result = run_client(client, "run: echo edge0-round-trip", Path(tmp))
        assert result["rc"] == 0, result["stderr"][-2000:]
        requests = [r for r in result["requests"] if r["method"] == "POST"]
        fixture = {"client": f"{package}@{version}", "requests": trimmed(requests)}
        (OUT / f"{client}.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
        print(f"{client}: {len(requests)} requests -> {OUT / f'{client}.json'}")


if __name__ == "__main__":
    main()
