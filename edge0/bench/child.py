"""One benchmark arm in its own process (`python -m edge0.bench.child '<json spec>'`), so its peak memory is its own."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

# The spec names the runtime ("edge0", "mlx-lm" or "baseline"), the model paths, the load options,
# the prompt length and the number of generated tokens. The result is printed as one JSON line
# prefixed with RESULT_PREFIX. Every arm feeds the same prompt ids and decodes greedily; the timing
# loop (Timing) is shared by both runtimes so they are measured the same way:
#
# - time to first token (TTFT): from the generate call to the first token (prefill + one step);
# - prefill tok/s: prompt tokens / TTFT;
# - decode tok/s: (tokens - 1) / (time of the last token - time of the first);
# - MLX allocator peak over the whole generation (reset after loading; resident weights are
#   active memory, so they count), and over decode only (reset at the first token);
# - process peak RSS (VmHWM: load and generation).
RESULT_PREFIX = "EDGE0-BENCH-RESULT "

# A fixed English text; the prompt is its token ids repeated to the wanted length, so every arm
# (and both runtimes, which read the same tokenizer files) feeds exactly the same ids.
PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable metal type "
    "made it possible to reproduce books quickly and cheaply. Within fifty years, presses were "
    "running in more than two hundred cities, and the number of books in Europe grew into the millions. "
)


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = list(tokenizer.encode(PROMPT_TEXT))
    out = []
    while len(out) < n:
        out += ids
    return out[:n]


def prompts_for(encode, n: int, tokens: int) -> list[list[int]]:
    """n different prompts of `tokens` tokens (--concurrency): the text rotated by three words each."""
    words = PROMPT_TEXT.split()
    texts = [" ".join((words[3 * i :] + words[: 3 * i]) * (1 + tokens // len(words))) for i in range(n)]
    return [encode(t)[:tokens] for t in texts]


def ids_digest(ids) -> str:
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def store_files(store) -> list[Path]:
    return sorted(Path(store).rglob("*.safetensors"))


class Timing:
    """The per-token loop shared by both runtimes. `snapshot()` returns cumulative counters (or
    {}), `reset_peak()`/`peak()` the MLX allocator peak."""

    def __init__(self, snapshot, reset_peak, peak, trace: bool):
        self.snapshot, self.reset_peak, self.peak = snapshot, reset_peak, peak
        self.trace = [] if trace else None

    def run(self, tokens_iter) -> dict:
        tokens, times = [], []
        t0 = time.perf_counter()
        start = prev_s = first = self.snapshot()
        prev_t = t0
        gen_peak = 0
        for tok in tokens_iter:
            now = time.perf_counter()
            tokens.append(int(tok))
            times.append(now)
            snap = self.snapshot()
            if self.trace is not None:
                self.trace.append(_trace_row(len(tokens) - 1, now - prev_t, prev_s, snap))
            if len(tokens) == 1:
                gen_peak = self.peak()
                self.reset_peak()
                first = snap
            prev_t, prev_s = time.perf_counter(), snap
        decode_peak = self.peak()
        n = len(tokens)
        decode_s = times[-1] - times[0] if n > 1 else 0.0
        return {
            "tokens": tokens,
            "generation_tokens": n,
            "ttft_s": times[0] - t0,
            "decode_s": decode_s,
            "decode_tps": (n - 1) / decode_s if decode_s > 0 else None,
            "mlx_peak_bytes": max(gen_peak, decode_peak),
            "mlx_decode_peak_bytes": decode_peak,
            "counters_total": _delta(start, prev_s),
            "counters_decode": _delta(first, prev_s),
        }


def _delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in b if k != "layer_stall_ms" and isinstance(b[k], (int, float))}


def _trace_row(step: int, wall_s: float, a: dict, b: dict) -> dict:
    d = _delta(a, b)
    stall = d.get("stall_ms", 0.0)
    row = {
        "step": step,
        "phase": "prefill+first" if step == 0 else "decode",
        "wall_ms": 1000 * wall_s,
        "stall_ms": stall,
        "compute_ms": max(0.0, 1000 * wall_s - stall),
        "bytes_read": d.get("bytes_read", 0),
        "loads": d.get("loads", 0),
        "hits": d.get("hits", 0),
        "misses": d.get("misses", 0),
        "host_syncs": d.get("host_syncs", 0),
    }
    if "layer_stall_ms" in b:
        row["layer_stall_ms"] = [round(y - x, 3) for x, y in zip(a["layer_stall_ms"], b["layer_stall_ms"])]
    return row


# ----------------------------------------------------------------------------- edge0


def run_edge0(spec: dict) -> dict:
    import edge0
    from edge0.backend import core as B

    t0 = time.perf_counter()
    opts = dict(spec.get("load", {}))
    want_prerouter = spec.get("prerouter_required", False)
    try:
        engine = edge0.load(spec["store"], **opts)
    except Exception as e:  # noqa: BLE001 - any load failure of an optional feature is a skip
        if want_prerouter:
            return {"status": "skipped", "reason": f"loading with the pre-router failed: {type(e).__name__}: {e}"}
        raise
    if spec.get("routing", "uniform") != "uniform":
        from edge0.bench.routing import use_synthetic_routing

        use_synthetic_routing(engine, seed=0, lookahead=spec.get("lookahead", False))
    elif want_prerouter and engine.prerouting is None:
        return {
            "status": "skipped",
            "reason": "no pre-router heads were attached (the store has no "
            "prerouter.safetensors and --prerouter was not given)",
        }
    if spec.get("lora_required") and engine.lora_path is None:
        return {
            "status": "skipped",
            "reason": engine.lora_note
            or "no recovery LoRA was attached (the store has no adapter and --lora was not given)",
        }
    load_s = time.perf_counter() - t0
    load_peak = B.peak_memory()
    B.reset_peak_memory()
    stats = engine.streaming.stats
    layers = sorted(engine.streaming.layers)

    def snapshot():
        t = stats.totals()
        s = {
            k: t[k]
            for k in (
                "bytes_read",
                "loads",
                "hits",
                "misses",
                "host_syncs",
                "stall_ms",
                "fallbacks",
                "dropped",
                "early_experts",
                "early_unused",
            )
        }
        s["reads"] = engine.store.io_stats()["reads"]
        s["layer_stall_ms"] = [1000 * stats.layer(l).stall_s for l in layers]
        return s

    timing = Timing(snapshot, B.reset_peak_memory, B.peak_memory, spec.get("trace_out") is not None)
    ids = prompt_ids(engine.tokenizer, spec["prompt_tokens"])
    should_stop = (lambda: False) if spec.get("cancellable") else None
    stream = engine.stream_generate(
        ids, max_tokens=spec["decode_tokens"], temperature=0.0, ignore_eos=True, should_stop=should_stop
    )
    final = {}  # the last Step's stats: they split the prefill's reads and stall from the decode's

    def tokens():
        for step in stream:
            final["stats"] = step.stats
            yield step.token

    out = timing.run(tokens())
    gen = final["stats"]
    total, dec = out.pop("counters_total"), out.pop("counters_decode")
    lookups = dec["hits"] + dec["misses"]
    n_dec = max(1, out["generation_tokens"] - 1)
    out.update(
        {
            "status": "ok",
            "describe": engine.describe()
            + (f", pre-router {engine.heads_path}" if engine.heads_path else "")
            + (
                f", routing {spec['routing']}" + (" (routes staged one step ahead)" if spec.get("lookahead") else "")
                if spec.get("routing", "uniform") != "uniform"
                else ""
            ),
            "load_s": load_s,
            "mlx_load_peak_bytes": load_peak,
            "resident_bytes": engine.resident_bytes,
            "expert_cache_bytes": engine.streaming.budget,
            "expert_bytes_read": total["bytes_read"],
            "decode_expert_bytes_read": dec["bytes_read"],
            "prefill_expert_bytes_read": gen["prefill_expert_bytes_read"],
            "prefill_stall_ms": gen["prefill_stall_ms"],
            "lookahead_recall": gen["lookahead_recall"],
            "lookahead_wasted_bytes": gen["lookahead_wasted_bytes"],
            "hit_rate": dec["hits"] / lookups if lookups and engine.streaming.n_slots else None,  # exact: no cache
            "stall_ms_per_step": dec["stall_ms"] / n_dec,
            "host_syncs_per_step": dec["host_syncs"] / n_dec,
            "early_experts_per_step": dec["early_experts"] / n_dec,
            "early_unused_per_step": dec["early_unused"] / n_dec,
            "expert_reads_per_step": dec["reads"] / n_dec,
            "io_max_queue_depth": engine.store.io_stats()["max_queue_depth"],
            "io": engine.store.io_stats(),
            "fallbacks": total["fallbacks"],
            "dropped_experts": total["dropped"],
            "prompt_digest": ids_digest(ids),
            "prompt_tokens": len(ids),
            "trace": timing.trace,
        }
    )
    engine.close()
    return out


def run_resident(spec: dict) -> dict:
    """The mlx-lm arm: every weight resident, tokens from mlx-lm's own generate loop."""
    from edge0.backend import core as B
    from edge0.backend import resident

    t0 = time.perf_counter()
    model, tokenizer, dtype, resident_bytes = resident.load(spec["mlx_model"], spec.get("dtype"))
    load_s = time.perf_counter() - t0
    load_peak = B.peak_memory()
    B.reset_peak_memory()
    ids = prompt_ids(tokenizer, spec["prompt_tokens"])
    timing = Timing(dict, B.reset_peak_memory, B.peak_memory, spec.get("trace_out") is not None)
    out = timing.run(resident.generate_tokens(model, ids, spec["decode_tokens"]))
    out.pop("counters_total")
    out.pop("counters_decode")
    out.update(
        {
            "status": "ok",
            "describe": f"mlx-lm {resident.version()} resident: {dtype}, {resident_bytes / 1e9:.2f} GB of weights in "
            "memory",
            "compute_dtype": dtype,
            "load_s": load_s,
            "mlx_load_peak_bytes": load_peak,
            "resident_bytes": resident_bytes,
            "prompt_digest": ids_digest(ids),
            "prompt_tokens": len(ids),
            "trace": timing.trace,
        }
    )
    return out


