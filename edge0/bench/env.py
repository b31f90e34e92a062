"""Where the source checkout is, and the environment of every process the bench starts."""

from __future__ import annotations

import os
from pathlib import Path

PKG_ROOT = Path(__file__).resolve().parents[2]


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PKG_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env
