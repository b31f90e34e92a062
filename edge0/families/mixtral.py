"""Mixtral: top-k of the router logits, softmax over the selected k."""

from edge0.spec import MoESpec, RoutingSpec, quant_from_config

MODEL_TYPES = ("mixtral",)


def build_spec(config: dict) -> MoESpec:
    return MoESpec(
        family="mixtral",
        num_experts=config.get("num_local_experts", 8),
        top_k=config.get("num_experts_per_tok", 2),
        routing=RoutingSpec("topk_softmax"),
        quant=quant_from_config(config),
    )
