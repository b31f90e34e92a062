"""The mlx-lm resident arm of `edge0 bench`: every weight loaded into memory by `mlx_lm.load`,
tokens produced by mlx-lm's own `generate_step` (its prefill chunks and async decode pipeline).

Floating parameters (norms, quantization scales and biases) are cast to the compute dtype edge0
would pick on this device (float32 on CPU, see docs/dtype.md), so both runtimes compute in the
same dtype on the same quantized tensors and their greedy tokens can be compared one to one.
"""

from __future__ import annotations

import time


def import_runtime() -> None:
    """Import what the resident arm needs (for the baseline-memory probe)."""
    import mlx_lm.generate  # noqa: F401
    import mlx_lm.utils  # noqa: F401


def run_resident(spec: dict) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    from edge0.backend import core as B
    from edge0.bench.child import Timing, ids_digest, prompt_ids

    t0 = time.perf_counter()
    model, tokenizer = load(spec["mlx_model"])
    scales = [v for k, v in _flat(model.parameters()) if k.endswith("scales")]
    ckpt = B.dtype_name(scales[0].dtype) if scales else "float32"
    dtype = B.pick_compute_dtype(spec.get("dtype"), ckpt)
    if dtype != ckpt:
        dt = getattr(mx, dtype)
        cast = getattr(model, "cast_predicate", lambda _: True)
        model.update(tree_map_with_path(
            lambda k, v: v.astype(dt) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))
    mx.eval(model.parameters())
    load_s = time.perf_counter() - t0
    resident = sum(v.nbytes for _, v in _flat(model.parameters()))
    load_peak = mx.get_peak_memory()
    mx.reset_peak_memory()

    ids = prompt_ids(tokenizer, spec["prompt_tokens"])
    timing = Timing(dict, mx.reset_peak_memory, mx.get_peak_memory, spec.get("trace_out") is not None)
    steps = generate_step(mx.array(ids), model, max_tokens=spec["decode_tokens"], sampler=make_sampler(temp=0.0))
    out = timing.run(tok for tok, _ in steps)
    out.pop("counters_total")
    out.pop("counters_decode")
    out.update({
        "status": "ok",
        "describe": f"mlx-lm {_version()} resident: {dtype}, {resident / 1e9:.2f} GB of weights in memory",
        "compute_dtype": dtype,
        "load_s": load_s,
        "mlx_load_peak_bytes": load_peak,
        "resident_bytes": resident,
        "prompt_digest": ids_digest(ids),
        "prompt_tokens": len(ids),
        "trace": timing.trace,
    })
    return out


def _flat(params):
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def _version() -> str:
    import mlx_lm

    return mlx_lm.__version__
