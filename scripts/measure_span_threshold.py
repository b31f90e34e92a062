"""Union of the routes against whole-layer reads for short prefill spans: prefill time, bytes
read and stall for spans of 4-64 tokens, each mode forced, on the page cache (pread) or
bypassing it (direct). The measurement behind SPAN_WHOLE_FACTOR (docs/long-prompts.md).

    PYTHONPATH=$PWD python scripts/measure_span_threshold.py STORE pread|direct
"""

import json
import sys
import time

import edge0
from edge0.streaming import dispatch

store = sys.argv[1]
io = sys.argv[2] if len(sys.argv) > 2 else "pread"
engine = edge0.load(store, prerouter=False, expert_cache="400MB", io=io)
ids = [(37 * i) % 30000 + 100 for i in range(200)]
engine.generate(ids[:40], max_tokens=1)  # warm-up
rows = []
for T in (4, 8, 16, 24, 32, 48, 64):
    for mode, factor in (("union", 10**9), ("whole", 0)):
        dispatch.SPAN_WHOLE_FACTOR = factor
        best = None
        for rep in range(2):
            engine.reset_cache()
            t0 = time.perf_counter()
            st = engine.generate(ids[rep * 70 : rep * 70 + T + 1], max_tokens=1).stats
            dt = time.perf_counter() - t0
            if best is None or dt < best[0]:
                best = (dt, st["prefill_expert_bytes_read"], st["prefill_stall_ms"])
        rows.append(
            {"T": T, "mode": mode, "s": round(best[0], 3), "MB": round(best[1] / 1e6, 1), "stall_ms": round(best[2])}
        )
        print(rows[-1], flush=True)
json.dump(rows, open(f"docs/benchmarks/span-threshold-{io}.json", "w"), indent=1)
