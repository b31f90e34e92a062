"""DeepSeek-V3 / R1 / Kimi-K2 style: sigmoid scores with a score-correction bias, group-limited
selection, renormalisation, routed scaling, and always-on shared experts."""

from edge0.spec import MoESpec, RoutingSpec, SharedSpec, quant_from_config

MODEL_TYPES = ("deepseek_v3",)


def build_spec(config: dict) -> MoESpec:
    return MoESpec(
        family="deepseek_v3",
        num_experts=config["n_routed_experts"],
        top_k=config.get("num_experts_per_tok", 1),
        routing=RoutingSpec(
            "grouped",
            norm_topk_prob=config.get("norm_topk_prob", True),
            score_function="sigmoid",
            n_group=config.get("n_group", 1),
            topk_group=config.get("topk_group", 1),
            routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
            select="head",
        ),
        router="gate.weight",
        router_bias="gate.e_score_correction_bias",
        shared=SharedSpec("plain", module="shared_experts") if config.get("n_shared_experts") else SharedSpec(),
        quant=quant_from_config(config),
    )
