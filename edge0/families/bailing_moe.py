"""Ling (bailing_moe): softmax or sigmoid scores, optional expert bias and group-limited
selection, renormalisation with a tiny epsilon, routed scaling, and shared experts."""

from edge0.spec import MoESpec, RoutingSpec, SharedSpec, quant_from_config

MODEL_TYPES = ("bailing_moe",)


def build_spec(config: dict) -> MoESpec:
    shared = config.get("num_shared_experts", 0) > 0 and config.get("moe_router_enable_shared_expert", True)
    return MoESpec(
        family="bailing_moe",
        num_experts=config["num_experts"],
        top_k=config["num_experts_per_tok"],
        routing=RoutingSpec(
            "grouped",
            norm_topk_prob=config["norm_topk_prob"],
            score_function=config.get("score_function", "softmax"),
            n_group=config.get("n_group", 1),
            topk_group=config.get("topk_group", 4),
            routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
            renorm_eps=1e-20,
            select="tail",
            cast_to_input=True,
        ),
        router="gate.gate_proj",
        router_bias="gate.expert_bias" if config.get("moe_router_enable_expert_bias", False) else None,
        shared=SharedSpec("plain", module="shared_experts") if shared else SharedSpec(),
        quant=quant_from_config(config),
    )
