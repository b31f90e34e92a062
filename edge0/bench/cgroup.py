"""A cgroup v1 memory limit for the memory-capped arms."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


class MemoryCgroup:
    """A cgroup v1 memory controller child of this process's own cgroup, with a hard limit."""

    def __init__(self, path: Path, limit: int):
        self.path, self.limit = path, limit

    @staticmethod
    def available() -> tuple[Path | None, str]:
        """(parent cgroup dir, "") if a child memory cgroup can be made here, else (None, reason)."""
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None, "no /proc/self/cgroup (not Linux): memory caps need cgroups"
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                parent = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
                if not (parent / "memory.limit_in_bytes").is_file():
                    return None, f"{parent}: no cgroup v1 memory controller mounted there"
                if not os.access(parent, os.W_OK):
                    return None, f"{parent}: not writable by this user (needs a delegated cgroup or root)"
                return parent, ""
        return None, "no cgroup v1 memory controller for this process (cgroup v2 needs a delegated subtree)"

    @classmethod
    def create(cls, parent: Path, limit: int) -> "MemoryCgroup":
        path = parent / f"edge0-bench-{os.getpid()}"
        path.mkdir()
        cg = cls(path, limit)
        try:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            try:  # no swap escape hatch (the file exists only with swap accounting)
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            except OSError:
                pass
        except OSError:
            cg.remove()
            raise
        return cg

    def enter(self) -> None:
        """Runs in the child between fork and exec: move itself into the cgroup."""
        with open(self.path / "cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

    def report(self) -> dict:
        def read(name):
            try:
                return (self.path / name).read_text()
            except OSError:
                return ""

        oom = dict(l.split() for l in read("memory.oom_control").splitlines() if len(l.split()) == 2)
        return {
            "limit_bytes": self.limit,
            "max_usage_bytes": int(read("memory.max_usage_in_bytes") or 0),
            "failcnt": int(read("memory.failcnt") or 0),
            "oom_kills": int(oom.get("oom_kill", 0)),
        }

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        print(f"edge0 bench: could not remove cgroup {self.path}", file=sys.stderr)
