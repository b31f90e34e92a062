"""Training steps: Adam on a module's trainable parameters, learning-rate schedules, and the
few loss primitives that need mlx. The loops and the losses live with their features
(edge0/prerouter/train.py, edge0/lora/)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten


def cosine(lr: float, steps: int):
    """Cosine decay from `lr` to 0 over `steps`."""
    return optim.cosine_decay(lr, steps)


def warmup_cosine(lr: float, steps: int, warmup: int):
    """Linear warmup to `lr` over `warmup` steps, then cosine decay to lr/10."""
    warmup = max(1, min(warmup, steps // 2))
    return optim.join_schedules(
        [optim.linear_schedule(lr / warmup, lr, warmup), optim.cosine_decay(lr, max(1, steps - warmup), lr * 0.1)],
        [warmup],
    )


class Trainer:
    """Adam on `module`'s trainable parameters. `step(objective, *args)` differentiates
    `objective(*args)` (a scalar loss that reads the module) and applies one update."""

    def __init__(self, module, schedule, clip: float | None = None):
        self.module, self.clip = module, clip
        self.opt = optim.Adam(learning_rate=schedule)
        self._grad_fns: dict = {}

    def step(self, objective, *args) -> float:
        """One optimizer step; returns the loss before it."""
        fn = self._grad_fns.get(objective)
        if fn is None:
            fn = self._grad_fns[objective] = nn.value_and_grad(self.module, objective)
        loss, grads = fn(*args)
        if self.clip is not None:
            grads, _ = optim.clip_grad_norm(grads, self.clip)
        self.opt.update(self.module, grads)
        mx.eval(loss, self.module.trainable_parameters(), self.opt.state)
        return float(loss.item())


def value(objective, *args) -> float:
    """The loss `objective(*args)` evaluated, without gradients."""
    return float(objective(*args).item())


def n_trainable(module) -> int:
    """Number of trainable scalars."""
    return sum(v.size for _, v in tree_flatten(module.trainable_parameters()))


def binary_cross_entropy_with_logits(logits, targets):
    """Mean binary cross-entropy of `targets` under sigmoid(`logits`)."""
    return nn.losses.binary_cross_entropy(logits, targets, with_logits=True, reduction="mean")
