"""LoRA recovery training in MLX: the student's differentiable forward along its serving route,
the resident full-precision teacher, and the two losses (SFT cross-entropy, truncated reverse KL)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from edge0.backend import core as B

# Log-probabilities are clamped here so a teacher that gives a token (or the rest) zero mass
# yields a large but finite KL instead of inf/nan.
_LOG_FLOOR = -60.0


def dequantize_resident(model, dtype: str) -> int:
    """Replace every resident QuantizedLinear / QuantizedEmbedding (attention, routers, embedding
    and head; the streamed experts are not in the tree) by a float layer holding the same
    dequantized weight. Same function up to summation order, but on the CPU MLX's quantized
    matmul is ~35x slower than a float GEMM at training batch sizes. Returns the module count."""
    from edge0.backend.lora import set_module

    dt = getattr(mx, dtype)
    swapped = [(p, m) for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    for path, m in swapped:
        w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits).astype(dt)
        if isinstance(m, nn.QuantizedEmbedding):
            new = nn.Embedding(w.shape[0], w.shape[1])
        else:
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                new.bias = m.bias
        new.weight = w
        set_module(model, path, new)
    mx.eval(model.parameters())
    return len(swapped)


def student_logits(model, prerouting, ids) -> mx.array:
    """Logits [B, T, V] of token ids [B, T] along the serving route: each pre-routed layer uses at
    position t the route its head predicted at t-1, exactly as decoding does (other layers and
    position 0 use the gate). Differentiable with respect to the LoRA parameters."""
    x = mx.array(np.asarray(ids, dtype=np.int32))
    if prerouting is None:
        return model(x)
    prerouting.reset()
    prerouting.parallel = True
    try:
        return model(x)
    finally:
        prerouting.parallel = False
        prerouting.reset()


def _sample(logits, temperature: float, key):
    if temperature <= 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(logits / temperature, key=key)


def student_generate(model, prerouting, prompts, n: int, temperature: float, seed: int) -> np.ndarray:
    """Continue every prompt of [B, P] by n tokens along the serving route, as Engine.generate
    does for one sequence (prompt prefilled with gate routing; then each step's pre-routed layers
    use the routes predicted at the previous step), all B in one batch. Needs the exact decode
    executor (slot sets hold one token's route). Returns [B, P + n]."""
    from mlx_lm.models.cache import make_prompt_cache

    key = mx.random.key(seed)
    cache = make_prompt_cache(model)
    x = mx.array(np.asarray(prompts, dtype=np.int32))
    if prerouting is not None:
        prerouting.reset()
    try:
        if x.shape[1] > 1:
            model(x[:, :-1], cache=cache)
            mx.eval([c.state for c in cache])
        logits = model(x[:, -1:], cache=cache)[:, -1, :].astype(mx.float32)
        out = [x]
        for i in range(n):
            key, sub = mx.random.split(key)
            tok = _sample(logits, temperature, sub)
            mx.eval(tok)
            out.append(tok[:, None])
            if i + 1 < n:
                if prerouting is not None:
                    prerouting.advance()  # the predictions made at this step route the next one
                logits = model(tok[:, None], cache=cache)[:, -1, :].astype(mx.float32)
    finally:
        if prerouting is not None:
            prerouting.reset()
    return np.array(mx.concatenate(out, axis=1))


def sft_loss(logits, ids, start: int):
    """Mean cross-entropy of ids[:, start:] (the teacher's continuation) under the student."""
    z = logits[:, start - 1:-1].astype(mx.float32)
    target = mx.array(np.asarray(ids, dtype=np.int32)[:, start:])
    picked = mx.take_along_axis(z, target[..., None], axis=-1)[..., 0]
    return (mx.logsumexp(z, axis=-1) - picked).mean()


def _coarse_student(logits, start: int, top_idx):
    """Student log-probabilities of the teacher's top-k tokens S [B, n, k] and of the bucket R of
    every other token [B, n], at the positions predicting ids[:, start:]. With top_idx None
    (no coarsening) S is the whole vocabulary, in token order, and R is None."""
    z = logits[:, start - 1:-1].astype(mx.float32)
    lse = mx.logsumexp(z, axis=-1)
    if top_idx is None:
        return mx.maximum(z - lse[..., None], _LOG_FLOOR), None
    idx = mx.array(top_idx)
    logq_s = mx.take_along_axis(z, idx, axis=-1) - lse[..., None]
    # log q_R as a logsumexp over the tokens outside S: exact even when q_R is tiny
    mask = mx.put_along_axis(mx.zeros(z.shape, dtype=mx.float32), idx, mx.array(-np.inf, dtype=mx.float32), axis=-1)
    logq_r = mx.logsumexp(z + mask, axis=-1) - lse
    return mx.maximum(logq_s, _LOG_FLOOR), mx.maximum(logq_r, _LOG_FLOOR)


def truncated_reverse_kl(logits, start: int, top_idx, top_logp, rest_logp):
    """Reverse KL(q || p) between student q and teacher p, both coarsened to the teacher's top-k
    tokens S plus one bucket R for every other token, averaged over the positions that predict
    ids[:, start:]:  sum_{v in S} q_v (log q_v - log p_v) + q_R (log q_R - log p_R).
    top_idx/top_logp [B, n, k] and rest_logp [B, n] come from `Teacher.top_k`."""
    logq_s, logq_r = _coarse_student(logits, start, top_idx)
    kl = (mx.exp(logq_s) * (logq_s - mx.array(top_logp))).sum(axis=-1)
    if logq_r is not None:
        kl = kl + mx.exp(logq_r) * (logq_r - mx.array(rest_logp))
    return kl.mean()


def truncated_forward_kl(logits, start: int, top_idx, top_logp, rest_logp):
    """Forward KL(p || q) on the same coarsening: sum_{v in S} p_v (log p_v - log q_v)
    + p_R (log p_R - log q_R); up to the teacher's entropy, the cross-entropy to the teacher's
    token distribution (soft-label SFT)."""
    logq_s, logq_r = _coarse_student(logits, start, top_idx)
    p_s = mx.array(top_logp)
    kl = (mx.exp(p_s) * (p_s - logq_s)).sum(axis=-1)
    if logq_r is not None:
        lp_r = mx.array(rest_logp)
        kl = kl + mx.exp(lp_r) * (lp_r - logq_r)
    return kl.mean()


class LoRATrainer:
    """Adam (with warmup, cosine decay and gradient clipping) on the model's trainable
    parameters, which are only the LoRA matrices once the model was frozen before `apply_lora`."""

    def __init__(self, model, prerouting, lr: float, steps: int, warmup: int = 10, clip: float = 1.0):
        self.model, self.prerouting, self.clip = model, prerouting, clip
        warmup = max(1, min(warmup, steps // 2))
        schedule = optim.join_schedules([optim.linear_schedule(lr / warmup, lr, warmup),
                                         optim.cosine_decay(lr, max(1, steps - warmup), lr * 0.1)], [warmup])
        self.opt = optim.Adam(learning_rate=schedule)
        self._sft = nn.value_and_grad(model, self._sft_objective)
        self._soft = nn.value_and_grad(model, self._soft_objective)
        self._kl = nn.value_and_grad(model, self._kl_objective)

    def _sft_objective(self, ids, start):
        return sft_loss(student_logits(self.model, self.prerouting, ids), ids, start)

    def _soft_objective(self, ids, start, top_idx, top_logp, rest_logp):
        return truncated_forward_kl(student_logits(self.model, self.prerouting, ids), start, top_idx, top_logp, rest_logp)

    def _kl_objective(self, ids, start, top_idx, top_logp, rest_logp):
        return truncated_reverse_kl(student_logits(self.model, self.prerouting, ids), start, top_idx, top_logp, rest_logp)

    def _apply(self, loss, grads) -> float:
        grads, _ = optim.clip_grad_norm(grads, self.clip)
        self.opt.update(self.model, grads)
        mx.eval(loss, self.model.trainable_parameters(), self.opt.state)
        return float(loss.item())

    def sft_step(self, ids, start: int) -> float:
        """One optimizer step on the SFT loss of a batch [B, T]; returns the loss before the step."""
        return self._apply(*self._sft(ids, start))

    def soft_sft_step(self, ids, start: int, top_idx, top_logp, rest_logp) -> float:
        """One optimizer step on the truncated forward KL to the teacher (soft-label SFT)."""
        return self._apply(*self._soft(ids, start, top_idx, top_logp, rest_logp))

    def distill_step(self, ids, start: int, top_idx, top_logp, rest_logp) -> float:
        """One optimizer step on the truncated reverse KL; returns the loss before the step."""
        return self._apply(*self._kl(ids, start, top_idx, top_logp, rest_logp))

    def sft_value(self, ids, start: int) -> float:
        return float(self._sft_objective(ids, start).item())

    def distill_value(self, ids, start: int, top_idx, top_logp, rest_logp) -> float:
        return float(self._kl_objective(ids, start, top_idx, top_logp, rest_logp).item())


def n_trainable(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.trainable_parameters()))


class Teacher:
    """The full-precision model with its own gate routing, loaded resident by mlx-lm (HF or mlx-lm
    layout). Float32 on the CPU, where unquantized expert matmuls support nothing else."""

    def __init__(self, path):
        from mlx_lm.utils import load as mlx_lm_load

        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        native = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        self.model, self.tokenizer = mlx_lm_load(str(path))
        self.dtype = B.pick_compute_dtype(None, native if native in ("float32", "bfloat16", "float16") else "float32")
        self.model.set_dtype(getattr(mx, self.dtype))
        self.model.freeze()
        self.vocab_size = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))

    def logits(self, ids: list[int]) -> np.ndarray:
        """Float32 logits [T, V] of one sequence (for evaluation)."""
        return np.array(self.model(mx.array(ids)[None])[0].astype(mx.float32))

    def generate(self, prompts, n: int, temperature: float, seed: int) -> np.ndarray:
        """Continue every prompt of [B, P] by n tokens (greedy at temperature 0); returns [B, P + n]."""
        from mlx_lm.models.cache import make_prompt_cache

        key = mx.random.key(seed)
        cache = make_prompt_cache(self.model)
        x = mx.array(np.asarray(prompts, dtype=np.int32))
        out = [x]
        logits = self.model(x, cache=cache)[:, -1, :].astype(mx.float32)
        for _ in range(n):
            if temperature > 0:
                key, sub = mx.random.split(key)
                tok = mx.random.categorical(logits / temperature, key=sub)
            else:
                tok = mx.argmax(logits, axis=-1)
            out.append(tok[:, None])
            logits = self.model(tok[:, None], cache=cache)[:, -1, :].astype(mx.float32)
        return np.array(mx.concatenate(out, axis=1))

    def top_k(self, ids, start: int, k: int):
        """The teacher's view of the positions predicting ids[:, start:]: its top-k token ids
        [B, n, k], their log-probabilities [B, n, k] and the log of the remaining mass [B, n].
        k = 0 keeps the whole vocabulary: (None, log-probabilities [B, n, V], None)."""
        z = self.model(mx.array(np.asarray(ids, dtype=np.int32)))[:, start - 1:-1].astype(mx.float32)
        logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
        if k == 0:
            return None, np.maximum(np.array(logp), _LOG_FLOOR), None
        idx = mx.argpartition(-logp, k - 1, axis=-1)[..., :k]
        top = mx.take_along_axis(logp, idx, axis=-1)
        mask = mx.put_along_axis(mx.zeros(logp.shape, dtype=mx.float32), idx, mx.array(-np.inf, dtype=mx.float32), axis=-1)
        rest = mx.logsumexp(logp + mask, axis=-1)
        mx.eval(idx, top, rest)
        return (np.array(idx).astype(np.int32), np.maximum(np.array(top), _LOG_FLOOR),
                np.maximum(np.array(rest), _LOG_FLOOR))
