"""Pre-router heads (MLX): the head owned by MoE layer N reads layer N's MoE input at token t and
predicts layer N+1's router logits at token t+1. The prediction, routed by the family's own
routing function, *is* layer N+1's route at t+1."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from edge0.routing import expert_scores, route


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


def router_weight(block) -> mx.array:
    """A SpecMoEBlock's router as a float32 [E, D] matrix (dequantized if quantized)."""
    r = block._lookup(block.spec.router)
    if isinstance(r, nn.QuantizedLinear):
        return mx.dequantize(r.weight, r.scales, r.biases, group_size=r.group_size, bits=r.bits).astype(mx.float32)
    if isinstance(r, nn.Linear):
        return r.weight.astype(mx.float32)
    return r.astype(mx.float32)


def router_bias(block):
    return block._lookup(block.spec.router_bias) if block.spec.router_bias else None


class PreRouting:
    """Serving state shared by the MoE blocks of one engine: heads by owner layer, the predicted
    routes for this step (`pending`) and the ones made during it for the next step (`next`)."""

    def __init__(self, heads: dict, consumer: dict, biases: dict, spec, k: int, diagnostics: bool = False):
        self.heads, self.consumer, self.biases = heads, consumer, biases
        self.spec, self.k, self.diagnostics = spec, k, diagnostics
        self.parallel = False  # full-sequence forward routed as decoding would (training, eval)
        self.pending: dict = {}
        self.next: dict = {}
        self.next_scores: dict = {}  # consumer layer -> the head's scores over all experts (lazy)
        self.overlaps: dict = {}  # consumer layer -> device scalars (diagnostic mode)
        self.routed_by_head: Counter = Counter()  # decode calls per layer that used a prediction
        self.routed_by_gate: Counter = Counter()  # ... and that evaluated the layer's own gate

    def reset(self) -> None:
        self.pending, self.next, self.next_scores, self.overlaps = {}, {}, {}, {}

    def predict(self, layer: int, x) -> None:
        """Owner layer hook: predict the consumer's route for the next token."""
        c = self.consumer[layer]
        logits = self.heads[layer](x.astype(mx.float32))
        self.next[c] = route(logits, self.spec.routing, self.k, self.biases[c])
        self.next_scores[c] = expert_scores(logits, self.spec.routing)  # for the expert cache

    def take(self, layer: int):
        """Consumer layer hook: this step's predicted route, or None (use the gate)."""
        r = self.pending.pop(layer, None)
        (self.routed_by_gate if r is None else self.routed_by_head)[layer] += 1
        return r

    def compare(self, layer: int, predicted, gate) -> None:
        """Diagnostic mode: count predicted experts that the gate also picked (on the device)."""
        hit = (predicted[..., :, None] == gate[..., None, :]).any(axis=-1).sum()
        self.overlaps.setdefault(layer, []).append(hit)

    def advance(self) -> None:
        self.pending, self.next, self.next_scores = self.next, {}, {}

    def next_indices(self) -> dict:
        return {c: inds for c, (inds, _) in self.next.items()}


def build_heads(tensors: dict, owners: list[int], dim: int, num_experts: int, hidden: int, dtype) -> dict:
    """Heads from a flat {f"{owner}.linear.weight": array, ...} dict."""
    heads = {}
    for o in owners:
        h = Head(dim, num_experts, hidden)
        h.update(tree_unflatten([(k.split(".", 1)[1], mx.array(v).astype(dtype)) for k, v in tensors.items() if k.split(".", 1)[0] == str(o)]))
        heads[o] = h
    mx.eval([h.parameters() for h in heads.values()])
    return heads


def head_tensors(head: Head, owner: int) -> dict:
    return {f"{owner}.{k}": np.array(v.astype(mx.float32)) for k, v in tree_flatten(head.parameters())}


def train_head(init_linear: np.ndarray, x: np.ndarray, target: np.ndarray, topk: np.ndarray, *, hidden: int,
               steps: int, lr: float, batch: int, listwise: float, score_function: str, seed: int = 0,
               divergence: float = 1.0):
    """Fit one head: loss = `divergence` x divergence to the next router's distribution + `listwise` x mean
    cross-entropy of the true top-k under the head's softmax. x [N, D], target [N, E] router
    probabilities (softmax) or per-expert sigmoid scores, topk [N, K] indices. Returns (head, losses)."""
    mx.random.seed(seed)
    n, dim = x.shape
    num_experts = target.shape[1]
    head = Head(dim, num_experts, hidden)
    head.linear.weight = mx.array(init_linear.astype(np.float32))
    opt = optim.Adam(learning_rate=optim.cosine_decay(lr, steps))
    xs, ts, ks = mx.array(x.astype(np.float32)), mx.array(target.astype(np.float32)), mx.array(topk.astype(np.int32))

    def loss_fn(model, xb, tb, kb):
        logits = model(xb)
        if score_function == "sigmoid":
            div = nn.losses.binary_cross_entropy(logits, tb, with_logits=True, reduction="mean") * num_experts
        else:
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            div = (tb * (mx.log(mx.maximum(tb, 1e-12)) - logp)).sum(axis=-1).mean()
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        lst = -mx.take_along_axis(logp, kb, axis=-1).mean()
        return divergence * div + listwise * lst

    step = nn.value_and_grad(head, loss_fn)
    rng = np.random.default_rng(seed)
    losses = []
    for i in range(steps):
        idx = mx.array(rng.integers(0, n, size=min(batch, n)))
        loss, grads = step(head, xs[idx], ts[idx], ks[idx])
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        losses.append(float(loss.item()))
    return head, losses


def head_topk(head: Head, x: np.ndarray, spec, k: int, bias) -> np.ndarray:
    """The route a head gives for features x [N, D] (indices [N, k])."""
    inds, _ = route(head(mx.array(x.astype(np.float32))), spec.routing, k, bias)
    return np.array(inds)
