"""The one memory probe: how much memory this process could still use, and where that number comes
from. Linux: MemAvailable, or the process's cgroup limit (v1 or v2, the tightest up the tree) when
lower; macOS: vm_stat's free, inactive, speculative and purgeable pages; else physical memory.

Used by the default expert-cache budget, `--io auto`, `edge0 plan`, the server's memory watcher
and the bench; the source is named in the describe line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# Page cache counts against a cgroup limit but is reclaimable, so it is not subtracted.


def _numbers(path: Path) -> dict[str, int]:
    try:
        return {
            k: int(v)
            for k, v in (line.split()[:2] for line in path.read_text().splitlines() if len(line.split()) >= 2)
            if v.isdigit()
        }
    except OSError:
        return {}


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_available() -> tuple[int, str] | None:
    """(bytes this process's memory cgroup can still hold, "cgroup limit ..."), or None if unlimited."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # cgroup v1; the stat's limit includes ancestors
            for d in (Path("/sys/fs/cgroup/memory") / path.lstrip("/"), Path("/sys/fs/cgroup/memory")):
                stat = _numbers(d / "memory.stat")
                usage = _read_int(d / "memory.usage_in_bytes")
                if stat and usage is not None:
                    limit = stat.get("hierarchical_memory_limit", 1 << 62)
                    if limit < 1 << 60:
                        used = usage - stat.get("total_cache", stat.get("cache", 0))
                        found.append((max(0, limit - used), f"cgroup limit {limit / 1e9:.2f} GB ({d})"))
                    break
        elif hid == "0" and controllers == "":  # cgroup v2: the tightest limit up the tree
            d = Path("/sys/fs/cgroup") / path.lstrip("/")
            while d != Path("/sys/fs/cgroup").parent:
                limit, current = _read_int(d / "memory.max"), _read_int(d / "memory.current")
                if limit is not None and current is not None:
                    used = current - _numbers(d / "memory.stat").get("file", 0)
                    found.append((max(0, limit - used), f"cgroup limit {limit / 1e9:.2f} GB ({d})"))
                d = d.parent
    return min(found) if found else None


def _vm_stat() -> int | None:
    """macOS: bytes of free, inactive, speculative and purgeable pages (what can be had without swapping)."""
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    page = re.search(r"page size of (\d+) bytes", out)
    pages = {m.group(1): int(m.group(2)) for m in re.finditer(r"^Pages (\w+):\s+(\d+)\.", out, re.M)}
    if not page or "free" not in pages:
        return None
    return int(page.group(1)) * sum(pages.get(k, 0) for k in ("free", "inactive", "speculative", "purgeable"))


def physical_memory() -> int:
    """Bytes of physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available() -> tuple[int, str]:
    """(bytes of memory this process could still use, where that number comes from)."""
    best = None
    avail = _numbers(Path("/proc/meminfo")).get("MemAvailable:")
    if avail is not None:
        best = (avail * 1024, "MemAvailable")
    elif sys.platform == "darwin" and (vm := _vm_stat()) is not None:
        best = (vm, "vm_stat")
    cg = cgroup_available()
    if cg is not None and (best is None or cg[0] < best[0]):
        best = cg
    return best or (physical_memory(), "physical memory")
