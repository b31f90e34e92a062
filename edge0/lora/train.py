"""Recovery-LoRA training: phase 1 SFT on teacher-generated text, phase 2 on-policy distillation,
both run along the student's serving route (int4 store, pre-router at K); validation before and
after on held-out text; the adapter's tensors and metadata."""

from __future__ import annotations

import datetime
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from edge0.backend import core as B
from edge0.backend import lora as blora
from edge0.backend import train as bt
from edge0.engine.evaluate import evaluate
from edge0.errors import Edge0Error
from edge0.lora import distill as bd
from edge0.lora.attach import attach_lora, prerouter_hash
from edge0.store.format import manifest_hash, sha256_file

PHASE1 = {"soft": "forward KL(teacher || student) on {text}", "hard": "cross-entropy of the tokens of {text}"}
SFT_TEXT = {"teacher": "teacher-generated continuations", "data": "windows of the training data"}
PHASE2 = "reverse KL(student || teacher) on student-generated continuations"
COARSENING = "each KL over the teacher's top-{k} tokens plus one bucket holding every other token"
FULL_VOCAB = "each KL over the whole vocabulary"


@dataclass
class TrainOptions:
    r: int = 16
    alpha: float = 32.0
    targets: list | None = None  # None: every candidate linear
    sft_steps: int = 200
    distill_steps: int = 50
    batch: int = 4
    prompt_tokens: int = 32
    gen_tokens: int = 96
    lr: float = 1e-3
    teacher_temperature: float = 1.0
    student_temperature: float = 1.0
    distill_top_k: int = 0  # 0: the whole vocabulary; k > 0: the teacher's top-k plus one bucket
    sft_targets: str = "soft"  # "soft": the teacher's token distributions; "hard": its sampled tokens
    sft_text: str = "teacher"  # "teacher": continuations it samples; "data": windows of --data it scores
    max_tokens: int = 500_000
    holdout: float = 0.05
    val_window: int = 128
    val_windows: int = 8
    seed: int = 0
    dequantize_resident: bool | None = None  # None: on the CPU only (see backend.lora.dequantize_resident)
    init: str | None = None  # an adapter to continue training (its targets, r and alpha are kept)


def _check(opts: TrainOptions, vocab: int) -> None:
    bad = [
        (f, getattr(opts, f))
        for f in ("r", "batch", "prompt_tokens", "gen_tokens", "val_window", "val_windows")
        if getattr(opts, f) < 1
    ]
    bad += [(f, getattr(opts, f)) for f in ("sft_steps", "distill_steps") if getattr(opts, f) < 0]
    if bad:
        raise Edge0Error(f"--{bad[0][0].replace('_', '-')} {bad[0][1]}: must be positive; pass a larger value")
    if opts.sft_targets not in ("soft", "hard"):
        raise Edge0Error(f"--sft-targets {opts.sft_targets}: choose soft or hard")
    if opts.sft_text not in SFT_TEXT:
        raise Edge0Error(f"--sft-text {opts.sft_text}: choose teacher or data")
    if opts.sft_steps + opts.distill_steps == 0:
        raise Edge0Error("--sft-steps/--distill-steps: both are 0; give at least one training step")
    if not 0 <= opts.distill_top_k < vocab:
        raise Edge0Error(
            f"--distill-top-k {opts.distill_top_k}: must be between 1 and {vocab - 1} (vocabulary minus one), "
            "or 0 for the whole vocabulary"
        )


def check_teacher(engine, teacher, sample: str) -> None:
    """The teacher must share the student's tokenizer and vocabulary."""
    ids = engine.encode(sample)
    if teacher.tokenizer.encode(sample) != ids:
        raise Edge0Error(
            "--teacher: its tokenizer splits text differently from the model's; "
            "pass the full-precision checkpoint the store was converted from"
        )
    ours, theirs = engine.logits(ids[:4]).shape[-1], teacher.logits(ids[:4]).shape[-1]
    if ours != theirs:
        raise Edge0Error(
            f"--teacher: vocabulary of {theirs} tokens, the model has {ours}; "
            "pass the full-precision checkpoint the store was converted from"
        )


def _validate(engine, teacher, tokens, opts) -> dict:
    r = evaluate(engine.prerouted_logits, tokens, opts.val_window, opts.val_windows, teacher.logits)
    return {"perplexity": r["perplexity"], "kl_to_teacher": r["kl_to_reference"], "agreement": r["agreement"]}


