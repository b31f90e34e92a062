#!/usr/bin/env python3
"""Train Edge0's bundled demo model: a small qwen3_moe language model, from scratch, with MLX.

The model class is mlx-lm's own ``mlx_lm.models.qwen3_moe.Model`` so the math is exactly the
reference implementation; the result is written in Hugging Face layout (per-expert tensors,
config.json, tokenizer with a ChatML chat template, provenance.json).

Stages (each is skipped when its output already exists in --work, so a re-run resumes):
  1. byte-level BPE tokenizer trained on data/train.txt      -> OUT/tokenizer*.json
  2. train/valid text tokenized                               -> WORK/{train,valid}.u16
  3. training (AdamW, warmup + cosine, load-balancing loss)   -> WORK/state.safetensors (periodic)
  4. export in HF layout                                      -> OUT/model.safetensors, config.json
  5. measurements (val ppl vs unigram, routing structure, samples) -> OUT/provenance.json

Usage (see docs/demo-model.md):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
    nice -n 19 python scripts/train_demo_model.py --out checkpoints/edge0-demo-moe --minutes 40

  --timing N      only time N training steps and exit (compare with/without the preload)
  --analyze-only  re-run stage 5 on an existing checkpoint
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from functools import partial

import numpy as np

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from mlx_lm.models import qwen3_moe

DOC_SEP = "<|endoftext|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SAMPLE_PROMPTS = [
    "The Python interpreter",
    "A list is a",
    "This module provides functions for",
    "To open a file,",
    "An exception is raised when",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def atomic_write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def atomic_save_safetensors(path: str, arrays: dict, metadata: dict | None = None) -> None:
    tmp = path[: -len(".safetensors")] + ".tmp.safetensors"
    mx.save_safetensors(tmp, arrays, metadata=metadata or {})
    os.replace(tmp, path)


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(train_txt: str, out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with open(train_txt, encoding="utf-8") as fh:
        docs = fh.read().split("\n" + DOC_SEP + "\n")
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    finalize_tokenizer_files(out_dir)


def finalize_tokenizer_files(out_dir: str) -> None:
    """Make tokenizer_config.json self-contained and loadable by older transformers too:
    the ChatML template lives in it (not in a separate chat_template.jinja), the class is the
    generic PreTrainedTokenizerFast, special tokens are listed the classic way. Idempotent."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    jinja = os.path.join(out_dir, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = extra or ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    cfg.pop("backend", None)
    atomic_write_json(path, cfg)


def load_hf_tokenizer(out_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out_dir)


def tokenize_file(tok, path: str, dst: str) -> np.ndarray:
    if os.path.exists(dst):
        return np.fromfile(dst, dtype=np.uint16)
    sep_id = tok.convert_tokens_to_ids(DOC_SEP)
    with open(path, encoding="utf-8") as fh:
        docs = fh.read().split("\n" + DOC_SEP + "\n")
    ids: list[int] = []
    for doc in docs:
        ids.extend(tok.encode(doc, add_special_tokens=False))
        ids.append(sep_id)
    arr = np.asarray(ids, dtype=np.uint16)
    arr.tofile(dst + ".tmp")
    os.replace(dst + ".tmp", dst)
    return arr


# --------------------------------------------------------------------------- model


class RecordingGate(nn.Linear):
    """nn.Linear router that remembers its logits so the training loss can use them.
    Parameter names are unchanged (``mlp.gate.weight``)."""

    record: list | None = None

    def __call__(self, x):
        y = super().__call__(x)
        if RecordingGate.record is not None:
            RecordingGate.record.append(y)
        return y


def model_config(a) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "intermediate_size": a.moe_inter * a.top_k,  # unused: every layer is MoE
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "num_experts": a.experts,
        "num_experts_per_tok": a.top_k,
        "moe_intermediate_size": a.moe_inter,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "vocab_size": a.vocab,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "output_router_logits": False,
        "router_aux_loss_coef": a.aux_coef,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": a.layers,
        "bos_token_id": None,
        "eos_token_id": None,  # filled from the tokenizer
        "pad_token_id": None,
        "torch_dtype": "float32",
        "transformers_version": None,
    }


def set_special_ids(cfg: dict, tok) -> None:
    # generation stops at <|im_end|> (chat turns) and at <|endoftext|> (end of a document)
    cfg["eos_token_id"] = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids(DOC_SEP)]
    cfg["pad_token_id"] = tok.convert_tokens_to_ids(DOC_SEP)


