"""Recovery distillation: the student's differentiable forward along its serving route, the
resident full-precision teacher, the losses (SFT cross-entropy, KLs over the whole vocabulary or
coarsened to the teacher's top-k) and the optimizer loop's steps."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from edge0.backend import core as B
from edge0.backend import kvcache as bkv
from edge0.backend import resident
from edge0.backend import train as bt

# Log-probabilities are clamped here so a teacher that gives a token (or the rest) zero mass
# yields a large but finite KL instead of inf/nan.
_LOG_FLOOR = -60.0


def student_logits(model, prerouting, ids):
    """Logits [B, T, V] of token ids [B, T] along the serving route: each pre-routed layer uses at
    position t the route its head predicted at t-1, exactly as decoding does (other layers and
    position 0 use the gate). Differentiable with respect to the LoRA parameters."""
    with prerouting.teacher_forcing() if prerouting is not None else nullcontext():
        return model(B.array(np.asarray(ids, dtype=np.int32)))


def _sample(logits, temperature: float, key):
    if temperature <= 0:
        return B.argmax(logits, axis=-1)
    return B.categorical(logits / temperature, key=key)


def student_generate(model, prerouting, prompts, n: int, temperature: float, seed: int) -> np.ndarray:
    """Continue every prompt of [B, P] by n tokens along the serving route, as Engine.generate
    does for one sequence (prompt prefilled with gate routing; then each step's pre-routed layers
    use the routes predicted at the previous step), all B in one batch. Needs the exact decode
    executor (slot sets hold one token's route). Returns [B, P + n]."""
    key = B.random_key(seed)
    cache = bkv.make_prompt_cache(model)
    x = B.array(np.asarray(prompts, dtype=np.int32))
    if prerouting is not None:
        prerouting.reset()
    try:
        if x.shape[1] > 1:
            model(x[:, :-1], cache=cache)
            B.eval([c.state for c in cache])
        if prerouting is not None:
            prerouting.stepping = True  # decode steps from here: the heads predict
        logits = model(x[:, -1:], cache=cache)[:, -1, :].astype(B.float32)
        out = [x]
        for i in range(n):
            key, sub = B.random_split(key)
            tok = _sample(logits, temperature, sub)
            B.eval(tok)
            out.append(tok[:, None])
            if i + 1 < n:
                if prerouting is not None:
                    prerouting.advance()  # the predictions made at this step route the next one
                logits = model(tok[:, None], cache=cache)[:, -1, :].astype(B.float32)
    finally:
        if prerouting is not None:
            prerouting.reset()
    return B.to_numpy(B.concatenate(out, axis=1))


def sft_loss(logits, ids, start: int):
    """Mean cross-entropy of ids[:, start:] (the teacher's continuation) under the student."""
    z = logits[:, start - 1 : -1].astype(B.float32)
    target = B.array(np.asarray(ids, dtype=np.int32)[:, start:])
    picked = B.take_along_axis(z, target[..., None], axis=-1)[..., 0]
    return (B.logsumexp(z, axis=-1) - picked).mean()


def _rest_mask(shape, idx):
    """0 everywhere but -inf at the top-k ids `idx`: a logsumexp over the rest of the vocabulary."""
    return B.put_along_axis(B.zeros(shape, dtype=B.float32), idx, B.array(-np.inf, "float32"), axis=-1)


def _coarse_student(logits, start: int, top_idx):
    """Student log-probabilities of the teacher's top-k tokens S [B, n, k] and of the bucket R of
    every other token [B, n], at the positions predicting ids[:, start:]. With top_idx None
    (no coarsening) S is the whole vocabulary, in token order, and R is None."""
    z = logits[:, start - 1 : -1].astype(B.float32)
    lse = B.logsumexp(z, axis=-1)
    if top_idx is None:
        return B.maximum(z - lse[..., None], _LOG_FLOOR), None
    idx = B.array(top_idx)
    logq_s = B.take_along_axis(z, idx, axis=-1) - lse[..., None]
    # log q_R as a logsumexp over the tokens outside S: exact even when q_R is tiny
    logq_r = B.logsumexp(z + _rest_mask(z.shape, idx), axis=-1) - lse
    return B.maximum(logq_s, _LOG_FLOOR), B.maximum(logq_r, _LOG_FLOOR)


def truncated_reverse_kl(logits, start: int, top_idx, top_logp, rest_logp):
    """Reverse KL(q || p) between student q and teacher p, both coarsened to the teacher's top-k
    tokens S plus one bucket R for every other token, averaged over the positions that predict
    ids[:, start:]:  sum_{v in S} q_v (log q_v - log p_v) + q_R (log q_R - log p_R).
    top_idx/top_logp [B, n, k] and rest_logp [B, n] come from `Teacher.top_k`."""
    logq_s, logq_r = _coarse_student(logits, start, top_idx)
    kl = (B.exp(logq_s) * (logq_s - B.array(top_logp))).sum(axis=-1)
    if logq_r is not None:
        kl = kl + B.exp(logq_r) * (logq_r - B.array(rest_logp))
    return kl.mean()


def truncated_forward_kl(logits, start: int, top_idx, top_logp, rest_logp):
    """Forward KL(p || q) on the same coarsening: sum_{v in S} p_v (log p_v - log q_v)
    + p_R (log p_R - log q_R); up to the teacher's entropy, the cross-entropy to the teacher's
    token distribution (soft-label SFT)."""
    logq_s, logq_r = _coarse_student(logits, start, top_idx)
    p_s = B.array(top_logp)
    kl = (B.exp(p_s) * (p_s - logq_s)).sum(axis=-1)
    if logq_r is not None:
        lp_r = B.array(rest_logp)
        kl = kl + B.exp(lp_r) * (lp_r - logq_r)
    return kl.mean()


class LoRATrainer:
    """Adam (with warmup, cosine decay and gradient clipping) on the model's trainable
    parameters, which are only the LoRA matrices once the model was frozen before `apply_lora`."""

    def __init__(self, model, prerouting, lr: float, steps: int, warmup: int = 10, clip: float = 1.0):
        self.model, self.prerouting = model, prerouting
        self.trainer = bt.Trainer(model, bt.warmup_cosine(lr, steps, warmup), clip)

    def _sft_objective(self, ids, start):
        return sft_loss(student_logits(self.model, self.prerouting, ids), ids, start)

    def _soft_objective(self, ids, start, top_idx, top_logp, rest_logp):
        return truncated_forward_kl(
            student_logits(self.model, self.prerouting, ids), start, top_idx, top_logp, rest_logp
        )

    def _kl_objective(self, ids, start, top_idx, top_logp, rest_logp):
        return truncated_reverse_kl(
            student_logits(self.model, self.prerouting, ids), start, top_idx, top_logp, rest_logp
        )

    def sft_step(self, ids, start: int) -> float:
        """One optimizer step on the SFT loss of a batch [B, T]; returns the loss before the step."""
        return self.trainer.step(self._sft_objective, ids, start)

    def soft_sft_step(self, ids, start: int, top_idx, top_logp, rest_logp) -> float:
        """One optimizer step on the truncated forward KL to the teacher (soft-label SFT)."""
        return self.trainer.step(self._soft_objective, ids, start, top_idx, top_logp, rest_logp)

    def distill_step(self, ids, start: int, top_idx, top_logp, rest_logp) -> float:
        """One optimizer step on the truncated reverse KL; returns the loss before the step."""
        return self.trainer.step(self._kl_objective, ids, start, top_idx, top_logp, rest_logp)

    def distill_value(self, ids, start: int, top_idx, top_logp, rest_logp) -> float:
        """The reverse-KL loss of a batch, without a step (a fixed probe before and after)."""
        return bt.value(self._kl_objective, ids, start, top_idx, top_logp, rest_logp)


class Teacher:
    """The full-precision model with its own gate routing, loaded resident by mlx-lm (HF or mlx-lm
    layout). Float32 on the CPU, where unquantized expert matmuls support nothing else."""

    def __init__(self, path):
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        native = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        self.dtype = B.pick_compute_dtype(None, native if native in ("float32", "bfloat16", "float16") else "float32")
        self.model, self.tokenizer = resident.load_frozen(path, self.dtype)
        self.vocab_size = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))

    def logits(self, ids: list[int]) -> np.ndarray:
        """Float32 logits [T, V] of one sequence (for evaluation)."""
        return B.to_numpy(self.model(B.array(ids)[None])[0].astype(B.float32))

    def generate(self, prompts, n: int, temperature: float, seed: int) -> np.ndarray:
        """Continue every prompt of [B, P] by n tokens (greedy at temperature 0); returns [B, P + n]."""
        key = B.random_key(seed)
        cache = bkv.make_prompt_cache(self.model)
        x = B.array(np.asarray(prompts, dtype=np.int32))
        out = [x]
        logits = self.model(x, cache=cache)[:, -1, :].astype(B.float32)
        for _ in range(n):
            if temperature > 0:
                key, sub = B.random_split(key)
                tok = B.categorical(logits / temperature, key=sub)
            else:
                tok = B.argmax(logits, axis=-1)
            out.append(tok[:, None])
            logits = self.model(tok[:, None], cache=cache)[:, -1, :].astype(B.float32)
        return B.to_numpy(B.concatenate(out, axis=1))

    def top_k(self, ids, start: int, k: int):
        """The teacher's view of the positions predicting ids[:, start:]: its top-k token ids
        [B, n, k], their log-probabilities [B, n, k] and the log of the remaining mass [B, n].
        k = 0 keeps the whole vocabulary: (None, log-probabilities [B, n, V], None)."""
        z = self.model(B.array(np.asarray(ids, dtype=np.int32)))[:, start - 1 : -1].astype(B.float32)
        logp = z - B.logsumexp(z, axis=-1, keepdims=True)
        if k == 0:
            return None, np.maximum(B.to_numpy(logp), _LOG_FLOOR), None
        idx = B.argpartition(-logp, k - 1, axis=-1)[..., :k]
        top = B.take_along_axis(logp, idx, axis=-1)
        rest = B.logsumexp(logp + _rest_mask(logp.shape, idx), axis=-1)
        B.eval(idx, top, rest)
        return (
            B.to_numpy(idx).astype(np.int32),
            np.maximum(B.to_numpy(top), _LOG_FLOOR),
            np.maximum(B.to_numpy(rest), _LOG_FLOOR),
        )
