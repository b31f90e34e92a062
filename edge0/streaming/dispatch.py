"""Executor choice per phase (prefill / decode) and per layer. Every executor computes the same
outputs (tested), so the choice changes only speed, memory and reads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from edge0.errors import Edge0Error
from edge0.streaming.exact import ExactExecutor
from edge0.streaming.hot import HotExecutor
from edge0.streaming.pool import SlotSet, default_budget, format_size, parse_size, slots_per_layer
from edge0.streaming.staged import StagedExecutor
from edge0.streaming.stats import ExecutorStats
from edge0.streaming.whole import LayerPrefetcher, WholeLayerExecutor

PREFILL = ("whole", "exact")
DECODE = ("staged", "hot", "exact")
# Policies the live pool can drive today: smoe needs router scores and flashmoe its weights file,
# which the pool does not pass yet; belady needs the future and exists only in the simulator.
LIVE_POLICIES = ("lru", "lfu", "arc")


@dataclass
class StreamingOptions:
    """How experts are streamed. `layer_executors` maps a layer to {"prefill": .., "decode": ..}."""

    expert_cache: int | str | None = None  # bytes or "2GB"; None = derived from free memory
    cache_policy: str = "lru"
    prefill_executor: str = "whole"
    decode_executor: str = "staged"
    whole_layer_min_tokens: int = 32  # shorter prefill chunks use the exact path
    layer_executors: dict = field(default_factory=dict)
    read_threads: int = 4

    def check(self) -> None:
        if self.cache_policy not in LIVE_POLICIES:
            raise Edge0Error(f"--cache-policy {self.cache_policy!r}: the live expert cache supports {', '.join(LIVE_POLICIES)}; "
                             "the others are available in `edge0 simulate`")
        for layer, choice in {None: {"prefill": self.prefill_executor, "decode": self.decode_executor},
                              **self.layer_executors}.items():
            where = "" if layer is None else f" (layer {layer})"
            if choice.get("prefill", "whole") not in PREFILL:
                raise Edge0Error(f"--prefill-executor{where} {choice['prefill']!r}: choose one of {', '.join(PREFILL)}")
            if choice.get("decode", "staged") not in DECODE:
                raise Edge0Error(f"--decode-executor{where} {choice['decode']!r}: choose one of {', '.join(DECODE)}")


class LayerDispatch:
    """Stands behind one StreamingExperts module: picks the executor for each call."""

    def __init__(self, prefill: dict, decode, min_tokens: int):
        self.prefill, self.decode, self.min_tokens = prefill, decode, min_tokens
        self.last = None

    def __call__(self, indices):
        t = indices.shape[-2] if indices.ndim >= 2 else 1
        if t == 1:
            ex = self.decode
        else:
            ex = self.prefill["whole"] if t >= self.min_tokens and "whole" in self.prefill else self.prefill["exact"]
        self.last = ex
        return ex(indices)

    def done(self, y) -> None:
        if hasattr(self.last, "done"):
            self.last.done(y)


class Streaming:
    """All executors of one engine, the expert pool they share, and their statistics."""

    def __init__(self, store, compute_dtype: str, k: int, resident_bytes: int, options: StreamingOptions):
        options.check()
        self.store, self.options = store, options
        self.stats = ExecutorStats()
        total = sum(store.expert_nbytes(l) * int(v["num_experts"]) for l, v in store.layers.items())
        self.budget = parse_size(options.expert_cache) if options.expert_cache is not None else default_budget(total, resident_bytes)
        self.total_expert_bytes = total
        layers = sorted(store.layers)
        need_slots = any(options.layer_executors.get(l, {}).get("decode", options.decode_executor) != "exact" for l in layers)
        self.n_slots = slots_per_layer(store, self.budget, k) if need_slots else 0
        self.reader = ThreadPoolExecutor(max_workers=options.read_threads, thread_name_prefix="edge0-read")
        self.prefetcher = LayerPrefetcher(store, layers, ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-layer"))
        self.layers: dict[int, LayerDispatch] = {}
        for l in layers:
            choice = {"prefill": options.prefill_executor, "decode": options.decode_executor, **options.layer_executors.get(l, {})}
            exact = ExactExecutor(store, l, compute_dtype, self.stats)
            prefill = {"exact": exact}
            if choice["prefill"] == "whole":
                prefill["whole"] = WholeLayerExecutor(store, l, compute_dtype, self.stats, self.prefetcher)
            if choice["decode"] == "exact":
                decode = exact
            else:
                slots = SlotSet(store, l, self.n_slots, compute_dtype, options.cache_policy)
                if choice["decode"] == "staged":
                    decode = StagedExecutor(store, l, compute_dtype, self.stats, slots, self.reader)
                else:
                    decode = HotExecutor(store, l, compute_dtype, self.stats, slots)
            self.layers[l] = LayerDispatch(prefill, decode, options.whole_layer_min_tokens)

    def describe(self) -> str:
        o = self.options
        return (f"expert cache {format_size(self.budget)} ({o.cache_policy}, {self.n_slots} slots per layer; "
                f"experts total {format_size(self.total_expert_bytes)}), prefill {o.prefill_executor}, decode {o.decode_executor}")

    def staged(self) -> dict[int, StagedExecutor]:
        """The staged decode executors by layer (for a stager)."""
        return {l: d.decode for l, d in self.layers.items() if isinstance(d.decode, StagedExecutor)}

    def end_step(self) -> None:
        """After a decode step was evaluated: read the device-side dropped-expert counters."""
        for ex in self.staged().values():
            ex.collect_dropped()
        self.stats.decode_steps += 1

    def close(self) -> None:
        self.prefetcher.cancel()
        self.reader.shutdown(wait=False, cancel_futures=True)
