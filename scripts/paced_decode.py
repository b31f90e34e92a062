"""Decode at a paced read rate (`--pace-reads`): tok/s, storage bytes read a generated token, the
paced disk's busy share, and the roofline (rate / bytes a token) the decode is judged by.

    python scripts/paced_decode.py STORE 20MB/s ['{"lookahead": "off"}']

The optional JSON adds load options. One process, 48 greedy tokens of a fixed prompt, a 22 MB
expert cache, reads cold (O_DIRECT or dropped pages) and paced with no credit for idle time
(edge0/store/pacing.py); decode timed from the first token on. Prints one JSON line."""

import json
import sys
import time

import edge0
import edge0.units

if len(sys.argv) not in (3, 4):
    sys.exit(__doc__.split("\n\n")[1].strip())
store, rate = sys.argv[1], sys.argv[2]
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
rate_b = edge0.units.parse_rate(rate, "RATE")
e = edge0.load(store, prerouter=False, lora=False, cold_reads=True, pace_reads=rate, expert_cache="22MB", **extra)
ids = e.encode("The quick brown fox jumps over the lazy dog and then " * 3)
n = 0
for _ in e.stream_generate(ids, max_tokens=48, ignore_eos=True):
    n += 1
    if n == 1:  # decode from here: the prompt's reads are done
        t1 = time.perf_counter()
        paced1, totals1 = e.store.io_stats()["paced"]["storage_bytes"], e.streaming.stats.totals()
wall = time.perf_counter() - t1
paced2, totals2 = e.store.io_stats()["paced"]["storage_bytes"], e.streaming.stats.totals()
tokens, nbytes = n - 1, paced2 - paced1
tok_s, roofline = tokens / wall, rate_b / (nbytes / tokens)
print(
    json.dumps(
        {
            "tok_s": round(tok_s, 3),
            "storage_MB_per_token": round(nbytes / tokens / 1e6, 2),
            "roofline_tok_s": round(roofline, 3),
            "efficiency": round(tok_s / roofline, 3),
            "disk_busy": round(nbytes / rate_b / wall, 3),
            "read_ahead_for_nothing_MB": round(
                (totals2["lookahead_wasted_bytes"] - totals1["lookahead_wasted_bytes"]) / 1e6, 1
            ),
            "stall_ms_per_token": round((totals2["stall_ms"] - totals1["stall_ms"]) / tokens, 1),
        }
    )
)
