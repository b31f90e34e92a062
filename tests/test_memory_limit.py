"""`edge0 generate` with the default expert cache inside a memory cgroup whose limit is smaller than
the store: the default budget comes from the cgroup limit (named in the describe line), so the run
completes instead of being OOM-killed (issue 23: a 1.4 GB limit killed a default run of a 2.25 GB
store). Skipped, with the reason, where a child memory cgroup cannot be made."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge0.bench.cgroup import MemoryCgroup
from edge0.store.format import RESIDENT_FILE

ROOT = Path(__file__).resolve().parents[1]
# 14 MoE layers x 64 experts of 0.33 MB (int4, hidden 256, moe_intermediate 768): a 297 MB store
# whose other weights are under 1 MB: the limit below is under the store and still above what the
# default budget reserves (this process ~60 MB, KV cache 29 MB, prefill 67 MB, headroom 67 MB)
# plus one route (19 MB), with a margin of ~40 MB.
SHAPE = dict(hidden=256, layers=14, experts=64, moe_intermediate=768, top_k=4)
LIMIT = 280 * 10**6


@pytest.fixture(scope="module")
def big_bench_store(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_bench_model", ROOT / "scripts" / "make_bench_model.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    out = tmp_path_factory.mktemp("limit") / "model"
    with contextlib.redirect_stderr(io.StringIO()):
        maker.make_bench_model(out, "tiny", quiet=True, **SHAPE)
    shutil.rmtree(out / "mlx")  # only the store is served
    return out / "store"


def test_default_expert_cache_fits_a_memory_limit_smaller_than_the_store(big_bench_store):
    parent, why = MemoryCgroup.available()
    if parent is None:
        pytest.skip(why)
    store = big_bench_store
    store_bytes = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
    resident = (store / RESIDENT_FILE).stat().st_size
    assert LIMIT < store_bytes + resident and resident < store_bytes / 100
    cg = MemoryCgroup.create(parent, LIMIT)
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "edge0",
                "generate",
                "--model",
                str(store),
                "--prompt",
                "The history of",
                "--max-tokens",
                "4",
                "--stats",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=cg.enter,
        )
        report = cg.report()
    finally:
        cg.remove()
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:], report)
    assert report["oom_kills"] == 0 and report["max_usage_bytes"] <= LIMIT
    describe = r.stderr.splitlines()[0]
    assert f"available after loading (cgroup limit {LIMIT / 1e9:.2f} GB" in describe, describe
    cache = describe.split("expert cache ")[1].split()[:2]  # e.g. ['48.02', 'MB']
    assert float(cache[0]) * {"MB": 1e6, "GB": 1e9}[cache[1]] < store_bytes / 2  # the limit bit
    assert "generated 4 tok" in r.stderr


SESSION = """
import json, sys
import edge0
engine = edge0.load(sys.argv[1])  # the defaults: expert cache and prompt-cache memory from the limit
convs = [[(7 * i + k) % 200 + 10 for i in range(n)] for k, n in enumerate((300, 120, 200))]
prefilled = []
for turn in range(2):  # three conversations interleaved, twice: the second turns reuse their prefixes
    for conv in convs:
        r = engine.generate(conv, max_tokens=3, reuse_cache=True, ignore_eos=True)
        prefilled.append(r.stats["prefill_tokens"])
        conv += r.tokens + [11, 12]
print(json.dumps({"prefilled": prefilled, "pool": engine.kv.stats()["memory"]}))
"""


# Three conversations' KV caches and 300-token prefills hold more than the 4-token generate above:
# at LIMIT the session peaked within 2 MB of it and was OOM-killed once in three runs under a loaded
# suite; 12 MB more, still under the store plus its resident weights (298.5 MB).
SESSION_LIMIT = 292 * 10**6


@pytest.mark.slow  # 24 s: a 297 MB store's experts read through a memory limit six times
def test_a_session_of_three_conversations_runs_inside_the_limit_with_the_defaults(big_bench_store):
    parent, why = MemoryCgroup.available()
    if parent is None:
        pytest.skip(why)
    store_bytes = sum(f.stat().st_size for f in big_bench_store.rglob("*") if f.is_file())
    assert SESSION_LIMIT < store_bytes  # every file of the store, its resident weights included
    cg = MemoryCgroup.create(parent, SESSION_LIMIT)
    try:
        r = subprocess.run(
            [sys.executable, "-c", SESSION, str(big_bench_store)],
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=cg.enter,
            cwd=ROOT,
        )
        report = cg.report()
    finally:
        cg.remove()
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:], report)
    assert report["oom_kills"] == 0 and report["max_usage_bytes"] <= SESSION_LIMIT
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # later turns: the reply's last token (generated, never fed) and the two new ones
    assert out["prefilled"][:3] == [300, 120, 200] and out["prefilled"][3:] == [3, 3, 3], out
    assert out["pool"]["hits"] >= 3 and out["pool"]["max_bytes"] > 0