def write_metadata(out_dir: str, cfg: dict) -> None:
    atomic_write_json(os.path.join(out_dir, "config.json"), cfg)
    gen_cfg = {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"], "do_sample": False}
    atomic_write_json(os.path.join(out_dir, "generation_config.json"), gen_cfg)


def build_model(cfg: dict, seed: int):
    mx.random.seed(seed)
    args = qwen3_moe.ModelArgs.from_dict(cfg)
    model = qwen3_moe.Model(args)
    # swap routers for recording ones, same init
    for layer in model.model.layers:
        old = layer.mlp.gate
        g = RecordingGate(cfg["hidden_size"], cfg["num_experts"], bias=False)
        g.weight = old.weight
        layer.mlp.gate = g
    # GPT-style small init for embeddings (tied head) and experts
    std = 0.02
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * std
    mx.eval(model.parameters())
    return model


def count_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def aux_balance_loss(gate_logits: list, n_experts: int, k: int) -> mx.array:
    """Switch-Transformer / Qwen-MoE load-balancing loss: E * sum_e f_e * P_e, averaged over layers."""
    total = 0.0
    for g in gate_logits:
        g = g.reshape(-1, n_experts)
        probs = mx.softmax(g.astype(mx.float32), axis=-1)
        inds = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]
        mask = mx.zeros_like(probs)
        mask = mx.put_along_axis(mask, inds, mx.array(1.0), axis=-1)
        f = mx.stop_gradient(mask.mean(axis=0) / k)
        p = probs.mean(axis=0)
        total = total + n_experts * mx.sum(f * p)
    return total / len(gate_logits)


def hf_weights(model, cfg: dict) -> dict:
    """mlx-lm parameters -> HF key names (inverse of qwen3_moe sanitize)."""
    out = {}
    for k, v in tree_flatten(model.parameters()):
        if ".mlp.switch_mlp." in k:
            prefix, rest = k.split(".mlp.switch_mlp.")
            proj = rest.split(".")[0]
            for e in range(cfg["num_experts"]):
                out[f"{prefix}.mlp.experts.{e}.{proj}.weight"] = v[e]
        else:
            out[k] = v
    if cfg["tie_word_embeddings"]:
        out.pop("lm_head.weight", None)
    return out


# --------------------------------------------------------------------------- training


def lr_at(step: int, total: int, warmup: int, peak: float, final_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def get_batch(rng: np.random.RandomState, data: np.ndarray, batch: int, seq: int):
    starts = rng.randint(0, len(data) - seq - 1, size=batch)
    x = np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int32)
    return mx.array(x[:, :-1]), mx.array(x[:, 1:])


def make_step(model, opt, cfg, aux_coef):
    E, K = cfg["num_experts"], cfg["num_experts_per_tok"]

    def loss_fn(m, x, y):
        RecordingGate.record = []
        logits = m(x)
        ce = nn.losses.cross_entropy(logits, y, reduction="mean")
        aux = aux_balance_loss(RecordingGate.record, E, K)
        RecordingGate.record = None
        return ce + aux_coef * aux, (ce, aux)

    vg = nn.value_and_grad(model, loss_fn)

    def step(x, y):
        (loss, (ce, aux)), grads = vg(model, x, y)
        grads, gnorm = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return ce, aux, gnorm

    # compiling the whole step fuses MLX's elementwise kernels: ~2x faster on CPU
    state = [model.state, opt.state]
    return partial(mx.compile, inputs=state, outputs=state)(step)


