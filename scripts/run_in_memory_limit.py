"""Run one command inside a memory cgroup (v1, a child of this process's own) with a hard limit, as a
container or a systemd MemoryMax would, and report its exit status and the cgroup's numbers.

    python scripts/run_in_memory_limit.py 1.4GB -- edge0 generate --model STORE --prompt "The history of"

Needs a writable cgroup v1 memory controller (root, or a delegated cgroup); says why otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge0.bench.cgroup import MemoryCgroup  # noqa: E402
from edge0.units import parse_size  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit(__doc__)
    parent, why = MemoryCgroup.available()
    if parent is None:
        raise SystemExit(f"cannot make a memory cgroup here: {why}")
    cmd = [sys.executable, "-m", "edge0", *argv[3:]] if argv[2] == "edge0" else argv[2:]
    cg = MemoryCgroup.create(parent, parse_size(argv[0], "limit"))
    try:
        t0 = time.perf_counter()
        code = subprocess.run(cmd, preexec_fn=cg.enter).returncode
        report = {"exit": code, "wall_s": round(time.perf_counter() - t0, 1), **cg.report()}
    finally:
        cg.remove()
    print(json.dumps(report), file=sys.stderr)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
