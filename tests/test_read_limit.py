"""The read limit (a block-I/O cgroup) really limits reads from the store's disk: bytes are
accounted to the cgroup, and a cold read of N bytes at RATE takes at least N / RATE (a lower
bound, which a slow machine cannot break)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from edge0.bench.cgroup import ReadLimit, block_device, enter_all

READER = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
n = 0
while chunk := os.read(fd, 1 << 20):
    n += len(chunk)
print(n)
"""


def test_block_device_of_a_regular_file(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"x")
    dev = block_device(f)
    assert dev is None or (dev[0] > 0 and os.path.exists(f"/sys/dev/block/{dev[0]}:{dev[1]}"))


def test_reads_are_throttled_and_accounted(tmp_path):
    parent, _, reason = ReadLimit.parent()
    if parent is None:
        pytest.skip(reason)
    if block_device(tmp_path) is None:
        pytest.skip(f"{tmp_path} has no block device")
    data = tmp_path / "data.bin"
    size, rate = 24 << 20, 40 << 20
    data.write_bytes(os.urandom(size))
    os.sync()
    lim = ReadLimit.create(tmp_path, rate)
    try:
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-c", READER, str(data)],
            capture_output=True,
            text=True,
            preexec_fn=enter_all(lim),
            check=True,
        )
        elapsed = time.perf_counter() - t0
        assert int(r.stdout) == size
        assert lim.bytes_read() >= size * 0.9
        assert elapsed >= 0.8 * size / rate  # throttled: at least (nearly) size / rate
        assert lim.describe()["rate_bytes_per_s"] == rate
    finally:
        lim.remove()
    assert not lim.path.exists()
