"""Qwen3.5 / Qwen3.6 MoE (and Qwen3-Next): hybrid attention, softmax top-k, and a shared
expert scaled by a sigmoid gate."""

from edge0.spec import MoESpec, RoutingSpec, SharedSpec, quant_from_config, text_config

MODEL_TYPES = ("qwen3_5_moe", "qwen3_next")


def build_spec(config: dict) -> MoESpec:
    c = text_config(config)
    return MoESpec(
        family="qwen3_5_moe",
        num_experts=c["num_experts"],
        top_k=c["num_experts_per_tok"],
        routing=RoutingSpec("softmax_topk", norm_topk_prob=c.get("norm_topk_prob", True)),
        shared=SharedSpec("gated", module="shared_expert", gate="shared_expert_gate"),
        quant=quant_from_config(config),
    )