def run_baseline(spec: dict) -> dict:
    """Memory of a process that has imported both runtimes and loaded the tokenizer, but no
    weights: what either runtime needs before its first weight byte."""
    # everything an edge0 arm imports before its first weight byte (the cap is set on top of it)
    import edge0.runtime  # noqa: F401
    from edge0.backend import core as B
    from edge0.backend import io as bio
    from edge0.backend import resident

    resident.import_runtime()
    if spec.get("store"):
        bio.load_tokenizer(Path(spec["store"]))
    B.eval(B.array([1.0]) + 1)  # initialise the MLX runtime
    return {"status": "ok", "peak_rss_bytes": B.peak_rss()}


def run(spec: dict) -> dict:
    t0 = time.perf_counter()
    if spec.get("evict"):
        from edge0.store.pagecache import evict

        evict(spec["evict"])
    kind = spec["runtime"]
    if kind == "edge0":
        out = run_edge0(spec)
    elif kind == "mlx-lm":
        out = run_resident(spec)
    elif kind == "baseline":
        out = run_baseline(spec)
    else:
        raise ValueError(f"unknown runtime {kind!r}")
    trace = out.pop("trace", None)
    if spec.get("trace_out") and trace is not None:
        Path(spec["trace_out"]).write_text(json.dumps({"arm": spec.get("name"), "steps": trace}, indent=1) + "\n")
    if out.get("status") == "ok":
        from edge0.backend.core import peak_rss  # every runtime has imported mlx by now

        out["peak_rss_bytes"] = peak_rss()
        out["wall_s"] = time.perf_counter() - t0
        if "decode_tps" in out and out.get("ttft_s"):
            out["prefill_tps"] = out.get("prompt_tokens", spec.get("prompt_tokens", 0)) / out["ttft_s"]
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    out = run(spec)
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
