"""Peak memory of the concurrency bench's pieces at one B, each in its own process (qwen3-like
routes, a 20% expert cache, warm): one text's B-token step, the B-token step routed as a batch's
rows (the ceiling's), or the batch of B itself; with --read-ahead each step's routes are staged
while the step before computes (the bench's --read-ahead). Prints MLX's peak and the process's
maximum RSS.

    python scripts/batch_step_peaks.py BENCH_MODEL_DIR one|rows|batch [B] [--read-ahead]
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import mlx.core as mx

import edge0
from edge0.bench.child import prompts_for
from edge0.bench.model import expert_budget, store_sizes
from edge0.bench.routing import use_synthetic_routing
from edge0.bench.speculative import forward_cost


def main(model: str, which: str, b: int = 8, read_ahead: bool = False) -> None:
    store = Path(model) / "store"
    e = edge0.load(store, prerouter=False, lora=False, expert_cache=expert_budget("20%", store_sizes(store)))
    routes = use_synthetic_routing(e, seed=0, lookahead=read_ahead)
    prompts = prompts_for(e.encode, b, 64)
    reference = e.generate(prompts[0], max_tokens=4 * b, ignore_eos=True).tokens
    run = {
        "one": lambda: forward_cost(e, prompts[0], reference, b, 3),
        "rows": lambda: forward_cost(e, prompts[0], reference, b, 3, 1, routes.route_tokens_as_rows),
        "batch": lambda: e.generate_batch(prompts, max_tokens=16, ignore_eos=True),
    }[which]
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    mode = " read-ahead" if read_ahead else ""
    peak = mx.get_peak_memory() / 2**20
    print(f"{which} B={b}{mode}: MLX peak {peak:.1f} MiB, max RSS {rss:.0f} MiB, {seconds:.1f} s")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--read-ahead"]
    if len(args) not in (2, 3) or args[1] not in ("one", "rows", "batch"):
        sys.exit(__doc__)
    main(args[0], args[1], int(args[2]) if len(args) == 3 else 8, "--read-ahead" in sys.argv)
