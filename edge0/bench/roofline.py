"""The decode roofline: a streamed decode step is no faster than its compute (what resident mlx-lm
takes for it) nor than its reads (the expert bytes read per generated token at the disk's rate):

    roofline = min(resident decode tok/s, read rate / expert bytes read per generated token)

and an arm's efficiency is its decode rate over that. The read rate is --read-limit for the
capped arms; for the cold ones it is the store's disk measured first (`measure_read_rate`), at the
store's read size (one expert row) and the reader's queue depth, with the page cache dropped, so
the figure holds on any machine; for the warm ones, whose reads are copies out of the page cache,
the same reads measured with the store's files in the page cache (judged at the disk's rate, a
warm arm showed efficiencies above 1)."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

from edge0.store.format import MANIFEST
from edge0.store.pagecache import evict
from edge0.store.readers import DEFAULT_QUEUE_DEPTH
from edge0.store.stripes import layer_parts, store_dirs


def measure_read_rate(
    store: Path, queue_depth: int = DEFAULT_QUEUE_DEPTH, seconds: float = 3.0, warm: bool = False
) -> dict:
    """Random expert-row reads over the store's expert files, `queue_depth` at a time, for up to
    `seconds` (or the whole store once): bytes per second, after dropping those files from the
    page cache (`page_cache_dropped` False where the OS cannot: the rate may then be memory's);
    `warm`: after reading them whole instead, so the rate is the page cache's. A store striped
    over several directories reads each one's parts of the rows, `queue_depth` per directory."""
    store = Path(store)
    manifest = json.loads((store / MANIFEST).read_text())
    dirs = store_dirs(store, manifest)
    rows = [
        (dirs[p["dir"]] / p["file"], int(p["offset"]) + i * int(p["row_bytes"]), int(p["row_bytes"]))
        for e in manifest["expert_layers"]
        for p in layer_parts(e)
        if p["row_bytes"]
        for i in range(int(e["num_experts"]))
    ]
    random.Random(0).shuffle(rows)
    files = sorted({f for f, _, _ in rows})
    if warm:
        for f in files:
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
    dropped = not warm and evict(files) is not None
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    queue_depth *= len(dirs)
    lock, next_row, total = threading.Lock(), [0], [0]
    deadline = time.monotonic() + seconds

    def worker():
        while time.monotonic() < deadline:
            with lock:
                if next_row[0] >= len(rows):
                    return
                f, offset, n = rows[next_row[0]]
                next_row[0] += 1
            got = len(os.pread(fds[f], n, offset))
            with lock:
                total[0] += got

    started = time.monotonic()
    try:
        threads = [threading.Thread(target=worker) for _ in range(queue_depth)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for fd in fds.values():
            os.close(fd)
    elapsed = time.monotonic() - started
    strides = sorted(n for _, _, n in rows)
    return {
        "bytes_per_s": total[0] / elapsed if elapsed > 0 else None,
        "bytes": total[0],
        "seconds": elapsed,
        "read_size": strides[len(strides) // 2],
        "queue_depth": queue_depth,
        "page_cache_dropped": dropped,
        "warm": warm,
    }


def arm_roofline(arm: dict, resident_tps: float | None, rate: float | None) -> dict | None:
    """Per arm: expert bytes read per generated token during decode, the read rate it achieved
    then, its roofline at `rate` and its efficiency (None for an arm with no decode reads figure)."""
    m = arm["metrics"]
    tps, read = m.get("decode_tps"), m.get("decode_expert_bytes_read")
    n = m.get("generation_tokens")
    if arm["status"] != "ok" or arm.get("runtime") != "edge0" or not tps or read is None or not n or n < 2:
        return None
    per_token = read / (n - 1)
    limits = [x for x in (resident_tps, rate / per_token if rate and per_token else None) if x]
    roof = min(limits) if limits else None
    return {
        "bytes_per_token": per_token,
        "achieved_read_rate": per_token * tps,
        "read_rate": rate,
        "roofline_tps": roof,
        "efficiency": tps / roof if roof else None,
        "bound": None if roof is None else ("compute" if roof == resident_tps else "reads"),
        "lookahead_recall": m.get("lookahead_recall"),
        "wasted_per_token": (m.get("lookahead_wasted_bytes") or 0) / (n - 1),  # of bytes_per_token
        "early_per_step": m.get("early_experts_per_step"),
        "early_unused_per_step": m.get("early_unused_per_step"),
    }


def add_rooflines(result: dict, device_rate: float | None, page_cache_rate: float | None = None) -> None:
    """`roofline` on every Edge0 arm of `result`: capped arms at --read-limit, warm arms at the
    page cache's rate (the device rate if not measured), the others at the measured device rate."""
    arms = result["arms"]
    ref = next((a for a in arms if a["name"] == "mlx-lm-resident" and a["status"] == "ok"), None)
    resident = ref["metrics"]["decode_tps"] if ref else None
    rl = result["settings"].get("read_limit") or {}
    limit = rl.get("store_rate_bytes_per_s") or rl.get("rate_bytes_per_s")
    for a in arms:
        rate = device_rate
        if limit and a["storage"] == "capped":
            rate = limit
        elif a["storage"] == "warm" and page_cache_rate:
            rate = page_cache_rate
        a["roofline"] = arm_roofline(a, resident, rate)
