"""Recovery LoRA: the unmerged delta is exact, targets are strict, adapters are tied to their base,
K and pre-router, damaged files are refused, train-lora lowers the distillation loss and writes an
adapter that serving applies as exactly the low-rank delta path."""

import contextlib
import io
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import edge0
from edge0.backend import lora as blora
from edge0.backend import modules as bmod
from edge0.errors import Edge0Error
from edge0.lora.adapter import read_adapter, save_adapter
from edge0.store.format import manifest_hash
from tests.fixtures.make import fixture_dir

TEXT = "Once upon a time there was a tiny model that read its experts from disk. " * 60
PROMPT = "Once upon a time there was"


def test_unmerged_output_is_base_plus_analytic_delta():
    base = nn.Linear(3, 2)
    base.weight = mx.array([[1.0, 2.0, 0.0], [0.0, -1.0, 3.0]])
    base.bias = mx.array([0.5, -1.0])
    layer = blora.LoRALinear(base, r=2, alpha=4.0)  # scale alpha / r = 2
    layer.lora_a = mx.array([[1.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    layer.lora_b = mx.array([[1.0, 0.0], [0.5, -1.0]])
    y = layer(mx.array([[1.0, 2.0, 3.0]]))
    mx.eval(y)
    # base: [1 + 4 + 0.5, -2 + 9 - 1] = [5.5, 6]; x A^T = [4, 4]; (x A^T) B^T = [4, -2]; x 2 = [8, -4]
    assert np.array(y).tolist() == [[13.5, 2.0]]
    assert blora.trainable_parameters(layer) == ["lora_a", "lora_b"]


def test_unmerged_delta_on_a_quantized_base():
    rng = np.random.default_rng(0)
    lin = nn.Linear(64, 8, bias=False)
    lin.weight = mx.array(rng.normal(size=(8, 64)).astype(np.float32))
    q = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
    layer = blora.LoRALinear(q, r=4, alpha=8.0)
    a, b = rng.normal(size=(4, 64)).astype(np.float32), rng.normal(size=(8, 4)).astype(np.float32)
    layer.lora_a, layer.lora_b = mx.array(a), mx.array(b)
    x = rng.normal(size=(1, 5, 64)).astype(np.float32)
    y, base = layer(mx.array(x)), q(mx.array(x))
    mx.eval(y, base)
    np.testing.assert_allclose(np.array(y), np.array(base) + 2.0 * (x @ a.T) @ b.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("how", blora.MERGES)
def test_merge_keeps_whole_steps_and_erases_sub_step_deltas(how):
    # every 64-wide group holds 0..15 four times: the int4 grid is exactly the integers (step 1)
    lin = nn.Linear(64, 2, bias=False)
    lin.weight = mx.array(np.tile(np.arange(64) % 16, (2, 1)).astype(np.float32))
    q = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
    kept = {}
    for d in (1.0, 0.3):  # delta on weight[:, 5] (value 5): a whole step, then under half a step
        layer = blora.LoRALinear(q, r=1, alpha=1.0)
        layer.lora_a = mx.array(np.eye(64, dtype=np.float32)[5:6])
        layer.lora_b = mx.array([[d], [0.0]])
        merged, st = blora.merged_linear(layer, how)
        w = np.array(merged(mx.eye(64)).T)  # the merged weight, read through the module
        assert w[1].tolist() == (np.arange(64) % 16).tolist()
        kept[d] = (w[0, 5] - 5.0, st["delta_kept"], st["below_half_step"])
    assert kept[1.0] == (1.0, 1.0, 127 / 128)  # every zero entry of the delta counts as under half a step
    if how == "float":
        np.testing.assert_allclose(kept[0.3][:2], (0.3, 1.0), rtol=1e-6)
    else:  # requantized: the sub-step delta rounds back to the old code
        assert kept[0.3][:2] == (0.0, 0.0)
    assert kept[0.3][2] == 1.0


@pytest.fixture(scope="module")
def store(store_for):
    return store_for("qwen3_moe")


@pytest.fixture(scope="module")
def heads(store, tmp_path_factory):
    from edge0.prerouter.train import train, write

    def make(seed):
        e = edge0.load(store, prerouter=False, decode_executor="exact")
        tensors, meta, _ = train(e, TEXT, data_name="t", window=64, steps=30, seed=seed, progress=False)
        return write(tmp_path_factory.mktemp("heads") / f"heads{seed}.safetensors", tensors, meta)

    return make(0), make(1)


@pytest.fixture(scope="module")
def trained(store, heads, tmp_path_factory):
    """A short train-lora run (both phases) on the fixture store with its heads."""
    from edge0.cli.train_lora import main

    d = tmp_path_factory.mktemp("lora")
    (d / "train.txt").write_text("disk " * 400)  # few distinct prompts: a short run can generalize
    out = d / "adapter.safetensors"
    argv = [
        "--model",
        str(store),
        "--teacher",
        str(fixture_dir("qwen3_moe")),
        "--data",
        str(d / "train.txt"),
        "--out",
        str(out),
        "--prerouter",
        str(heads[0]),
        "--sft-steps",
        "2",
        "--distill-steps",
        "12",
        "--batch",
        "2",
        "--prompt-tokens",
        "12",
        "--gen-tokens",
        "16",
        "--val-windows",
        "2",
        "--val-window",
        "48",
        "--lr",
        "3e-4",
        "--teacher-temperature",
        "0",
        "--student-temperature",
        "0",
    ]
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    return out


def test_train_lora_lowers_the_distillation_loss_and_records_provenance(store, heads, trained):
    tensors, meta = read_adapter(trained)
    v = meta["provenance"]["validation"]
    assert v["probe_distill_loss_after"] < v["probe_distill_loss_before"]
    assert v["after"]["kl_to_teacher"] < v["before"]["kl_to_teacher"]
    assert meta["manifest_sha256"] == manifest_hash(store)
    assert meta["top_k"] == 2 and meta["r"] == 16 and meta["alpha"] == 32.0
    assert meta["prerouter_sha256"] is not None
    assert all(".self_attn." in t for t in meta["targets"]) and len(meta["targets"]) == 8
    assert any(np.abs(v).sum() > 0 for k, v in tensors.items() if k.endswith("lora_b"))  # B left zero
    e = edge0.load(store, prerouter=heads[0], lora=trained)
    assert e.lora_path == trained
    assert len(blora.lora_modules(e.model)) == 8
    assert e.generate(PROMPT, max_tokens=4, ignore_eos=True).tokens


def test_train_lora_continues_an_adapter(store, heads, trained, tmp_path):
    from edge0.cli.train_lora import main

    (tmp_path / "train.txt").write_text("disk " * 400)
    out = tmp_path / "more.safetensors"
    argv = [
        "--model",
        str(store),
        "--teacher",
        str(fixture_dir("qwen3_moe")),
        "--data",
        str(tmp_path / "train.txt"),
        "--out",
        str(out),
        "--prerouter",
        str(heads[0]),
        "--init",
        str(trained),
        "--r",
        "4",
        "--sft-steps",
        "0",
        "--distill-steps",
        "1",
        "--batch",
        "2",
        "--prompt-tokens",
        "12",
        "--gen-tokens",
        "16",
        "--val-windows",
        "2",
        "--val-window",
        "48",
        "--lr",
        "3e-4",
    ]
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    _, before = read_adapter(trained)
    _, meta = read_adapter(out)
    assert meta["r"] == 16 and meta["targets"] == before["targets"]  # the adapter's own shape wins over --r
    assert meta["provenance"]["init"]["path"] == str(trained)
    # it starts where the first run ended: same held-out KL before, up to summation order
    assert meta["provenance"]["validation"]["before"]["kl_to_teacher"] == pytest.approx(
        before["provenance"]["validation"]["after"]["kl_to_teacher"], rel=1e-4
    )
    with pytest.raises(Edge0Error, match="trained at K=2, this engine serves K=1"):
        main(argv[:-1] + ["3e-4", "--top-k", "1"])


def test_targets_are_strict_and_never_routers_or_experts(store):
    e = edge0.load(store, prerouter=False)
    cands = blora.candidate_linears(e.model)
    assert cands and not any(".mlp." in c for c in cands)  # qwen3_moe: every mlp is the router + experts
    assert blora.resolve_targets(e.model, ["q_proj"]) == [c for c in cands if c.endswith("q_proj")]
    assert blora.resolve_targets(e.model, ["layers.1.self_attn.o_proj"]) == ["model.layers.1.self_attn.o_proj"]
    with pytest.raises(Edge0Error, match="match no attention"):
        blora.resolve_targets(e.model, ["q_proj", "qproj"])
    with pytest.raises(Edge0Error, match="match no attention"):
        blora.resolve_targets(e.model, ["gate"])  # the router exists but is never adaptable


def test_adapter_for_another_base_k_or_prerouter_is_rejected(store, heads, trained, tmp_path):
    with pytest.raises(Edge0Error, match="trained at K=2, this engine serves K=1"):
        edge0.load(store, prerouter=heads[0], lora=trained, top_k=1)
    with pytest.raises(Edge0Error, match="trained with pre-router heads .* this engine uses gate routing"):
        edge0.load(store, prerouter=False, lora=trained)
    with pytest.raises(Edge0Error, match="this engine uses heads .*heads1"):
        edge0.load(store, prerouter=heads[1], lora=trained)
    tensors, meta = read_adapter(trained)
    other = save_adapter(tmp_path / "other.safetensors", tensors, {**meta, "manifest_sha256": "0" * 64})
    with pytest.raises(Edge0Error, match="trained for another base model.*edge0 train-lora"):
        edge0.load(store, prerouter=heads[0], lora=other)


def test_store_adapter_is_served_only_where_it_fits(store, heads, trained, tmp_path):
    s = tmp_path / "store"
    shutil.copytree(store, s)
    shutil.copy(heads[0], s / "prerouter.safetensors")
    shutil.copy(trained, s / "lora.safetensors")  # trained at the native K=2 with heads[0]
    e = edge0.load(s)
    assert e.lora_path == s / "lora.safetensors" and "LoRA lora.safetensors" in e.describe()
    for other in (edge0.load(s, top_k=1), edge0.load(s, prerouter=False)):  # starts, without the adapter, and says so
        assert other.lora_path is None and not blora.lora_modules(other.model)
        assert other.lora_note.startswith("no recovery LoRA: lora.safetensors: adapter was trained")
        assert other.lora_note in other.describe()
    shutil.move(s / "lora.safetensors", s / "lora-k2.safetensors")
    assert edge0.load(s).lora_path == s / "lora-k2.safetensors"
    with pytest.raises(Edge0Error, match="trained at K=2, this engine serves K=1"):  # named explicitly: an error
        edge0.load(s, top_k=1, lora=s / "lora-k2.safetensors")


def test_damaged_adapter_files_are_rejected(store, heads, trained, tmp_path):
    raw = bytearray(trained.read_bytes())
    flipped = tmp_path / "flipped.safetensors"
    raw[-3] ^= 0x40  # one bit of the last tensor's data
    flipped.write_bytes(bytes(raw))
    with pytest.raises(Edge0Error, match="tensor checksum"):
        edge0.load(store, prerouter=heads[0], lora=flipped)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(trained.read_bytes()[:-100])
    with pytest.raises(Edge0Error, match="not a readable LoRA adapter"):
        edge0.load(store, prerouter=heads[0], lora=cut)
    with pytest.raises(Edge0Error, match="not an edge0 LoRA adapter"):
        edge0.load(store, prerouter=heads[0], lora=heads[0])
    with pytest.raises(Edge0Error, match="no such file"):
        edge0.load(store, prerouter=heads[0], lora=tmp_path / "missing.safetensors")


class DenseDelta(nn.Module):
    """base(x) + x (s B A)^T with the low-rank product formed up front: the delta path computed
    another way."""

    def __init__(self, base, delta):
        super().__init__()
        self.base, self.delta = base, delta

    def __call__(self, x):
        return self.base(x) + x @ self.delta.T


def random_adapter(store, out):
    """An adapter of random r=4 matrices on every candidate linear of `store` (gate routing)."""
    model = edge0.load(store, prerouter=False, lora=False).model
    paths = blora.candidate_linears(model)
    rng = np.random.default_rng(1)
    tensors = {
        k: rng.normal(size=s).astype(np.float32) * 0.1 for k, s in blora.expected_shapes(model, paths, 4).items()
    }
    meta = {
        "manifest_sha256": manifest_hash(store),
        "prerouter_sha256": None,
        "top_k": 2,
        "r": 4,
        "alpha": 8.0,
        "targets": paths,
    }
    return save_adapter(out, tensors, meta), tensors, paths


def test_serving_changes_logits_by_exactly_the_delta_path(store, tmp_path):
    base = edge0.load(store, prerouter=False, lora=False)
    adapter, tensors, paths = random_adapter(store, tmp_path / "lora.safetensors")
    served = edge0.load(store, prerouter=False, lora=adapter)
    ids = served.encode(PROMPT)
    for p in paths:  # the reference: the same int4 base plus the delta as one dense matrix
        parent, name = p.rsplit(".", 1)
        delta = 2.0 * mx.array(tensors[f"{p}.lora_b"]) @ mx.array(tensors[f"{p}.lora_a"])
        bmod.get_module(base.model, parent)[name] = DenseDelta(bmod.get_module(base.model, p), delta)
    np.testing.assert_allclose(served.logits(ids), base.logits(ids), rtol=1e-4, atol=1e-4)
    plain = edge0.load(store, prerouter=False, lora=False).logits(ids)
    assert np.abs(served.logits(ids) - plain).max() > 1e-2  # the adapter does change the logits
    for m in blora.lora_modules(served.model).values():
        m.lora_b = mx.zeros_like(m.lora_b)
    assert np.array_equal(served.logits(ids), plain)  # a zero delta leaves the base untouched, bit for bit


def test_batched_student_generation_follows_the_serving_route(store, heads):
    from edge0.lora import distill as bd

    served = edge0.load(store, prerouter=heads[0], lora=False)
    ids = served.encode(PROMPT)
    want = served.generate(ids, max_tokens=8, ignore_eos=True).tokens
    ex = edge0.load(store, prerouter=heads[0], lora=False, prefill_executor="exact", decode_executor="exact")
    got = bd.student_generate(ex.model, ex.prerouting, np.array([ids, ids]), 8, 0.0, seed=0)
    assert got[:, len(ids) :].tolist() == [want, want]


def test_distillation_losses_match_their_definitions():
    from edge0.lora.distill import truncated_forward_kl, truncated_reverse_kl

    rng = np.random.default_rng(0)
    V, k = 6, 2
    zs, zt = rng.normal(size=(1, 4, V)), rng.normal(size=(1, 4, V))  # student / teacher logits, start = 1
    q = np.exp(zs[0, :-1]) / np.exp(zs[0, :-1]).sum(-1, keepdims=True)
    p = np.exp(zt[0, :-1]) / np.exp(zt[0, :-1]).sum(-1, keepdims=True)
    logits = mx.array(zs.astype(np.float32))
    # whole vocabulary: the exact KLs
    full = (None, np.log(p)[None].astype(np.float32), None)
    assert float(truncated_forward_kl(logits, 1, *full)) == pytest.approx((p * np.log(p / q)).sum(-1).mean(), rel=1e-5)
    assert float(truncated_reverse_kl(logits, 1, *full)) == pytest.approx((q * np.log(q / p)).sum(-1).mean(), rel=1e-5)
    # top-k plus one bucket: the KL between the coarsened distributions
    idx = np.argsort(-p, axis=-1)[:, :k]
    rest = np.ones((3, V), bool)
    np.put_along_axis(rest, idx, False, axis=-1)
    pc = np.concatenate([np.take_along_axis(p, idx, -1), (p * rest).sum(-1, keepdims=True)], -1)
    qc = np.concatenate([np.take_along_axis(q, idx, -1), (q * rest).sum(-1, keepdims=True)], -1)
    coarse = (
        idx[None].astype(np.int32),
        np.log(pc[:, :k])[None].astype(np.float32),
        np.log(pc[:, k])[None].astype(np.float32),
    )
    assert float(truncated_forward_kl(logits, 1, *coarse)) == pytest.approx(
        (pc * np.log(pc / qc)).sum(-1).mean(), rel=1e-5
    )
    assert float(truncated_reverse_kl(logits, 1, *coarse)) == pytest.approx(
        (qc * np.log(qc / pc)).sum(-1).mean(), rel=1e-5
    )
    # the gradient of the whole-vocabulary KL is finite and vanishes where student equals teacher
    g = mx.grad(lambda z: truncated_forward_kl(z, 1, *full))(mx.array(zt.astype(np.float32)))
    assert np.abs(np.array(g)).max() < 1e-6
