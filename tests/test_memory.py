"""Decode memory follows the experts touched, not the model size.

Bound (stated in docs/architecture.md): process peak RSS while decoding <= peak RSS before the
model is loaded + resident weights + bytes of the distinct experts touched + 64 MiB
(KV cache, MLX temporaries, one layer's staged experts, Python objects)."""

import json
import os
import subprocess
import sys

import pytest

CONSTANT = 64 * 2**20
PROBE = r"""
import json, sys
from edge0.backend import core as B
import edge0, edge0.engine.engine, edge0.runtime, mlx_lm, transformers  # imports are not the model's memory
before = B.peak_rss()
engine = edge0.load(sys.argv[1], decode_executor="exact")  # no cache: only touched experts
res = engine.generate("hello world once upon a time", max_tokens=8, ignore_eos=True)
s = engine.stats()
per_expert = engine.store.expert_nbytes(engine.store.layers and next(iter(engine.store.layers)))
print(json.dumps({"before": before, "peak": B.peak_rss(), "resident": engine.resident_bytes,
                  "touched": s["totals"]["distinct_experts"] * per_expert,
                  "all_experts": sum(engine.store.expert_nbytes(l) * v["num_experts"]
                                     for l, v in engine.store.layers.items()),
                  "mlx_peak": res.stats["peak_memory_bytes"]}))
"""


def test_decode_peak_follows_touched_experts(big_store):
    out = subprocess.run([sys.executable, "-c", PROBE, str(big_store)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["all_experts"] > 100 * 2**20  # big enough for the bound to mean something
    assert m["touched"] < m["all_experts"] / 2
    growth = m["peak"] - m["before"]
    bound = m["resident"] + m["touched"] + CONSTANT
    assert growth <= bound, m
    # The bound is far below what holding every expert would need.
    assert bound < m["resident"] + m["all_experts"]


HEAP_PROBE = r"""
import ctypes, sys, tempfile
from concurrent.futures import ThreadPoolExecutor
import numpy as np
from edge0.backend.core import one_heap

set_ = one_heap() if sys.argv[1] == "on" else False
with ThreadPoolExecutor(4) as pool:  # readers: each allocates what the main thread frees
    bufs = list(pool.map(lambda _: np.ones(1 << 16, np.uint8), range(64)))
del bufs
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile("r") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    print(set_, f.read().count("<heap nr="))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_engines_reader_threads_allocate_from_one_heap():
    """Four threads allocating: glibc's default gives them heaps of their own (each keeping its
    freed memory), one_heap (called by edge0.load) keeps one; a user's own malloc tuning wins."""

    def heaps(mode, **env):
        out = subprocess.run(
            [sys.executable, "-c", HEAP_PROBE, mode],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )
        assert out.returncode == 0, out.stderr
        set_, n = out.stdout.split()
        return set_ == "True", int(n)

    set_, n = heaps("off")
    assert not set_ and n > 1
    assert heaps("on") == (True, 1)
    set_, n = heaps("on", MALLOC_ARENA_MAX="4")
    assert not set_ and n > 1
