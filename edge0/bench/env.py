"""Where the source checkout is, and the environment of every process the bench starts."""

from __future__ import annotations

import os
from pathlib import Path

PKG_ROOT = Path(__file__).resolve().parents[2]


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PKG_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def storage_bytes_read() -> int | None:
    """Bytes this process has caused to be read from storage (Linux /proc/self/io: page-cache
    hits are not counted, unlike the executors' bytes read); None where the kernel does not say."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
