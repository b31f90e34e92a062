"""FlashMoE-style learned eviction: a tiny MLP scores every evictable cached expert from its
recency 1/r, its frequency f / max f and a learned embedding of (layer, expert); the expert with
the highest score is evicted. Trained offline on Belady's choices (see edge0.cache.learn)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from edge0.cache.policy import Policy
from edge0.errors import Edge0Error

FORMAT = "edge0-cache-policy"
VERSION = 1
FEATURES = ["inv_recency", "freq_over_max"]
PARAMS = ("emb", "w1", "b1", "w2", "b2", "w3", "b3")


class Features:
    """Per-expert history of one layer. r = steps since last use + 1 (1 for an expert routed in
    the current step, so 1/r is in (0, 1]); f = steps routed so far."""

    def __init__(self, num_experts: int):
        self.last = np.full(num_experts, -(10**9), dtype=np.int64)
        self.count = np.zeros(num_experts, dtype=np.float64)
        self.step = 0

    def observe(self, step: int, routed: Sequence[int]) -> None:
        self.step = step
        self.last[routed] = step
        self.count[routed] += 1

    def __call__(self, experts: np.ndarray) -> np.ndarray:
        """[n, 2] float32 features of `experts`."""
        r = (self.step - self.last[experts] + 1).astype(np.float64)
        f = self.count[experts] / max(1.0, self.count.max())
        return np.stack([1.0 / r, f], axis=1).astype(np.float32)


class FlashMoEModel:
    """Parameters: emb [layers*E, d], w1 [2+d, h], b1 [h], w2 [h, h], b2 [h], w3 [h, 1], b3 [1];
    `layers` lists the model's MoE layer ids, row blocks of `emb` follow that order."""

    def __init__(self, params: dict, layers: Sequence[int], num_experts: int, metadata: dict | None = None):
        self.p = {k: np.asarray(params[k], dtype=np.float32) for k in PARAMS}
        self.layers, self.num_experts = [int(l) for l in layers], int(num_experts)
        self.metadata = metadata or {}
        if self.p["emb"].shape[0] != len(self.layers) * self.num_experts:
            raise ValueError("flashmoe: embedding rows do not match layers x experts")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.p.values())

    def rows(self, layer: int, experts: np.ndarray) -> np.ndarray:
        if layer not in self.layers:
            raise Edge0Error(
                f"cache policy weights: no layer {layer} (trained on layers {self.layers}); train them on a trace of "
                "this model"
            )
        return self.layers.index(layer) * self.num_experts + np.asarray(experts)

    def score(self, feats: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Eviction scores (higher = evict first) of candidates with features [..., 2] and
        embedding rows [...]."""
        p = self.p
        x = np.concatenate([feats, p["emb"][rows]], axis=-1)
        h = np.maximum(x @ p["w1"] + p["b1"], 0)
        h = np.maximum(h @ p["w2"] + p["b2"], 0)
        return (h @ p["w3"] + p["b3"])[..., 0]

    def save(self, path, metadata: dict) -> None:
        """Write safetensors atomically; `metadata` values are JSON-encoded."""
        from safetensors.numpy import save_file

        meta = {
            "format": FORMAT,
            "version": str(VERSION),
            "features": json.dumps(FEATURES),
            "layers": json.dumps(self.layers),
            "num_experts": str(self.num_experts),
        }
        meta.update({k: json.dumps(v) for k, v in metadata.items()})
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({k: np.ascontiguousarray(v) for k, v in self.p.items()}, str(tmp), metadata=meta)
        tmp.replace(path)


@functools.lru_cache(maxsize=8)
def load_model(path: str) -> FlashMoEModel:
    """Read weights written by `edge0 train-cache-policy` (cached: one read for all layers)."""
    from safetensors import safe_open

    regen = "regenerate them with: edge0 train-cache-policy --trace TRACE --out FILE"
    p = Path(path)
    if not p.is_file():
        raise Edge0Error(f"{p}: no such cache policy weights file; {regen}")
    try:
        with safe_open(str(p), framework="numpy") as f:
            meta = f.metadata() or {}
            params = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise Edge0Error(f"{p}: not a safetensors file ({e}); {regen}") from None
    if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
        raise Edge0Error(
            f"{p}: format {meta.get('format')!r} version {meta.get('version')}, this edge0 reads {FORMAT!r} version "
            f"{VERSION}; {regen}"
        )
    if json.loads(meta["features"]) != FEATURES or set(params) != set(PARAMS):
        raise Edge0Error(f"{p}: features or parameters differ from this edge0's model; {regen}")
    return FlashMoEModel(params, json.loads(meta["layers"]), int(meta["num_experts"]), metadata=meta)


class FlashMoE(Policy):
    """Options: `weights` (a file or a loaded FlashMoEModel) and `layer` (the model layer id)."""

    name = "flashmoe"

    def __init__(self, capacity: int, num_experts: int, weights=None, layer: int | None = None):
        super().__init__(capacity, num_experts)
        if weights is None or layer is None:
            raise ValueError("flashmoe needs weights=FILE (from edge0 train-cache-policy) and layer=N")
        self.model = weights if isinstance(weights, FlashMoEModel) else load_model(str(weights))
        if self.model.num_experts != num_experts:
            raise Edge0Error(
                f"cache policy weights are for {self.model.num_experts} experts, this layer has {num_experts}; train "
                "them on a trace of this model"
            )
        self.layer = layer
        self.feats = Features(num_experts)

    def observe(self, step: int, routed: Sequence[int], scores) -> None:
        self.feats.observe(step, routed)

    def victim(self, cached: set[int], protected: set[int]) -> int:
        cand = np.fromiter(sorted(e for e in cached if e not in protected), dtype=np.int64)
        s = self.model.score(self.feats(cand), self.model.rows(self.layer, cand))
        return int(cand[np.argmax(s)])
