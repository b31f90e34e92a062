"""Cgroup limits for the bench's arms: a memory limit (cgroup v1) for the memory-capped arms, and
a read limit (block I/O: cgroup v1 blkio throttle, or io.max on v2) that makes storage slower
than compute, as it is on the machines Edge0 is for."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class Cgroup:
    """A child cgroup directory this process made: processes enter it, and it is removed after."""

    def __init__(self, path: Path):
        self.path = path

    def enter(self) -> None:
        """Runs in a child between fork and exec: move itself into the cgroup."""
        with open(self.path / "cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

    def remove(self) -> None:
        """Remove the directory, waiting up to 5 s for the processes in it to exit."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        print(f"edge0 bench: could not remove cgroup {self.path}", file=sys.stderr)


class MemoryCgroup(Cgroup):
    """A cgroup v1 memory controller child of this process's own cgroup, with a hard limit."""

    def __init__(self, path: Path, limit: int):
        super().__init__(path)
        self.limit = limit

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


def block_device(path) -> tuple[int, int] | None:
    """(major, minor) of the whole disk that holds `path` (a partition maps to its disk, which is
    what the throttle accepts), or None for a file system with no block device (tmpfs, overlay)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    if not sys_dev.exists():
        return None
    if (sys_dev / "partition").exists():  # the parent directory is the disk
        major, minor = (int(x) for x in (sys_dev.resolve().parent / "dev").read_text().split(":"))
    return major, minor


class ReadLimit(Cgroup):
    """A child block-I/O cgroup of this process's own that limits reads from each disk of a store
    (its own, and those of its stripe directories) to `rate` bytes/s: buffered and O_DIRECT reads
    alike (page-cache hits are not throttled)."""

    def __init__(self, path: Path, devices: list[tuple[int, int]], rate: int, version: int):
        super().__init__(path)
        self.devices, self.rate, self.version = devices, rate, version

    @staticmethod
    def parent() -> tuple[Path | None, int, str]:
        """(parent cgroup dir, cgroup version, "") where a child read-limit cgroup can be made, else
        (None, 0, reason)."""
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None, 0, "no /proc/self/cgroup (not Linux): a read limit needs cgroups"
        for line in lines:
            hid, controllers, path = line.split(":", 2)
            if "blkio" in controllers.split(","):
                d = Path("/sys/fs/cgroup/blkio") / path.lstrip("/")
                if not (d / "blkio.throttle.read_bps_device").is_file():
                    return None, 0, f"{d}: no blkio throttle (the kernel lacks CONFIG_BLK_DEV_THROTTLING)"
                if not os.access(d, os.W_OK):
                    return None, 0, f"{d}: not writable by this user (needs root or a delegated cgroup)"
                return d, 1, ""
        for line in lines:
            hid, controllers, path = line.split(":", 2)
            if hid == "0" and controllers == "":
                d = Path("/sys/fs/cgroup") / path.lstrip("/")
                try:
                    enabled = (d / "cgroup.subtree_control").read_text().split()
                except OSError:
                    enabled = []
                if "io" not in enabled:
                    return None, 0, f"{d}: the io controller is not enabled for child cgroups (cgroup v2)"
                if not os.access(d, os.W_OK):
                    return None, 0, f"{d}: not writable by this user (needs root or a delegated cgroup)"
                return d, 2, ""
        return None, 0, "no blkio (v1) or io (v2) cgroup controller for this process"

    @classmethod
    def create(cls, store, rate: int) -> "ReadLimit":
        """A read limit of `rate` bytes/s on each disk holding `store`'s experts; OSError/ValueError
        with the reason."""
        parent, version, reason = cls.parent()
        if parent is None:
            raise ValueError(reason)
        devices = []
        for d in stripe_dirs(store):
            device = block_device(d)
            if device is None:
                raise ValueError(
                    f"{d} is on a file system with no block device (tmpfs, overlay); a read limit throttles a disk"
                )
            devices += [device] if device not in devices else []
        path = parent / f"edge0-read-{os.getpid()}"
        path.mkdir(exist_ok=True)
        cg = cls(path, devices, rate, version)
        try:
            for major, minor in devices:  # one line per device: each gets its own limit
                if version == 1:
                    (path / "blkio.throttle.read_bps_device").write_text(f"{major}:{minor} {rate}")
                else:
                    (path / "io.max").write_text(f"{major}:{minor} rbps={rate}")
        except OSError:
            cg.remove()
            raise
        return cg

    def bytes_read(self) -> int:
        """Bytes read from the limited disks by processes in the cgroup so far."""
        devs = {f"{major}:{minor}" for major, minor in self.devices}
        try:
            if self.version == 1:
                text = (self.path / "blkio.throttle.io_service_bytes").read_text()
                return sum(
                    int(f[2])
                    for f in (l.split() for l in text.splitlines())
                    if len(f) == 3 and f[0] in devs and f[1] == "Read"
                )
            text = (self.path / "io.stat").read_text()
            return sum(
                int(dict(kv.split("=") for kv in line.split()[1:]).get("rbytes", 0))
                for line in text.splitlines()
                if line.split(" ", 1)[0] in devs
            )
        except OSError:
            return 0

    def describe(self) -> dict:
        """The limit per device, and the store's whole read rate under it (every device at once)."""
        return {
            "rate_bytes_per_s": self.rate,
            "devices": [f"{major}:{minor}" for major, minor in self.devices],
            "store_rate_bytes_per_s": self.rate * len(self.devices),
            "cgroup": str(self.path),
            "cgroup_version": self.version,
        }


def stripe_dirs(store) -> list[Path]:
    """The directories holding a store's experts: the store, and its stripe directories if any."""
    from edge0.store.format import MANIFEST
    from edge0.store.stripes import store_dirs

    try:
        manifest = json.loads((Path(store) / MANIFEST).read_text())
    except (OSError, ValueError):
        return [Path(store)]
    return store_dirs(store, manifest)


def read_limit_refusal(store, rate: int) -> str:
    """Why a read limit of `rate` bytes/s on `store`'s disk cannot be set here ("" if it can): a
    limit is made and removed, so the kernel and the permissions are both asked."""
    try:
        ReadLimit.create(store, rate).remove()
    except (OSError, ValueError) as e:
        return str(e) if isinstance(e, ValueError) else f"{e.filename or store}: {e.strerror}"
    return ""


@contextmanager
def read_limited(store, rate: int | None) -> Iterator[ReadLimit | None]:
    """A read limit of `rate` bytes/s on the disk holding `store` while the block runs (None: no
    limit). Start a process inside it with `preexec_fn=enter_all(limit, ...)`; `bytes_read()` is
    what that process read from the disk. Any bench arm can run this way:

        with read_limited(store, 200_000_000) as lim:
            subprocess.run(cmd, preexec_fn=enter_all(lim))
            device_bytes = lim.bytes_read()
    """
    if rate is None:
        yield None
        return
    lim = ReadLimit.create(store, rate)
    try:
        yield lim
    finally:
        lim.remove()


def enter_all(*cgroups):
    """A preexec_fn that moves the child into every given cgroup (None entries skipped), or None."""
    live = [c for c in cgroups if c is not None]
    if not live:
        return None

    def enter():
        for c in live:
            c.enter()

    return enter
