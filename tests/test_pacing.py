"""The paced disk (--pace-reads): each read's storage bytes queue behind the ones before and arrive
at the rate, idle time earning nothing; page-cache hits are free; outputs do not change."""

import os
import threading

import numpy as np
import pytest

import edge0
from edge0.errors import Edge0Error
from edge0.options import LoadOptions
from edge0.store import ExpertStore, open_manifest
from edge0.store.pacing import StoragePacer, thread_storage_bytes

MB = 10**6


class Clock:
    """A fake monotonic clock; `sleep` advances it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_reads_queue_at_the_rate_and_idle_time_earns_nothing():
    clock = Clock()
    storage = iter([0, 1 * MB, 1 * MB, 3 * MB, 3 * MB, 4 * MB])  # the thread's read_bytes before/after each read
    pacer = StoragePacer(1 * MB, clock, clock.sleep, measure=lambda: next(storage))

    def takes(s):
        return lambda: clock.sleep(s)

    pacer.read(takes(0.1), 1 * MB)  # 1 MB from storage at 1 MB/s: done at 1.0, the real 0.1 s inside it
    assert clock.now == pytest.approx(1.0)
    pacer.read(takes(0.0), 2 * MB)  # issued at 1.0, 2 MB: done at 3.0
    assert clock.now == pytest.approx(3.0)
    clock.now = 10.0  # idle for 7 s
    pacer.read(takes(0.0), 1 * MB)  # a burst after idle is no faster: done at 11.0
    assert clock.now == pytest.approx(11.0)
    s = pacer.stats()
    assert (s["reads"], s["storage_bytes"], s["storage_bytes_source"]) == (3, 4 * MB, "kernel (read_bytes)")
    assert s["waited_s"] == pytest.approx(0.9 + 2.0 + 1.0)


def test_reads_in_flight_together_share_the_bandwidth():
    clock = Clock()
    pacer = StoragePacer(2 * MB, clock, clock.sleep, measure=lambda: 0)
    # two reads issued at t=5 (two threads), 1 MB each: the disk delivers the second after the first
    done = []
    for _ in range(2):
        clock.now = 5.0
        pacer.complete(5.0, 1 * MB)
        done.append(clock.now)
    assert done == pytest.approx([5.5, 6.0])


def test_page_cache_hits_are_free_and_no_kernel_count_charges_what_was_asked():
    clock = Clock()
    pacer = StoragePacer(1 * MB, clock, clock.sleep, measure=lambda: 7)  # read_bytes did not move: cached
    pacer.read(lambda: None, 5 * MB)
    assert (clock.now, pacer.stats()["storage_bytes"]) == (0.0, 0)
    blind = StoragePacer(1 * MB, clock, clock.sleep, measure=lambda: None)  # no /proc/thread-self/io
    blind.read(lambda: None, 2 * MB)
    assert clock.now == pytest.approx(2.0)
    assert blind.stats()["storage_bytes_source"] == "bytes asked for"
    with pytest.raises(ValueError):
        StoragePacer(0)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/io"), reason="Linux counts storage bytes per thread")
def test_the_kernel_count_is_per_thread_and_misses_only(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    with open(path, "rb") as f:
        f.read()  # now in the page cache
    before = thread_storage_bytes()
    with open(path, "rb") as f:
        assert len(f.read()) == 1 << 20
    assert thread_storage_bytes() - before == 0
    seen = []
    t = threading.Thread(target=lambda: seen.append(thread_storage_bytes()))
    t.start()
    t.join()
    assert isinstance(seen[0], int) and seen[0] >= 0


def test_a_paced_store_reads_the_same_bytes_and_charges_each_range(store_for):
    root = store_for("qwen3_moe")
    plain = ExpertStore(root, open_manifest(root), io="pread")
    paced = ExpertStore(root, open_manifest(root), io="pread", pace_reads=100 * MB)
    clock = Clock()
    asked = []
    pacer = StoragePacer(100 * MB, clock, clock.sleep, measure=lambda: None)
    orig = pacer.complete
    pacer.complete = lambda issued, n, measured=True: (asked.append(n), orig(issued, n, measured))[1]
    paced._reader.pacer = pacer
    want, got = plain.read(0, [4, 2, 3]), paced.read(0, [4, 2, 3])
    for name, (buf, _, _) in want.items():
        np.testing.assert_array_equal(got[name][0], buf, err_msg=name)
    stride = paced.layers[0]["expert_stride"]
    assert sorted(asked) == [stride, 2 * stride]  # expert 4, then the run 2-3: one read each
    assert clock.now == pytest.approx(3 * stride / (100 * MB))
    assert paced.io_stats()["paced"]["reads"] == 2
    assert "paced as a 100 MB/s disk" in paced.describe_io()


def test_pace_reads_option_parses_rates_and_keeps_tokens(store_for):
    assert LoadOptions(pace_reads="20MB/s").validate().pace_reads == 20 * MB
    with pytest.raises(Edge0Error, match="--pace-reads 1KB/s: at least 1MB/s"):
        LoadOptions(pace_reads="1KB/s").validate()
    with pytest.raises(Edge0Error, match="--pace-reads 'fast'"):
        LoadOptions(pace_reads="fast").validate()
    root = store_for("qwen3_moe")
    base = edge0.load(root, prerouter=False, decode_executor="exact")
    paced = edge0.load(root, prerouter=False, decode_executor="exact", pace_reads="2GB/s")
    prompt = [5, 9, 2, 7]
    want = base.generate(prompt, max_tokens=6, ignore_eos=True).tokens
    assert paced.generate(prompt, max_tokens=6, ignore_eos=True).tokens == want
    s = paced.stats()["io"]["paced"]
    assert s["rate_bytes_per_s"] == 2000 * MB and s["reads"] > 0
    assert base.stats()["io"]["paced"] is None