def evaluate(model, data: np.ndarray, seq: int, batch: int, max_tokens: int | None = None) -> float:
    """Mean next-token NLL (nats) over non-overlapping windows of the data. With max_tokens,
    that many tokens' worth of windows, spread evenly over the whole data."""
    n_all = (len(data) - 1) // seq
    n = min(n_all, max_tokens // seq) if max_tokens else n_all
    starts = [(j * n_all // n) * seq for j in range(n)]
    total, count = 0.0, 0
    for i in range(0, n, batch):
        x = np.stack([data[s : s + seq + 1] for s in starts[i : i + batch]]).astype(np.int32)
        logits = model(mx.array(x[:, :-1]))
        nll = nn.losses.cross_entropy(logits, mx.array(x[:, 1:]), reduction="sum")
        total += nll.item()
        count += x[:, 1:].size
    return total / count


def save_state(path, model, opt, step, rng, meta):
    arrays = {"model." + k: v for k, v in tree_flatten(model.parameters())}
    arrays.update({"opt." + k: v for k, v in tree_flatten(opt.state) if isinstance(v, mx.array)})
    st = rng.get_state()
    meta = dict(meta, step=step, rng=[st[0], st[1].tolist(), st[2], st[3], st[4]])
    atomic_save_safetensors(path, arrays, {"meta": json.dumps(meta)})


def load_state(path, model, opt, rng):
    arrays, md = mx.load(path, return_metadata=True)
    meta = json.loads(md["meta"])
    model.update(tree_unflatten([(k[6:], v) for k, v in arrays.items() if k.startswith("model.")]))
    opt_state = tree_unflatten([(k[4:], v) for k, v in arrays.items() if k.startswith("opt.")])
    opt.state = opt_state
    r = meta["rng"]
    rng.set_state((r[0], np.asarray(r[1], dtype=np.uint32), r[2], r[3], r[4]))
    return meta


# --------------------------------------------------------------------------- analysis


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
        out.append({
            "layer": li,
            "load_entropy_bits": round(ent, 3),
            "uniform_entropy_bits": round(math.log2(E), 3),
            "max_expert_load_share": round(float(p.max()), 4),
            "min_expert_load_share": round(float(p.min()), 4),
            "topk_reuse_prev_token": round(float(reuse_num[li] / reuse_den), 4),
            "topk_reuse_random_baseline": round(K / E, 4),
            # expected reuse if consecutive tokens were routed independently with these loads
            "topk_reuse_independent_baseline": round(float(K * (p ** 2).sum()), 4),
            "expert_load_share": [round(float(v), 4) for v in p],
        })
    return out


def greedy_samples(ckpt_dir: str, prompts: list[str], max_tokens: int = 40) -> list[dict]:
    from mlx_lm import load
    from mlx_lm.generate import generate
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(ckpt_dir)
    res = []
    for p in prompts:
        text = generate(model, tok, prompt=tok.encode(p, add_special_tokens=False),
                        max_tokens=max_tokens, sampler=make_sampler(temp=0.0), verbose=False)
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
            text = generate(model, tok, prompt=tok.encode(p, add_special_tokens=False),
                            max_tokens=max_tokens, sampler=make_sampler(temp=0.0), verbose=False)
            res.append({"prompt": p, "greedy_continuation": text})
            same += text == ref["greedy_continuation"]
        return {"command": "mlx_lm.convert(ckpt, out, quantize=True, q_group_size=64, q_bits=4)",
                "converted_bytes": size, "greedy_samples": res,
                "samples_identical_to_float": f"{same}/{len(prompts)}"}
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
        log(f"layer {r['layer']}: entropy {r['load_entropy_bits']}/{r['uniform_entropy_bits']} bits, "
            f"reuse {r['topk_reuse_prev_token']} (random {r['topk_reuse_random_baseline']})")
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
            "unigram": "token unigram fit on the training split, add-one smoothing, scored on the same validation tokens",
            "window": a.seq,
        },
        "routing": {
            "measured_on": f"first {min(len(valid), a.routing_tokens)} validation tokens, windows of {a.seq}",
            "per_layer": routing,
            "definitions": {
                "load_entropy_bits": "entropy of the distribution of top-k assignments over experts (log2 E = uniform)",
                "topk_reuse_prev_token": "fraction of a token's top-k experts that were also in the previous token's top-k, same layer",
                "topk_reuse_random_baseline": "K/E: expected reuse for independent uniform routing",
                "topk_reuse_independent_baseline": "K*sum(share^2): expected reuse for independent routing with the measured expert loads",
            },
        },
        "greedy_samples": samples,
        "quantized_4bit_check": q4,
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="checkpoints/edge0-demo-moe")
    ap.add_argument("--work", default=".work/edge0-demo-train", help="tokens, training state (not committed)")
    ap.add_argument("--data", default="data")
    ap.add_argument("--minutes", type=float, default=40.0, help="wall-time budget of the training loop")
    ap.add_argument("--steps", type=int, default=0, help="total steps (0: fit to --minutes after a timing phase)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-inter", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--final-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--routing-tokens", type=int, default=1 << 30, help="validation tokens for routing stats (default: all)")
    ap.add_argument("--timing", type=int, default=0, help="time this many steps and exit")
    ap.add_argument("--analyze-only", action="store_true")
    a = ap.parse_args()

    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    train_txt, valid_txt = os.path.join(a.data, "train.txt"), os.path.join(a.data, "valid.txt")
    prov_path = os.path.join(a.out, "provenance.json")

    if a.analyze_only:
        # refresh metadata files written by this version of the script, then re-measure
        finalize_tokenizer_files(a.out)
        with open(os.path.join(a.out, "config.json")) as fh:
            cfg = json.load(fh)
        set_special_ids(cfg, load_hf_tokenizer(a.out))
        write_metadata(a.out, cfg)
        with open(prov_path) as fh:
            prov = json.load(fh)
        prov["tokenizer"]["chat_template"] = "ChatML (in tokenizer_config.json)"
        prov.update(analyze(a.out, a.work, a))
        prov["training"]["final_train_nll_eval"] = prov["validation"]["train_nll_nats_same_size_sample"]
        prov["training"]["final_valid_nll"] = prov["validation"]["nll_nats"]
        atomic_write_json(prov_path, prov)
        return

    # 1. tokenizer
    if not os.path.exists(os.path.join(a.out, "tokenizer.json")):
        log(f"training BPE tokenizer (vocab {a.vocab}) on {train_txt}")
        train_tokenizer(train_txt, a.out, a.vocab)
    tok = load_hf_tokenizer(a.out)
    assert len(tok) == a.vocab, (len(tok), a.vocab)

    # 2. tokens
    t0 = time.time()
    train = tokenize_file(tok, train_txt, os.path.join(a.work, "train.u16"))
    valid = tokenize_file(tok, valid_txt, os.path.join(a.work, "valid.u16"))
    log(f"tokens: train {len(train):,} valid {len(valid):,} ({time.time() - t0:.1f}s)")

    # 3. model + training
    cfg = model_config(a)
    set_special_ids(cfg, tok)
    model = build_model(cfg, a.seed)
    n_params = count_params(model)
    E, K, Lyr = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]
    expert_params = Lyr * E * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
    active = n_params - expert_params + expert_params * K // E
    log(f"model: {n_params:,} params ({active:,} active per token), {n_params * 4 / 2**20:.1f} MiB float32")

    opt = optim.AdamW(learning_rate=a.lr, betas=[0.9, 0.95], eps=1e-8, weight_decay=a.wd)
    opt.init(model.trainable_parameters())
    rng = np.random.RandomState(a.seed)
    state_path = os.path.join(a.work, "state.safetensors")
    meta = {"total_steps": a.steps, "train_seconds": 0.0, "history": []}
    start_step = 0
    if os.path.exists(state_path) and not a.timing:
        meta = load_state(state_path, model, opt, rng)
        start_step = meta["step"]
        log(f"resumed from {state_path} at step {start_step}")
    step_fn = make_step(model, opt, cfg, a.aux_coef)  # after a resume: it captures opt.state

    if a.timing:
        for s in range(a.timing + 2):
            if s == 2:
                t0 = time.time()
            x, y = get_batch(rng, train, a.batch, a.seq)
            ce, aux, gn = step_fn(x, y)
            mx.eval(ce, aux, model.parameters(), opt.state)
        dt = (time.time() - t0) / a.timing
        log(f"timing: {dt * 1000:.0f} ms/step, {a.batch * a.seq / dt:.0f} tokens/s, loss {ce.item():.3f}")
        return

    budget = a.minutes * 60.0
    train_seconds = meta["train_seconds"]
    total = meta["total_steps"] or 0
    history = meta["history"]
    last_ckpt = time.time()
    step = start_step
    ce_acc, aux_acc, n_acc = 0.0, 0.0, 0
    seg_start = time.time()
    seg_train0 = train_seconds
    while True:
        if total and step >= total:
            break
        elapsed = seg_train0 + (time.time() - seg_start)
        if elapsed > budget:
            log(f"time budget reached at step {step}")
            break
        if not total and step == 40:
            rate = step / max(elapsed, 1e-6)
            total = int(rate * budget * 0.97)
            log(f"fitting schedule to the budget: {rate:.2f} steps/s -> total_steps {total}")
        lr = lr_at(step, total or 10**9, a.warmup, a.lr, a.final_lr_frac)
        opt.learning_rate = lr
        x, y = get_batch(rng, train, a.batch, a.seq)
        ce, aux, gn = step_fn(x, y)
        mx.eval(ce, aux, gn, model.parameters(), opt.state)
        step += 1
        ce_acc += ce.item()
        aux_acc += aux.item()
        n_acc += 1
        if step % a.log_every == 0:
            elapsed = seg_train0 + (time.time() - seg_start)
            rec = {"step": step, "train_ce": round(ce_acc / n_acc, 4), "aux": round(aux_acc / n_acc, 4),
                   "lr": round(lr, 6), "grad_norm": round(gn.item(), 3), "minutes": round(elapsed / 60, 2)}
            history.append(rec)
            tps = step * a.batch * a.seq / max(elapsed, 1e-6) if start_step == 0 else float("nan")
            log(f"step {step}/{total} ce {rec['train_ce']:.4f} aux {rec['aux']:.4f} lr {lr:.2e} "
                f"gnorm {rec['grad_norm']:.2f} {elapsed / 60:.1f} min {tps:.0f} tok/s")
            ce_acc, aux_acc, n_acc = 0.0, 0.0, 0
        if time.time() - last_ckpt > a.ckpt_minutes * 60:
            train_seconds = seg_train0 + (time.time() - seg_start)
            save_state(state_path, model, opt, step, rng,
                       {"total_steps": total, "train_seconds": train_seconds, "history": history})
            log(f"saved training state at step {step}")
            last_ckpt = time.time()
    train_seconds = seg_train0 + (time.time() - seg_start)
    save_state(state_path, model, opt, step, rng,
               {"total_steps": total, "train_seconds": train_seconds, "history": history})

    # final losses on fixed windows (train loss: same number of tokens as validation, from train)
    log("evaluating final train/validation loss")
    val_nll = evaluate(model, valid, a.seq, 8)
    tr_nll = evaluate(model, train, a.seq, 8, max_tokens=len(valid))
    log(f"final: train nll {tr_nll:.4f} val nll {val_nll:.4f} (ppl {math.exp(val_nll):.2f})")

    # 4. export
    weights = hf_weights(model, cfg)
    atomic_save_safetensors(os.path.join(a.out, "model.safetensors"), weights, {"format": "pt"})
    write_metadata(a.out, cfg)

    with open(os.path.join(a.data, "manifest.json")) as fh:
        manifest = json.load(fh)
    git_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    prov = {
        "name": os.path.basename(os.path.normpath(a.out)),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "script": "scripts/train_demo_model.py",
        "git_revision_at_training": git_rev,
        "command": " ".join(sys.argv),
        "args": vars(a),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "mlx": mx.__version__, "python": platform.python_version(),
                    "blas_preload": os.environ.get("LD_PRELOAD", "")},
        "data": {
            "source": manifest["source"],
            "split": manifest["split"],
            "files": manifest["files"],
            "train_tokens": int(len(train)),
            "valid_tokens": int(len(valid)),
            "tokens_seen_in_training": int(step * a.batch * a.seq),
            "epochs": round(step * a.batch * a.seq / len(train), 3),
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": len(tok),
                      "special_tokens": SPECIAL_TOKENS, "eos": "<|im_end|>",
                      "document_separator": DOC_SEP, "chat_template": "ChatML (in tokenizer_config.json)"},
        "model": {"class": "mlx_lm.models.qwen3_moe.Model", "parameters": int(n_params),
                  "active_parameters_per_token": int(active), "dtype": "float32",
                  "config": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_experts",
                                                 "num_experts_per_tok", "moe_intermediate_size",
                                                 "num_attention_heads", "num_key_value_heads",
                                                 "head_dim", "vocab_size", "tie_word_embeddings")}},
        "training": {"seed": a.seed, "steps": step, "planned_steps": total, "batch": a.batch,
                     "seq_len": a.seq, "optimizer": f"AdamW(betas=(0.9,0.95), wd={a.wd}), grad clip 1.0",
                     "lr": f"peak {a.lr}, linear warmup {a.warmup} steps, cosine to {a.final_lr_frac}x",
                     "aux_loss": f"load balancing E*sum(f*P), coef {a.aux_coef}",
                     "wall_time_minutes": round(train_seconds / 60, 2),
                     "final_train_loss_logged": history[-1]["train_ce"] if history else None,
                     "final_train_nll_eval": round(tr_nll, 4),
                     "final_valid_nll": round(val_nll, 4),
                     "history": history},
    }
    atomic_write_json(prov_path, prov)
    del model
    # 5. measurements
    prov.update(analyze(a.out, a.work, a))
    atomic_write_json(prov_path, prov)
    log(f"done: {a.out}")


if __name__ == "__main__":
    main()
