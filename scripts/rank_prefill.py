"""Prefill of a 4,096-token prompt (and 2 decoded tokens) with a 22 MB expert cache: time, and the
expert bytes each rank read against its stage's. One process, or each rank under mlx.launch:

    python scripts/rank_prefill.py STORE OUT.json
    mlx.launch -n 2 --backend ring -- python scripts/rank_prefill.py STORE OUT.json

Rank 0 writes OUT.json (docs/benchmarks.md, "A long prompt across two ranks")."""

import json
import sys
import time

import edge0

store, out = sys.argv[1], sys.argv[2]
e = edge0.load(store, prerouter=False, expert_cache="22MB")
ids = [(i * 7919) % 2000 + 10 for i in range(4096)]
if e.follower:
    e.follow()
    sys.exit(0)
t0 = time.perf_counter()
r = e.generate(ids, max_tokens=2, ignore_eos=True)
wall = time.perf_counter() - t0
s = e.stats()
res = {
    "wall_s": wall,
    "prefill_tps": r.stats["prefill_tps"],
    "prefill_tokens": r.stats["prefill_tokens"],
    "expert_bytes_read": r.stats["expert_bytes_read"],
    "store_expert_bytes": e.streaming.total_expert_bytes,
    "describe": e.describe(),
}
keys = ("rank", "stage", "expert_bytes", "expert_bytes_read", "expert_cache_bytes")
if "ranks" in s:
    res["ranks"] = [{k: x[k] for k in keys} for x in s["ranks"]]
e.close()
with open(out, "w") as fh:
    json.dump(res, fh, indent=1)
print(json.dumps(res, indent=1))
