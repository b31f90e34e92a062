"""Decode memory follows the experts touched, not the model size.

Bound (stated in docs/architecture.md): process peak RSS while decoding <= peak RSS before the
model is loaded + resident weights + bytes of the distinct experts touched + 64 MiB
(KV cache, MLX temporaries, one layer's staged experts, Python objects)."""

import json
import subprocess
import sys

import pytest

from tests.fixtures.make import make_memory_fixture, routed_expert_bytes

CONSTANT = 64 * 2**20
# hidden 512 so each expert is ~0.44 MB in int4; 128 experts x 2 layers ~ 113 MB of experts.
BIG = {"hidden_size": 512, "moe_intermediate_size": 512, "num_experts": 128, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
       "dtype": "bfloat16"}

PROBE = r"""
import json, sys
from edge0.backend import core as B
import edge0, edge0.engine, mlx_lm, transformers  # imports are not the model's memory
before = B.peak_rss()
engine = edge0.load(sys.argv[1], decode_executor="exact")  # no cache: only touched experts
res = engine.generate("hello world once upon a time", max_tokens=8, ignore_eos=True)
s = engine.stats()
per_expert = engine.store.expert_nbytes(engine.store.layers and next(iter(engine.store.layers)))
print(json.dumps({"before": before, "peak": B.peak_rss(), "resident": engine.resident_bytes,
                  "touched": s["totals"]["distinct_experts"] * per_expert,
                  "all_experts": sum(engine.store.expert_nbytes(l) * v["num_experts"] for l, v in engine.store.layers.items()),
                  "mlx_peak": res.stats["peak_memory_bytes"]}))
"""


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    from edge0.convert import convert

    root = tmp_path_factory.mktemp("memory")
    hf, ratio = make_memory_fixture(root / "hf", **BIG)
    assert ratio >= 10
    routed, other = routed_expert_bytes(hf)
    assert routed >= 10 * other
    return convert(str(hf), root / "store", quiet=True)


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
