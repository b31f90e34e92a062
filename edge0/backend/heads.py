"""The pre-router head as an MLX module: the head owned by MoE layer N reads layer N's MoE input
at token t and predicts layer N+1's router logits at token t+1 (see edge0/prerouter/)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten


class Head(nn.Module):
    """logits = linear(x) + fc2(gelu(fc1(x))); linear starts as the next layer's router and fc2
    starts at zero, so an untrained head predicts 'the next router applied to this layer's input'."""

    def __init__(self, dim: int, num_experts: int, hidden: int):
        super().__init__()
        self.linear = nn.Linear(dim, num_experts, bias=False)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, num_experts)
        self.fc2.weight = mx.zeros_like(self.fc2.weight)
        self.fc2.bias = mx.zeros_like(self.fc2.bias)

    def __call__(self, x):
        return self.linear(x) + self.fc2(nn.gelu(self.fc1(x)))


def new_head(init_linear: np.ndarray, hidden: int) -> Head:
    """A head whose linear part is `init_linear` [E, D] (the next layer's router)."""
    num_experts, dim = init_linear.shape
    head = Head(dim, num_experts, hidden)
    head.linear.weight = mx.array(init_linear.astype(np.float32))
    return head


def build_heads(tensors: dict, owners: list[int], dim: int, num_experts: int, hidden: int, dtype) -> dict:
    """Heads from a flat {f"{owner}.linear.weight": array, ...} dict."""
    heads = {}
    for o in owners:
        h = Head(dim, num_experts, hidden)
        h.update(
            tree_unflatten(
                [
                    (k.split(".", 1)[1], mx.array(v).astype(dtype))
                    for k, v in tensors.items()
                    if k.split(".", 1)[0] == str(o)
                ]
            )
        )
        heads[o] = h
    mx.eval([h.parameters() for h in heads.values()])
    return heads


def head_tensors(head: Head, owner: int) -> dict:
    """A head's parameters as float32 numpy, keyed f"{owner}.{name}" (the heads file's layout)."""
    return {f"{owner}.{k}": np.array(v.astype(mx.float32)) for k, v in tree_flatten(head.parameters())}
