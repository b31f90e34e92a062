"""What a matrix product costs by rows on this machine's MLX: an int4 quantized product (MLX's own
kernel) and a float32 one (the BLAS the MLX wheel links), against numpy's float32 product, for
1..9 rows. A speculative verify of T tokens feeds T rows to every product of a decode step, so
this sets how much more than a 1-token step it costs (docs/speculative.md).

Usage: python scripts/measure_row_cost.py [--rows 1,3,5,9] [--shape 2048x2048,32768x512] [--repeats 20]
Run it under the CPU lock: flock /tmp/edge0-cpu.lock python scripts/measure_row_cost.py
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np


def median_ms(f, repeats: int) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,3,5,9")
    ap.add_argument("--shape", default="2048x2048,32768x512", help="weights OUTxIN, comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    print(f"mlx {mx.__version__}, numpy {np.__version__}")
    print("weights      rows  mlx int4 ms  mlx f32 ms  numpy f32 ms")
    for shape in args.shape.split(","):
        n_out, n_in = (int(x) for x in shape.split("x"))
        w = mx.random.normal((n_out, n_in)) * 0.02
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        mx.eval(w, wq, scales, biases)
        w_np = np.array(w)
        for t in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((t, n_in))
            mx.eval(x)
            x_np = np.array(x)
            q = median_ms(
                lambda: mx.eval(mx.quantized_matmul(x, wq, scales, biases, group_size=64, bits=4)), args.repeats
            )
            f = median_ms(lambda: mx.eval(x @ w.T), args.repeats)
            n = median_ms(lambda: x_np @ w_np.T, args.repeats)
            print(f"{shape:>11}  {t:>4}  {q:>11.1f}  {f:>10.1f}  {n:>12.1f}")


if __name__ == "__main__":
    main()
