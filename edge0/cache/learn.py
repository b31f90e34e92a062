"""Training the FlashMoE-style eviction model on Belady's choices, in numpy.

Decisions are recorded while a driver policy runs the cache: at every eviction, the features
and embedding rows of the evictable experts, and the label: the experts Belady would evict
(farthest next use; ties share the label). The loss is a softmax over the candidates. Round 1
drives with Belady itself; later rounds drive with the model being trained (DAgger), so it also
learns from the states its own mistakes lead to.
"""

from __future__ import annotations

import math

import numpy as np

from edge0.cache.belady import Belady
from edge0.cache.flashmoe import Features, FlashMoE, FlashMoEModel
from edge0.cache.policy import ExpertCache, Policy


class _Recorder(Policy):
    """Forwards every hook to `driver`; at each victim() records (features, rows, labels)."""

    def __init__(self, driver: Policy, oracle: Belady, row0: int, sink: list):
        super().__init__(driver.capacity, driver.num_experts)
        self.driver, self.oracle, self.row0, self.sink = driver, oracle, row0, sink
        self.feats = Features(driver.num_experts)

    def observe(self, step, routed, scores):
        self.routed = set(routed)
        self.driver.observe(step, routed, scores)
        self.oracle.observe(step, routed, scores)
        self.feats.observe(step, routed)

    def on_hit(self, e):
        self.driver.on_hit(e)

    def on_miss(self, e):
        self.driver.on_miss(e)

    def on_insert(self, e):
        self.driver.on_insert(e)

    def on_evict(self, e):
        self.driver.on_evict(e)

    def victim(self, cached, protected):
        cand = np.fromiter(sorted(e for e in cached if e not in protected), dtype=np.int64)
        nxt = np.array([self.oracle.next_use[e] for e in cand], dtype=np.float64)
        # Evictions still due in this step (each remaining miss, or the trim after a route wider
        # than the cache): when every candidate must go anyway, the choice teaches nothing.
        due = len(self.routed - cached) if protected else len(cached) - self.capacity
        if len(cand) > max(1, due):
            self.sink.append((self.feats(cand), self.row0 + cand, (nxt == nxt.max()).astype(np.float32)))
        return self.driver.victim(cached, protected)


def collect(trace, capacities: list[int], model: FlashMoEModel | None = None) -> list:
    """Decisions of every layer and capacity; driven by Belady, or by `model` when given."""
    sink: list = []
    E = trace.num_experts
    for li, layer in enumerate(trace.layers):
        routes = np.asarray(trace.routes[li], dtype=np.int64).tolist()
        for cap in capacities:
            driver = Belady(cap, E, future=routes) if model is None else FlashMoE(cap, E, weights=model, layer=layer)
            cache = ExpertCache(_Recorder(driver, Belady(cap, E, future=routes), li * E, sink))
            for step, r in enumerate(routes):
                cache.access(step, r)
    return sink


def _pad(decisions: list):
    """Stack variable-size decisions into padded arrays [N, M, ...] with a mask."""
    M = max(len(r) for _, r, _ in decisions)
    N = len(decisions)
    x = np.zeros((N, M, 2), np.float32)
    rows = np.zeros((N, M), np.int64)
    y = np.zeros((N, M), np.float32)
    mask = np.zeros((N, M), bool)
    for i, (f, r, lab) in enumerate(decisions):
        n = len(r)
        x[i, :n], rows[i, :n], y[i, :n], mask[i, :n] = f, r, lab / lab.sum(), True
    return x, rows, y, mask


def init_params(num_rows: int, embed: int, hidden: int, rng) -> dict:
    def dense(i, o):
        return (rng.normal(size=(i, o)) * math.sqrt(2.0 / i)).astype(np.float32)

    return {
        "emb": (rng.normal(size=(num_rows, embed)) * 0.1).astype(np.float32),
        "w1": dense(2 + embed, hidden),
        "b1": np.zeros(hidden, np.float32),
        "w2": dense(hidden, hidden),
        "b2": np.zeros(hidden, np.float32),
        "w3": dense(hidden, 1),
        "b3": np.zeros(1, np.float32),
    }


