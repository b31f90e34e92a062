"""The demo model: qwen3_moe config, construction with recording routers, balance loss, HF export."""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
from demo_data import DOC_SEP
from demo_model.common import atomic_write_json
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_moe


class RecordingGate(nn.Linear):
    """nn.Linear router that remembers its logits so the training loss can use them.
    Parameter names are unchanged (``mlp.gate.weight``)."""

    record: list | None = None

    def __call__(self, x):
        y = super().__call__(x)
        if RecordingGate.record is not None:
            RecordingGate.record.append(y)
        return y


def model_config(a) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "intermediate_size": a.moe_inter * a.top_k,  # unused: every layer is MoE
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "num_experts": a.experts,
        "num_experts_per_tok": a.top_k,
        "moe_intermediate_size": a.moe_inter,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "vocab_size": a.vocab,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "output_router_logits": False,
        "router_aux_loss_coef": a.aux_coef,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": a.layers,
        "bos_token_id": None,
        "eos_token_id": None,  # filled from the tokenizer
        "pad_token_id": None,
        "torch_dtype": "float32",
        "transformers_version": None,
    }


def set_special_ids(cfg: dict, tok) -> None:
    # generation stops at <|im_end|> (chat turns) and at <|endoftext|> (end of a document)
    cfg["eos_token_id"] = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids(DOC_SEP)]
    cfg["pad_token_id"] = tok.convert_tokens_to_ids(DOC_SEP)


def write_metadata(out_dir: str, cfg: dict) -> None:
    atomic_write_json(os.path.join(out_dir, "config.json"), cfg)
    gen_cfg = {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"], "do_sample": False}
    atomic_write_json(os.path.join(out_dir, "generation_config.json"), gen_cfg)


def build_model(cfg: dict, seed: int):
    mx.random.seed(seed)
    args = qwen3_moe.ModelArgs.from_dict(cfg)
    model = qwen3_moe.Model(args)
    # swap routers for recording ones, same init
    for layer in model.model.layers:
        old = layer.mlp.gate
        g = RecordingGate(cfg["hidden_size"], cfg["num_experts"], bias=False)
        g.weight = old.weight
        layer.mlp.gate = g
    # GPT-style small init for embeddings (tied head) and experts
    std = 0.02
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * std
    mx.eval(model.parameters())
    return model


def count_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def aux_balance_loss(gate_logits: list, n_experts: int, k: int) -> mx.array:
    """Switch-Transformer / Qwen-MoE load-balancing loss: E * sum_e f_e * P_e, averaged over layers."""
    total = 0.0
    for g in gate_logits:
        g = g.reshape(-1, n_experts)
        probs = mx.softmax(g.astype(mx.float32), axis=-1)
        inds = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]
        mask = mx.zeros_like(probs)
        mask = mx.put_along_axis(mask, inds, mx.array(1.0), axis=-1)
        f = mx.stop_gradient(mask.mean(axis=0) / k)
        p = probs.mean(axis=0)
        total = total + n_experts * mx.sum(f * p)
    return total / len(gate_logits)


def hf_weights(model, cfg: dict) -> dict:
    """mlx-lm parameters -> HF key names (inverse of qwen3_moe sanitize)."""
    out = {}
    for k, v in tree_flatten(model.parameters()):
        if ".mlp.switch_mlp." in k:
            prefix, rest = k.split(".mlp.switch_mlp.")
            proj = rest.split(".")[0]
            for e in range(cfg["num_experts"]):
                out[f"{prefix}.mlp.experts.{e}.{proj}.weight"] = v[e]
        else:
            out[k] = v
    if cfg["tie_word_embeddings"]:
        out.pop("lm_head.weight", None)
    return out
