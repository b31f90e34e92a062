"""Compute probes for forecasts: how fast this machine runs the quantized matmuls of a decode step."""

from __future__ import annotations

import time

import mlx.core as mx


def int4_matmul_rate(rows: int, cols: int, dtype: str = "float32", seconds: float = 0.3) -> float:
    """Bytes of int4 weights (codes, scales and biases) per second that one-token quantized
    matmuls x[1, cols] @ W[rows, cols]^T go through, as a decode step does."""
    dt = getattr(mx, dtype)
    w = mx.random.normal((rows, cols)).astype(dt)
    q, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((1, cols)).astype(dt)
    mx.eval(q, scales, biases, x)
    nbytes = q.nbytes + scales.nbytes + biases.nbytes
    n, t0 = 0, time.perf_counter()
    while True:
        mx.eval(mx.quantized_matmul(x, q, scales, biases, transpose=True, group_size=64, bits=4))
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and n >= 3:
            return n * nbytes / elapsed
