"""Stage-5 measurements of an exported demo checkpoint for provenance.json: loss, routing, samples, 4-bit."""

from __future__ import annotations

import json
import math
import os

import mlx.core as mx
import numpy as np
from demo_model.common import log
from demo_model.model import RecordingGate
from demo_model.training import evaluate

SAMPLE_PROMPTS = [
    "The Python interpreter",
    "A list is a",
    "This module provides functions for",
    "To open a file,",
    "An exception is raised when",
]


def unigram_nll(train: np.ndarray, valid: np.ndarray, vocab: int, seq: int) -> float:
    """Add-one smoothed token unigram fit on train, scored on the tokens `evaluate` predicts."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    n = (len(valid) - 1) // seq
    return float(-logp[valid[1 : n * seq + 1].astype(np.int64)].mean())


def routing_stats(model, data: np.ndarray, cfg: dict, seq: int, max_tokens: int) -> list[dict]:
    """Per layer: expert-load entropy and top-k reuse between consecutive tokens (validation text)."""
    E, K = cfg["num_experts"], cfg["num_experts_per_tok"]
    L = cfg["num_hidden_layers"]
    loads = np.zeros((L, E))
    reuse_num = np.zeros(L)
    reuse_den = 0
    n = min((len(data) - 1) // seq, max_tokens // seq)
    for i in range(n):
        x = mx.array(data[i * seq : (i + 1) * seq].astype(np.int32))[None]
        RecordingGate.record = []
        mx.eval(model(x))
        rec = RecordingGate.record
        RecordingGate.record = None
        for li, g in enumerate(rec):
            inds = np.array(mx.argpartition(-g[0], kth=K - 1, axis=-1)[:, :K])  # [T, K]
            np.add.at(loads[li], inds.reshape(-1), 1)
            m = np.zeros((inds.shape[0], E), dtype=bool)
            np.put_along_axis(m, inds, True, axis=-1)
            reuse_num[li] += (m[1:] & m[:-1]).sum()
        reuse_den += (seq - 1) * K
    out = []
    for li in range(L):
        p = loads[li] / loads[li].sum()
        ent = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
        out.append(
            {
                "layer": li,
                "load_entropy_bits": round(ent, 3),
                "uniform_entropy_bits": round(math.log2(E), 3),
                "max_expert_load_share": round(float(p.max()), 4),
                "min_expert_load_share": round(float(p.min()), 4),
                "topk_reuse_prev_token": round(float(reuse_num[li] / reuse_den), 4),
                "topk_reuse_random_baseline": round(K / E, 4),
                # expected reuse if consecutive tokens were routed independently with these loads
                "topk_reuse_independent_baseline": round(float(K * (p**2).sum()), 4),
                "expert_load_share": [round(float(v), 4) for v in p],
            }
        )
    return out


def greedy_samples(ckpt_dir: str, prompts: list[str], max_tokens: int = 40) -> list[dict]:
    from mlx_lm import load
    from mlx_lm.generate import generate
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(ckpt_dir)
    res = []
    for p in prompts:
        text = generate(
            model,
            tok,
            prompt=tok.encode(p, add_special_tokens=False),
            max_tokens=max_tokens,
            sampler=make_sampler(temp=0.0),
            verbose=False,
        )
        res.append({"prompt": p, "greedy_continuation": text})
    return res


def check_quantized(out_dir: str, prompts: list[str], float_samples: list[dict], max_tokens: int = 40) -> dict:
    """mlx_lm.convert -q (4-bit, group 64) on the checkpoint, then greedy-generate from the result."""
    import shutil
    import tempfile

    from mlx_lm import convert, load
    from mlx_lm.generate import generate
    from mlx_lm.sample_utils import make_sampler

    tmp = tempfile.mkdtemp(prefix="edge0-demo-q4-")
    qdir = os.path.join(tmp, "q4")
    try:
        convert(out_dir, qdir, quantize=True, q_group_size=64, q_bits=4)
        size = sum(os.path.getsize(os.path.join(qdir, f)) for f in os.listdir(qdir))
        model, tok = load(qdir)
        res = []
        same = 0
        for p, ref in zip(prompts, float_samples):
            text = generate(
                model,
                tok,
                prompt=tok.encode(p, add_special_tokens=False),
                max_tokens=max_tokens,
                sampler=make_sampler(temp=0.0),
                verbose=False,
            )
            res.append({"prompt": p, "greedy_continuation": text})
            same += text == ref["greedy_continuation"]
        return {
            "command": "mlx_lm.convert(ckpt, out, quantize=True, q_group_size=64, q_bits=4)",
            "converted_bytes": size,
            "greedy_samples": res,
            "samples_identical_to_float": f"{same}/{len(prompts)}",
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def analyze(out_dir: str, work: str, a) -> dict:
    from mlx_lm import load

    with open(os.path.join(out_dir, "config.json")) as fh:
        cfg = json.load(fh)
    train = np.fromfile(os.path.join(work, "train.u16"), dtype=np.uint16)
    valid = np.fromfile(os.path.join(work, "valid.u16"), dtype=np.uint16)
    model, _ = load(out_dir)
    for layer in model.model.layers:  # recording routers for the routing statistics
        g = RecordingGate(cfg["hidden_size"], cfg["num_experts"], bias=False)
        g.weight = layer.mlp.gate.weight
        layer.mlp.gate = g
    log("analysis: validation loss")
    val_nll = evaluate(model, valid, a.seq, 8)
    train_nll = evaluate(model, train, a.seq, 8, max_tokens=len(valid))
    uni = unigram_nll(train, valid, cfg["vocab_size"], a.seq)
    log(f"train nll {train_nll:.4f} (windows spread over the training split)")
    log(f"val nll {val_nll:.4f} ppl {math.exp(val_nll):.2f} | unigram nll {uni:.4f} ppl {math.exp(uni):.2f}")
    log("analysis: routing")
    routing = routing_stats(model, valid, cfg, a.seq, a.routing_tokens)
    for r in routing:
        log(
            f"layer {r['layer']}: entropy {r['load_entropy_bits']}/{r['uniform_entropy_bits']} bits, "
            f"reuse {r['topk_reuse_prev_token']} (random {r['topk_reuse_random_baseline']})"
        )
    del model
    samples = greedy_samples(out_dir, SAMPLE_PROMPTS)
    for s in samples:
        log(f"{s['prompt']!r} -> {s['greedy_continuation']!r}")
    log("analysis: mlx_lm.convert -q (4-bit, group 64)")
    q4 = check_quantized(out_dir, SAMPLE_PROMPTS, samples)
    for s in q4["greedy_samples"]:
        log(f"q4 {s['prompt']!r} -> {s['greedy_continuation']!r}")
    return {
        "validation": {
            "tokens": int(len(valid)),
            "nll_nats": round(val_nll, 4),
            "train_nll_nats_same_size_sample": round(train_nll, 4),
            "perplexity": round(math.exp(val_nll), 2),
            "unigram_nll_nats": round(uni, 4),
            "unigram_perplexity": round(math.exp(uni), 2),
            "unigram": "token unigram fit on the training split, add-one smoothing, scored on the same validation "
            "tokens",
            "window": a.seq,
        },
        "routing": {
            "measured_on": f"first {min(len(valid), a.routing_tokens)} validation tokens, windows of {a.seq}",
            "per_layer": routing,
            "definitions": {
                "load_entropy_bits": "entropy of the distribution of top-k assignments over experts (log2 E = uniform)",
                "topk_reuse_prev_token": "fraction of a token's top-k experts that were also in the previous token's "
                "top-k, same layer",
                "topk_reuse_random_baseline": "K/E: expected reuse for independent uniform routing",
                "topk_reuse_independent_baseline": "K*sum(share^2): expected reuse for independent routing with the "
                "measured expert loads",
            },
        },
        "greedy_samples": samples,
        "quantized_4bit_check": q4,
    }
