"""Cost of checking the resident weights at load (model.safetensors hashed on a thread while the
backend loads it): `edge0.load` time with no check, with sha256 and with crc32 (expected values
computed here, so any store can be measured, whichever hash its manifest carries),
with the page cache warm and with model.safetensors evicted first; interleaved runs, each in a
fresh process. Also the single-thread throughput of each hash over the file.

    python scripts/measure_resident_check.py STORE [--repeats 5] [--out docs/benchmarks/resident-check.json]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = """
import json, sys, time
from pathlib import Path
import edge0
import edge0.engine.load as L
from edge0.store import resident
from edge0.store.pagecache import evict

store, mode, cold, crc, sha = sys.argv[1], sys.argv[2], sys.argv[3] == "cold", sys.argv[4], sys.argv[5]


path = Path(store) / "model.safetensors"
if mode == "off":
    L.check_resident = lambda root, manifest: None
elif mode == "crc32":
    L.check_resident = lambda root, manifest: resident.ResidentCheck(path, crc, resident.Crc32, "crc32").start()
else:
    L.check_resident = lambda root, manifest: resident.ResidentCheck(path, sha).start()
if cold:
    evict([Path(store) / "model.safetensors"])
t0 = time.perf_counter()
e = edge0.load(store, prerouter=False, lora=False)
print(json.dumps({"load_s": time.perf_counter() - t0, "describe": e.describe()}))
"""


def throughput(path: Path, update) -> float:
    """Seconds to hash the file already in memory (best of 3, one thread)."""
    data = path.read_bytes()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        update(data)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store", type=Path)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    resident = args.store / "model.safetensors"
    data = resident.read_bytes()
    crc, sha = f"{zlib.crc32(data):08x}", hashlib.sha256(data).hexdigest()
    del data
    hash_s = {
        "sha256": throughput(resident, lambda b: hashlib.sha256(b).hexdigest()),
        "crc32": throughput(resident, zlib.crc32),
    }
    modes = ("off", "sha256", "crc32")
    runs = {f"{m}-{c}": [] for c in ("warm", "cold") for m in modes}
    for i in range(args.repeats):
        order = modes if i % 2 == 0 else modes[::-1]
        for cache in ("warm", "cold"):
            for mode in order:
                if cache == "warm":
                    resident.read_bytes()
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, str(args.store), mode, cache, crc, sha],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                r = json.loads(out.stdout.strip().splitlines()[-1])
                runs[f"{mode}-{cache}"].append(r["load_s"])
                print(f"{mode}-{cache}: load {r['load_s']:.3f} s", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python scripts/measure_resident_check.py " + " ".join(sys.argv[1:]),
        "file_bytes": resident.stat().st_size,
        "hash_s_one_thread": hash_s,
        "load_s_median": med,
        "cost_s": {
            f"{m}-{c}": med[f"{m}-{c}"] - med[f"off-{c}"] for c in ("warm", "cold") for m in ("sha256", "crc32")
        },
        "runs": runs,
    }
    print(json.dumps({k: result[k] for k in ("file_bytes", "hash_s_one_thread", "load_s_median", "cost_s")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
