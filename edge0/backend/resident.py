"""mlx-lm with every weight resident: the reference runtime `edge0 bench` compares against.

Floating parameters (norms, quantization scales and biases) are cast to the compute dtype edge0
would pick on this device (float32 on CPU, see docs/dtype.md), so both runtimes compute in the
same dtype on the same quantized tensors and their greedy tokens can be compared one to one.
"""

from __future__ import annotations


def import_runtime() -> None:
    """Import what the resident runtime needs (for the baseline-memory probe)."""
    import mlx_lm.generate  # noqa: F401
    import mlx_lm.utils  # noqa: F401


def load(path, dtype: str | None):
    """(model, tokenizer, compute dtype, resident bytes): `mlx_lm.load` of `path`, evaluated."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.utils import load as mlx_lm_load

    from edge0.backend import core as B

    model, tokenizer = mlx_lm_load(str(path))
    scales = [v for k, v in tree_flatten(model.parameters()) if k.endswith("scales")]
    ckpt = B.dtype_name(scales[0].dtype) if scales else "float32"
    compute = B.pick_compute_dtype(dtype, ckpt)
    if compute != ckpt:
        dt = getattr(mx, compute)
        cast = getattr(model, "cast_predicate", lambda _: True)
        model.update(
            tree_map_with_path(
                lambda k, v: v.astype(dt) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()
            )
        )
    from edge0.backend.assemble import evaluate_all

    evaluate_all(model)
    return model, tokenizer, compute, sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def load_frozen(path, dtype: str):
    """(model, tokenizer): `mlx_lm.load` of `path`, every parameter in `dtype`, frozen (a teacher)."""
    import mlx.core as mx
    from mlx_lm.utils import load as mlx_lm_load

    model, tokenizer = mlx_lm_load(str(path))
    model.set_dtype(getattr(mx, dtype))
    model.freeze()
    return model, tokenizer


def generate_tokens(model, ids: list[int], max_tokens: int):
    """Greedy token ids from mlx-lm's own `generate_step` (its prefill chunks and async decode)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    steps = generate_step(mx.array(ids), model, max_tokens=max_tokens, sampler=make_sampler(temp=0.0))
    return (tok for tok, _ in steps)


def version() -> str:
    import mlx_lm

    return mlx_lm.__version__