def _mean(xs, part: str) -> float | None:
    if not xs:
        return None
    n = max(1, len(xs) // 10)
    return float(np.mean(xs[:n] if part == "first" else xs[-n:]))


def _probe(engine, teacher, prompts, opts):
    """A fixed batch for the distillation loss before and after training: the untrained
    student's greedy continuations of `prompts`, with the teacher's top-k view of them."""
    seqs = bd.student_generate(engine.model, engine.prerouting, prompts, opts.gen_tokens, 0.0, opts.seed)
    P = prompts.shape[1]
    return (seqs, P, *teacher.top_k(seqs, P, opts.distill_top_k))


def _phase1(trainer, teacher, prompts, windows, opts, progress) -> list[float]:
    """SFT on continuations the teacher samples from prompts of the data (`sft_text` "teacher"),
    or on windows of the data itself, every position scored by the teacher ("data")."""
    losses = []
    bar = tqdm(range(opts.sft_steps), desc="sft", unit="step", disable=not progress)
    for step in bar:
        if opts.sft_text == "data":
            seqs, P = windows(), 1
        else:
            seqs = teacher.generate(
                prompts(), opts.gen_tokens, opts.teacher_temperature, seed=opts.seed * 100003 + step
            )
            P = opts.prompt_tokens
        if opts.sft_targets == "soft":
            losses.append(trainer.soft_sft_step(seqs, P, *teacher.top_k(seqs, P, opts.distill_top_k)))
        else:
            losses.append(trainer.sft_step(seqs, P))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def _phase2(trainer, engine, teacher, prompts, opts, progress) -> list[float]:
    """On-policy distillation: the student samples continuations along its serving route, the
    teacher scores them."""
    losses = []
    bar = tqdm(range(opts.distill_steps), desc="distill", unit="step", disable=not progress)
    for step in bar:
        seqs = bd.student_generate(
            engine.model,
            engine.prerouting,
            prompts(),
            opts.gen_tokens,
            opts.student_temperature,
            seed=opts.seed * 100003 + 50021 + step,
        )
        losses.append(
            trainer.distill_step(seqs, opts.prompt_tokens, *teacher.top_k(seqs, opts.prompt_tokens, opts.distill_top_k))
        )
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def train(engine, teacher, text: str, opts: TrainOptions, *, data_name: str, teacher_name: str, progress: bool = True):
    """Attach fresh LoRA to `engine` (frozen otherwise), train it, return (tensors, meta, report)."""
    t0 = time.perf_counter()
    _check(opts, teacher.vocab_size)
    check_teacher(engine, teacher, text[:2000])
    tokens = engine.encode(text[: opts.max_tokens * 16])[: opts.max_tokens]  # no need to tokenize more
    n_val = max(opts.val_window * opts.val_windows, int(len(tokens) * opts.holdout))
    train_tok, val_tok = tokens[:-n_val], tokens[-n_val:]
    if len(train_tok) < opts.prompt_tokens + opts.gen_tokens + 1 or len(val_tok) < 2:
        raise Edge0Error(
            f"--data: too little text ({len(tokens)} tokens) for windows of {opts.prompt_tokens} + "
            f"{opts.gen_tokens} tokens plus {n_val} held-out tokens; give more text or lower --val-windows"
        )
    B.seed(opts.seed)
    deq = opts.dequantize_resident if opts.dequantize_resident is not None else B.default_device() == "cpu"
    if deq:
        blora.dequantize_resident(engine.model, engine.compute_dtype)
    engine.model.freeze()  # only the LoRA matrices created below are trainable
    if opts.init:  # attach_lora checks that it was trained for this base, K and pre-router
        start = attach_lora(engine, opts.init, dtype="float32")  # float32 master weights, as a fresh adapter
        paths, opts.r, opts.alpha, opts.targets = start["targets"], start["r"], start["alpha"], None
        wrapped = blora.lora_modules(engine.model)
    else:
        paths = blora.resolve_targets(engine.model, opts.targets or blora.candidate_linears(engine.model))
        wrapped = blora.apply_lora(engine.model, paths, opts.r, opts.alpha)
    teacher_val = evaluate(teacher.logits, val_tok, opts.val_window, opts.val_windows)["perplexity"]
    before = _validate(engine, teacher, val_tok, opts)
    trainer = bd.LoRATrainer(engine.model, engine.prerouting, opts.lr, opts.sft_steps + opts.distill_steps)
    rng = np.random.default_rng(opts.seed)

    def prompts():
        starts = rng.integers(0, len(train_tok) - opts.prompt_tokens, size=opts.batch)
        return np.array([train_tok[s : s + opts.prompt_tokens] for s in starts], dtype=np.int32)

    def windows(n=opts.prompt_tokens + opts.gen_tokens):
        starts = rng.integers(0, len(train_tok) - n, size=opts.batch)
        return np.array([train_tok[s : s + n] for s in starts], dtype=np.int32)

    probe = _probe(engine, teacher, prompts(), opts)
    probe_before = trainer.distill_value(*probe)
    sft = _phase1(trainer, teacher, prompts, windows, opts, progress)
    kl = _phase2(trainer, engine, teacher, prompts, opts, progress)
    after = _validate(engine, teacher, val_tok, opts)
    probe_after = trainer.distill_value(*probe)
    report = {
        "teacher_perplexity": teacher_val,
        "before": before,
        "after": after,
        "sft_loss_first": _mean(sft, "first"),
        "sft_loss_last": _mean(sft, "last"),
        "distill_loss_first": _mean(kl, "first"),
        "distill_loss_last": _mean(kl, "last"),
        "probe_distill_loss_before": probe_before,
        "probe_distill_loss_after": probe_after,
        "held_out_tokens": len(val_tok),
    }
    meta = {
        "manifest_sha256": manifest_hash(engine.root),
        "prerouter_sha256": prerouter_hash(engine),
        "top_k": engine.k,
        "r": opts.r,
        "alpha": opts.alpha,
        "targets": paths,
        "provenance": {
            "teacher": teacher_name,
            "data": data_name,
            "train_tokens": len(train_tok),
            "init": {"path": opts.init, "sha256": sha256_file(Path(opts.init))} if opts.init else None,
            "prerouter": str(engine.heads_path) if engine.prerouting is not None else None,
            "options": asdict(opts),
            "loss": {
                "phase1": PHASE1[opts.sft_targets].format(text=SFT_TEXT[opts.sft_text]),
                "phase2": PHASE2,
                "coarsening": COARSENING.format(k=opts.distill_top_k) if opts.distill_top_k else FULL_VOCAB,
            },
            "trainable_parameters": bt.n_trainable(engine.model),
            "validation": report,
            "date": datetime.date.today().isoformat(),
            "seconds": round(time.perf_counter() - t0, 1),
        },
    }
    return blora.lora_tensors(wrapped), meta, report
