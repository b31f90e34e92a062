"""MoESpec: everything Edge0 needs to know about one MoE family, built from config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from edge0.errors import Edge0Error


@dataclass(frozen=True)
class RoutingSpec:
    """How router logits become (indices, weights); see edge0/backend/routing.py for the exact ops.

    kind:
      softmax_topk   softmax over all experts, top-k, optional renormalisation (Qwen3 MoE)
      topk_softmax   top-k of the logits, softmax over those k (Mixtral)
      grouped        sigmoid or softmax scores plus a score-correction bias, group-limited
                     selection (n_group/topk_group), renormalisation and routed scaling
                     (DeepSeek-V3, Ling)
    """

    kind: str
    norm_topk_prob: bool = False
    score_function: str = "softmax"  # grouped: "sigmoid" or "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    renorm_eps: float = 0.0  # Ling adds 1e-20 to the denominator
    select: str = "head"  # grouped: "head" = argpartition(-s)[:k], "tail" = argpartition(s)[-k:]
    cast_to_input: bool = False  # Ling casts weights back to the logits' dtype

    def __post_init__(self):
        if self.kind not in ("softmax_topk", "topk_softmax", "grouped"):
            raise ValueError(f"unknown routing kind {self.kind!r}")


@dataclass(frozen=True)
class SharedSpec:
    """Shared experts added to every token: none, plain (y + mlp(x)) or gated
    (y + sigmoid(gate(x)) * mlp(x)). Names are the children of the MoE block."""

    kind: str = "none"
    module: str | None = None
    gate: str | None = None


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    group_size: int = 64
    mode: str = "affine"


@dataclass(frozen=True)
class MoESpec:
    """One MoE family: experts, routing, shared experts, quantization and where things live.

    `router` is the path, inside the MoE block, of the module (a Linear) or weight matrix that
    produces router logits; `router_bias` the score-correction bias, if any. `experts` is the
    block's child holding the stacked expert tensors, whose keys are
    `{block}.{experts}.{proj}.{part}` for proj in `projections`, part in weight/scales/biases.
    """

    family: str
    num_experts: int
    top_k: int
    routing: RoutingSpec
    router: str = "gate"
    router_bias: str | None = None
    shared: SharedSpec = field(default_factory=SharedSpec)
    experts: str = "switch_mlp"
    projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    quant: QuantSpec = field(default_factory=QuantSpec)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MoESpec":
        d = dict(d)
        d["routing"] = RoutingSpec(**d["routing"])
        d["shared"] = SharedSpec(**d["shared"])
        d["quant"] = QuantSpec(**d["quant"])
        d["projections"] = tuple(d["projections"])
        return cls(**d)

    def serving_k(self, k: int | None) -> int:
        """Validate a serving width: any 1 <= K <= the model's native top-k (else Edge0Error)."""
        if k is None:
            return self.top_k
        if not 1 <= k <= self.top_k:
            raise Edge0Error(
                f"--top-k {k} is out of range: this {self.family} model routes to "
                f"{self.top_k} experts per token, so use 1..{self.top_k}"
            )
        return k


def text_config(config: dict) -> dict:
    """Multimodal checkpoints nest the language model's settings under text_config."""
    return {**config, **(config.get("text_config") or {})}


# What families call the hidden size and the attention heads (DBRX: d_model, n_heads; Phixtral:
# model_dim, num_heads).
HIDDEN_KEYS = ("hidden_size", "d_model", "model_dim")
HEADS_KEYS = ("num_attention_heads", "n_heads", "num_heads")


# What families call the number of routed experts and the experts per token (DBRX keeps both in
# ffn_config).
EXPERTS_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOP_K_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_top_k",
    "moe_topk",
    "moe_k",
    "top_k_experts",
    "top_k",
)


def moe_dims(config: dict) -> tuple[int, int]:
    """(routed experts, experts per token) of the text model, 0 where the config does not say."""
    c = text_config(config)
    c = {**(c.get("ffn_config") or {}), **c}
    experts = next((int(c[k]) for k in EXPERTS_KEYS if c.get(k)), 0)
    top_k = next((int(c[k]) for k in TOP_K_KEYS if c.get(k)), 0)
    return experts, top_k


def model_dims(config: dict) -> tuple[int, int]:
    """(hidden size, attention heads) of the text model, 0 where the config does not say."""
    c = text_config(config)
    hidden = next((int(c[k]) for k in HIDDEN_KEYS if c.get(k)), 0)
    heads = next((int(c[k]) for k in HEADS_KEYS if c.get(k)), 0)
    return hidden, heads


def quant_from_config(config: dict) -> QuantSpec:
    q = config.get("quantization") or {}
    return QuantSpec(bits=q.get("bits", 4), group_size=q.get("group_size", 64), mode=q.get("mode", "affine"))
