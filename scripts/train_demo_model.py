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
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

# the stages live in scripts/demo_model/ (modules, not an installed package); make
# ``demo_model`` and ``demo_data`` importable however this file is started
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_data import DOC_SEP  # noqa: E402
from demo_model.analysis import analyze  # noqa: E402
from demo_model.common import atomic_save_safetensors, atomic_write_json, log  # noqa: E402
from demo_model.data import (  # noqa: E402
    SPECIAL_TOKENS,
    finalize_tokenizer_files,
    load_hf_tokenizer,
    tokenize_file,
    train_tokenizer,
)
from demo_model.model import (  # noqa: E402
    build_model,
    count_params,
    hf_weights,
    model_config,
    set_special_ids,
    write_metadata,
)
from demo_model.training import evaluate, get_batch, load_state, lr_at, make_step, save_state  # noqa: E402


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
    ap.add_argument(
        "--routing-tokens", type=int, default=1 << 30, help="validation tokens for routing stats (default: all)"
    )
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
            rec = {
                "step": step,
                "train_ce": round(ce_acc / n_acc, 4),
                "aux": round(aux_acc / n_acc, 4),
                "lr": round(lr, 6),
                "grad_norm": round(gn.item(), 3),
                "minutes": round(elapsed / 60, 2),
            }
            history.append(rec)
            tps = step * a.batch * a.seq / max(elapsed, 1e-6) if start_step == 0 else float("nan")
            log(
                f"step {step}/{total} ce {rec['train_ce']:.4f} aux {rec['aux']:.4f} lr {lr:.2e} "
                f"gnorm {rec['grad_norm']:.2f} {elapsed / 60:.1f} min {tps:.0f} tok/s"
            )
            ce_acc, aux_acc, n_acc = 0.0, 0.0, 0
        if time.time() - last_ckpt > a.ckpt_minutes * 60:
            train_seconds = seg_train0 + (time.time() - seg_start)
            save_state(
                state_path,
                model,
                opt,
                step,
                rng,
                {"total_steps": total, "train_seconds": train_seconds, "history": history},
            )
            log(f"saved training state at step {step}")
            last_ckpt = time.time()
    train_seconds = seg_train0 + (time.time() - seg_start)
    save_state(
        state_path, model, opt, step, rng, {"total_steps": total, "train_seconds": train_seconds, "history": history}
    )

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
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mlx": mx.__version__,
            "python": platform.python_version(),
            "blas_preload": os.environ.get("LD_PRELOAD", ""),
        },
        "data": {
            "source": manifest["source"],
            "split": manifest["split"],
            "files": manifest["files"],
            "train_tokens": int(len(train)),
            "valid_tokens": int(len(valid)),
            "tokens_seen_in_training": int(step * a.batch * a.seq),
            "epochs": round(step * a.batch * a.seq / len(train), 3),
        },
        "tokenizer": {
            "type": "byte-level BPE (tokenizers)",
            "vocab_size": len(tok),
            "special_tokens": SPECIAL_TOKENS,
            "eos": "<|im_end|>",
            "document_separator": DOC_SEP,
            "chat_template": "ChatML (in tokenizer_config.json)",
        },
        "model": {
            "class": "mlx_lm.models.qwen3_moe.Model",
            "parameters": int(n_params),
            "active_parameters_per_token": int(active),
            "dtype": "float32",
            "config": {
                k: cfg[k]
                for k in (
                    "hidden_size",
                    "num_hidden_layers",
                    "num_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "vocab_size",
                    "tie_word_embeddings",
                )
            },
        },
        "training": {
            "seed": a.seed,
            "steps": step,
            "planned_steps": total,
            "batch": a.batch,
            "seq_len": a.seq,
            "optimizer": f"AdamW(betas=(0.9,0.95), wd={a.wd}), grad clip 1.0",
            "lr": f"peak {a.lr}, linear warmup {a.warmup} steps, cosine to {a.final_lr_frac}x",
            "aux_loss": f"load balancing E*sum(f*P), coef {a.aux_coef}",
            "wall_time_minutes": round(train_seconds / 60, 2),
            "final_train_loss_logged": history[-1]["train_ce"] if history else None,
            "final_train_nll_eval": round(tr_nll, 4),
            "final_valid_nll": round(val_nll, 4),
            "history": history,
        },
    }
    atomic_write_json(prov_path, prov)
    del model
    # 5. measurements
    prov.update(analyze(a.out, a.work, a))
    atomic_write_json(prov_path, prov)
    log(f"done: {a.out}")


if __name__ == "__main__":
    main()
