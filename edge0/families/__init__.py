"""Spec'd families: one small module each, registered here by mlx-lm model_type.

A family module defines MODEL_TYPES and `build_spec(config) -> MoESpec`. Models of any other
mlx-lm family whose MoE block uses SwitchGLU/SwitchMLP still stream (the universal level) with
their own mlx-lm routing code; see docs/adding-a-model.md.
"""

from __future__ import annotations

from edge0.families import bailing_moe, deepseek_v3, mixtral, qwen3_5_moe, qwen3_moe
from edge0.spec import MoESpec

FAMILIES = {t: m for m in (qwen3_moe, qwen3_5_moe, deepseek_v3, mixtral, bailing_moe) for t in m.MODEL_TYPES}

# mlx-lm model types with routed experts that edge0 does not run, and why (docs/adding-a-model.md;
# tests/test_token_identity.py fails for an mlx-lm MoE module with neither a fixture nor an entry).
REFUSED = {
    "muse_spark": (
        "mlx-lm runs its attention only through a Metal kernel (mlx_lm/kernels/qk_norm_rope.py), so it cannot "
        "run or be tested on the CPU backend edge0 is built on"
    ),
    "prism_hadamard_qwen35": (
        "a 2-bit Hadamard-rotated pack that only mlx-lm's own packer (not shipped with it) writes, with its own "
        "module manifest; there is no Hugging Face or mlx-lm convert layout to convert or index"
    ),
}


def spec_for(config: dict) -> MoESpec | None:
    """The MoESpec of a spec'd family, or None for a family served at the universal level."""
    family = FAMILIES.get(config.get("model_type"))
    return family.build_spec(config) if family else None


def refusal(config: dict) -> str | None:
    """Why edge0 does not run this model type, or None."""
    return REFUSED.get(config.get("model_type"))


def supported() -> str:
    """Which models edge0 runs, for errors about a model it cannot run."""
    return (
        f"spec'd families: {', '.join(sorted(FAMILIES))}; other mlx-lm families whose routed experts are "
        "SwitchGLU/SwitchMLP modules, at the universal level"
    )