def _loss_and_grads(p: dict, x, rows, y, mask):
    """Softmax cross-entropy over each decision's candidates, and its gradients."""
    X = np.concatenate([x, p["emb"][rows]], axis=-1)
    a1 = X @ p["w1"] + p["b1"]
    h1 = np.maximum(a1, 0)
    a2 = h1 @ p["w2"] + p["b2"]
    h2 = np.maximum(a2, 0)
    s = np.where(mask, (h2 @ p["w3"] + p["b3"])[..., 0], -np.inf)
    s = s - s.max(axis=1, keepdims=True)
    prob = np.exp(s)
    prob /= prob.sum(axis=1, keepdims=True)
    n = x.shape[0]
    loss = -float(np.sum(y * np.where(mask, np.log(np.maximum(prob, 1e-30)), 0.0))) / n
    ds = ((prob - y) * mask / n)[..., None].astype(np.float32)
    g = {"w3": h2.reshape(-1, h2.shape[-1]).T @ ds.reshape(-1, 1)}
    g["b3"] = ds.sum(axis=(0, 1))
    d2 = (ds @ p["w3"].T) * (a2 > 0)
    g["w2"] = h1.reshape(-1, h1.shape[-1]).T @ d2.reshape(-1, d2.shape[-1])
    g["b2"] = d2.sum(axis=(0, 1))
    d1 = (d2 @ p["w2"].T) * (a1 > 0)
    g["w1"] = X.reshape(-1, X.shape[-1]).T @ d1.reshape(-1, d1.shape[-1])
    g["b1"] = d1.sum(axis=(0, 1))
    dX = d1 @ p["w1"].T
    g["emb"] = np.zeros_like(p["emb"])
    np.add.at(g["emb"], rows.reshape(-1), dX[..., 2:].reshape(-1, dX.shape[-1] - 2))
    return loss, g


def fit(params: dict, decisions: list, epochs: int, rng, lr: float = 3e-3, batch: int = 256) -> float:
    """Adam on the decisions (in place); returns the last epoch's mean loss."""
    x, rows, y, mask = _pad(decisions)
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(val) for k, val in params.items()}
    t, loss = 0, float("nan")
    for _ in range(epochs):
        order = rng.permutation(len(x))
        losses = []
        for i in range(0, len(order), batch):
            idx = order[i : i + batch]
            l, g = _loss_and_grads(params, x[idx], rows[idx], y[idx], mask[idx])
            losses.append(l * len(idx))
            t += 1
            for k in params:
                m[k] = 0.9 * m[k] + 0.1 * g[k]
                v[k] = 0.999 * v[k] + 0.001 * g[k] ** 2
                params[k] -= (lr * (m[k] / (1 - 0.9**t)) / (np.sqrt(v[k] / (1 - 0.999**t)) + 1e-8)).astype(np.float32)
        loss = sum(losses) / len(order)
    return loss


def train(
    trace,
    capacities: list[int],
    embed: int = 4,
    hidden: int = 64,
    rounds: int = 2,
    epochs: int = 6,
    max_decisions: int = 50000,
    seed: int = 0,
    log=print,
) -> tuple[FlashMoEModel, float]:
    """Train on `trace` at `capacities`; returns (model, final training loss)."""
    rng = np.random.default_rng(seed)
    E = trace.num_experts
    # With exactly top-k slots every unrouted expert must go: no decision to learn from.
    capacities = [c for c in capacities if c != trace.top_k]
    params = init_params(len(trace.layers) * E, embed, hidden, rng)
    model, pool, loss = None, [], float("nan")
    for rnd in range(rounds):
        new = collect(trace, capacities, model)
        if len(new) > max_decisions:
            new = [new[i] for i in rng.choice(len(new), max_decisions, replace=False)]
        pool += new
        if not pool:
            raise ValueError(
                "the trace has no eviction decision with two or more candidates; record a longer trace or use a "
                "smaller budget"
            )
        loss = fit(params, pool, epochs, rng)
        model = FlashMoEModel(params, trace.layers, E)
        log(
            f"round {rnd + 1}/{rounds}: {len(new)} new decisions ({'Belady' if rnd == 0 else 'model'}-driven), "
            f"{len(pool)} in all, loss {loss:.4f}"
        )
    return model, loss
