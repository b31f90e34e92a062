"""Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): softmax top-k with optional renormalisation."""

from edge0.spec import MoESpec, RoutingSpec, quant_from_config

MODEL_TYPES = ("qwen3_moe",)


def build_spec(config: dict) -> MoESpec:
    return MoESpec(
        family="qwen3_moe",
        num_experts=config["num_experts"],
        top_k=config["num_experts_per_tok"],
        routing=RoutingSpec("softmax_topk", norm_topk_prob=config["norm_topk_prob"]),
        quant=quant_from_config(config),
    )
