"""Executor choice per phase (prefill / decode) and per layer. Every executor computes the same
outputs (tested), so the choice changes only speed, memory and reads."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import numpy.ma  # noqa: F401  np.unique imports it at its first call (50 ms here): at load, not in the first decode step

from edge0.backend import core as B
from edge0.cache.flashmoe import FlashMoEModel, load_model
from edge0.errors import Edge0Error
from edge0.store.format import manifest_hash
from edge0.streaming.budget import PREFILL_LAYERS, Reserve, default_budget
from edge0.streaming.exact import ExactExecutor
from edge0.streaming.hot import HotExecutor
from edge0.streaming.lookahead import Lookahead
from edge0.streaming.pool import SlotSet, slots_per_layer
from edge0.streaming.staged import StagedExecutor
from edge0.streaming.stats import ExecutorStats
from edge0.streaming.whole import LayerPrefetcher, WholeLayerExecutor
from edge0.units import format_size, parse_size

PREFILL_EXECUTORS = {"whole": WholeLayerExecutor, "exact": ExactExecutor}
DECODE_EXECUTORS = {"staged": StagedExecutor, "hot": HotExecutor, "exact": ExactExecutor}
WHOLE_LAYER_MIN_TOKENS = 32  # shorter prefill chunks use the exact path
# A layer-major prefill span reads a layer whole when span x K >= E (63% of the experts routed
# under uniform routing), else only the union of its routes: measured in docs/long-prompts.md,
# whole reads overlap compute and win from there when the experts come from storage.
SPAN_WHOLE_FACTOR = 1
READ_THREADS = 4  # staged reads in flight
TRAIN_WEIGHTS = "edge0 trace --model STORE --data FILE --out TRACE && edge0 train-cache-policy --trace TRACE --out FILE"


def load_cache_weights(path, store) -> FlashMoEModel:
    """The flashmoe weights for `store`: an error unless they were trained on a trace of it."""
    try:
        model = load_model(str(Path(path).expanduser()))
    except Edge0Error as e:
        raise Edge0Error(f"--cache-weights {e}") from None
    trained_on = json.loads(model.metadata.get("manifest_hash", "null"))
    if trained_on != manifest_hash(store.root):
        raise Edge0Error(
            f"--cache-weights {path}: trained on a trace of another model (store manifest hash "
            f"{str(trained_on)[:12]}...); "
            f"train weights for this one: {TRAIN_WEIGHTS.replace('STORE', str(store.root))}"
        )
    return model


def _no_room(b, k: int, n_layers: int, need: int) -> str:
    """The one-line error when the default budget cannot hold one route in every MoE layer."""
    return (
        f"the expert cache does not fit in memory: {format_size(b.available)} available ({b.source}) leaves "
        f"{format_size(max(0, b.free))} after the KV cache ({format_size(b.kv)} at {b.context} tokens), prompt caches "
        f"({format_size(b.prompt_caches)}, --prompt-cache-memory), prefill "
        f"({format_size(b.prefill)}) and headroom ({format_size(b.headroom)}), and a decode step needs {k} experts "
        f"in each of {n_layers} MoE layers ({format_size(need)}); --expert-cache {math.ceil(need / 1e6)}MB would hold "
        f"them if memory allows (or free memory, raise the limit, or lower --context-tokens)"
    )


class LayerDispatch:
    """Stands behind one StreamingExperts module: picks the executor for each call. Calls with one
    token, and every call while `decoding` (a multi-token decode step: T tokens of one sequence,
    a speculative verify, or one token of each of B sequences), go to the decode executor; other
    calls are prefill chunks."""

    def __init__(self, prefill: dict, decode, min_tokens: int, k: int, num_experts: int, stats):
        self.prefill, self.decode, self.min_tokens = prefill, decode, min_tokens
        self.k, self.num_experts, self.stats = k, num_experts, stats
        self.decoding = False
        self.last = None
        self.span = None  # the executor of a layer-major prefill span in progress
        self.lookahead: Lookahead | None = None  # reads the next MoE layer's predicted experts (decode)
        self._at_done = None  # what a call runs once its compute started, if it has no deferred part

    def begin_span(self, tokens: int) -> None:
        """A prefill span of `tokens` tokens goes through this layer in one or more calls: with
        the whole-layer executor, read the layer once and hold it across the calls when the
        span's routes should cover most experts; otherwise read the union of the routes."""
        whole = self.prefill.get("whole")
        if whole is not None and tokens * self.k >= SPAN_WHOLE_FACTOR * self.num_experts:
            whole.hold()
            self.span = whole
            self.stats.span_whole += 1
        else:
            self.span = self.prefill["exact"]
            self.stats.span_union += 1

    def end_span(self) -> None:
        if self.span is self.prefill.get("whole"):
            self.span.release()
        self.span = None

    def __call__(self, indices, scores=None, ahead=None):
        """`scores`: the router's scores over all experts (lazy), for the expert cache. `ahead()`:
        the next MoE layer's predicted route (lazy ids, or None), asked for one token's decode
        call when this layer reads ahead for the next (`lookahead`)."""
        t = indices.size // indices.shape[-1] if indices.ndim >= 2 else 1  # tokens: B sequences x T each
        if self.span is not None:
            ex = self.span
        elif t == 1 or self.decoding:
            ex = self.decode
        else:
            ex = self.prefill["whole"] if t >= self.min_tokens and "whole" in self.prefill else self.prefill["exact"]
        self.last = ex
        la = self.lookahead
        predicted = ahead() if ahead is not None and la is not None and t == 1 and la.wanted(ex) else None
        if predicted is not None:
            B.async_eval(predicted)  # computed with the route the executor copies to the host
        parts = ex(indices, scores)
        if predicted is not None:
            parts = self._after_launch(parts, lambda: la.issue(B.to_numpy(predicted)))
        if t > 1 and self.decoding:
            self._count_multi(indices)
        return parts

    def _after_launch(self, parts: list, fn) -> list:
        """Run `fn` once this call's compute has started: before its first deferred part (the
        parts before it were launched), or at `done`. The next layer's read-ahead is issued there,
        off the gap between this layer's route and its experts' compute."""
        for i, part in enumerate(parts):
            if callable(part):

                def then(part=part):
                    fn()
                    return part()

                return [*parts[:i], then, *parts[i + 1 :]]
        self._at_done = fn
        return parts

    def _count_multi(self, indices) -> None:
        """A multi-token decode call: its tokens, routed pairs and distinct experts. Every
        executor has copied this route to the host already (T > 1 is never staged ahead), so this
        adds no sync."""
        ids = B.to_numpy(indices)
        s = self.stats
        s.multi_calls += 1
        s.multi_tokens += ids.size // ids.shape[-1]
        s.multi_routes += ids.size
        s.multi_union += len(np.unique(ids))

    def done(self, y) -> None:
        self.last.done(y)
        fn, self._at_done = self._at_done, None
        if fn is not None:
            fn()


class Streaming:
    """All executors of one engine, the expert pool they share, and their statistics."""

    def __init__(self, store, compute_dtype: str, k: int, options, reserve: Reserve | None = None):
        """`options`: the engine's validated LoadOptions (expert cache, policy, executors).
        `reserve`: what the default budget leaves room for besides two layers of experts and the
        headroom (None: nothing); its prompt caches' share is sized as the default budget sizes it
        even when --expert-cache is given (`prompt_caches`: bytes, what they were sized for)."""
        self.store, self.options = store, options
        self.stats = ExecutorStats()
        total = sum(store.expert_nbytes(l) * int(v["num_experts"]) for l, v in store.layers.items())
        largest = max((store.expert_nbytes(l) * int(v["num_experts"]) for l, v in store.layers.items()), default=0)
        reserve = reserve or Reserve(prompt_caches=0)
        budget = default_budget(total, reserve, PREFILL_LAYERS * largest + reserve.prefill)
        self.default = None if options.expert_cache is not None else budget
        self.prompt_caches = (budget.prompt_caches, budget.prompt_caches_for)
        self.budget = parse_size(options.expert_cache) if self.default is None else self.default.bytes
        self.total_expert_bytes = total
        layers = sorted(store.layers)
        self.cache_weights = load_cache_weights(options.cache_weights, store) if options.cache_weights else None
        need_slots = any(options.executor(l, "decode") != "exact" for l in layers)
        self.slot_bytes = sum(store.expert_nbytes(l) for l in layers)  # one slot in every MoE layer
        if need_slots and self.default is not None and self.budget < k * self.slot_bytes:
            raise Edge0Error(_no_room(self.default, k, len(layers), k * self.slot_bytes))
        self.n_slots = slots_per_layer(store, self.budget, k) if need_slots else 0
        self.configured_slots, self.min_slots = self.n_slots, k
        # a pipeline stage may hold no MoE layer at all (edge0.distributed): nothing to cache
        self.max_slots = min((int(v["num_experts"]) for v in store.layers.values()), default=0)
        self.reader = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="edge0-read")
        self.prefetcher = LayerPrefetcher(
            store, layers, ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-layer")
        )
        # a prefill's whole-layer reads seed the decode slots (StagedExecutor.fill); a batch turns it
        # off while other sequences decode, whose experts the seed would push out (engine/batch.py)
        self.seeding = True
        self.layers: dict[int, LayerDispatch] = {}
        for l in layers:
            exact = ExactExecutor(store, l, compute_dtype, self.stats)
            prefill = {"exact": exact}
            if options.executor(l, "prefill") == "whole":
                prefill["whole"] = WholeLayerExecutor(store, l, compute_dtype, self.stats, self.prefetcher)
            decode = options.executor(l, "decode")
            if decode == "exact":
                decode = exact
            else:
                slots = SlotSet(store, l, self.n_slots, compute_dtype, options.cache_policy, self._policy_options(l))
                if decode == "staged":
                    decode = StagedExecutor(
                        store,
                        l,
                        compute_dtype,
                        self.stats,
                        slots,
                        self.reader,
                        options.substitute_alpha,
                    )
                else:
                    decode = HotExecutor(store, l, compute_dtype, self.stats, slots)
            if "whole" in prefill and isinstance(decode, StagedExecutor):
                prefill["whole"].on_read = partial(self._fill, decode)
            num_experts = int(store.layers[l]["num_experts"])
            self.layers[l] = LayerDispatch(prefill, decode, WHOLE_LAYER_MIN_TOKENS, k, num_experts, self.stats.layer(l))

    def _fill(self, decode: StagedExecutor, params, routes) -> None:
        """A prefill's whole layer to `decode`'s slots while `seeding` (or when they hold every
        expert: filling them then evicts nothing)."""
        if self.seeding or decode.slots.n_slots >= decode.slots.num_experts:
            decode.fill(params, routes)

    def _policy_options(self, layer: int) -> dict:
        o = self.options
        if o.cache_policy == "flashmoe":
            return {"weights": self.cache_weights, "layer": layer}
        if o.cache_policy == "smoe" and o.smoe_window is not None:
            return {"window": o.smoe_window}
        return {}

    def use_lookahead(self, mode: str, layers: list[int]) -> None:
        """Each MoE layer in `layers` (the model predicts the next one's route from it) reads ahead
        for the next MoE layer when that layer decodes with the staged executor (lookahead.py)."""
        order = sorted(self.layers)
        for l, nxt in zip(order, order[1:]):
            target = self.layers[nxt].decode
            if l in layers and isinstance(target, StagedExecutor):
                self.layers[l].lookahead = Lookahead(target, mode)

    def lookahead_layers(self) -> int:
        """MoE layers that read ahead for the next one."""
        return sum(d.lookahead is not None for d in self.layers.values())

    def describe(self) -> str:
        o = self.options
        sub = f", substitution alpha {o.substitute_alpha} (changes outputs)" if o.substitute_alpha else ""
        n = self.lookahead_layers()
        if n:
            sub += f", reading one layer ahead ({o.lookahead}, {n} of {len(self.layers)} MoE layers)"
        default = f"; {self.default.describe()}" if self.default is not None else ""
        return (
            f"expert cache {format_size(self.budget)} ({o.cache_policy}, {self.n_slots} slots per layer; "
            f"experts total {format_size(self.total_expert_bytes)}{default}), prefill {o.prefill_executor}, decode "
            f"{o.decode_executor}{sub}"
        )

    def staged(self) -> dict[int, StagedExecutor]:
        """The staged decode executors by layer (for a stager)."""
        return {l: d.decode for l, d in self.layers.items() if isinstance(d.decode, StagedExecutor)}

    def slotted(self) -> list:
        """The decode executors that keep expert slots (staged, hot)."""
        return [d.decode for d in self.layers.values() if isinstance(d.decode, (StagedExecutor, HotExecutor))]

    def cache_info(self) -> dict:
        """The expert cache now: slots per MoE layer, their bounds, and bytes."""
        return {
            "slots_per_layer": self.n_slots,
            "configured_slots": self.configured_slots,
            "min_slots": self.min_slots if self.n_slots else 0,
            "max_slots": self.max_slots if self.n_slots else 0,
            "slot_bytes": self.slot_bytes,
            "budget_bytes": self.budget,
        }

    def resize(self, n_slots: int) -> None:
        """Give every slotted MoE layer `n_slots` slots (from top-k, one route, to the number of
        experts), the cache policy choosing which experts stay; freed slot memory goes back to
        the OS. Only between generations: nothing may be staged or reading the slots."""
        if not self.n_slots:
            raise Edge0Error(
                "the expert cache has no slots to resize: every layer decodes with the exact executor "
                "(--decode-executor exact)"
            )
        if not self.min_slots <= n_slots <= self.max_slots:
            raise Edge0Error(
                f"{n_slots} expert slots per layer: choose from {self.min_slots} (one route, top-k) "
                f"to {self.max_slots} (every expert)"
            )
        if n_slots == self.n_slots:
            return
        for ex in self.slotted():
            ex.resize(n_slots)
        self.n_slots, self.budget = n_slots, n_slots * self.slot_bytes
        B.release_cached_memory()

    @contextmanager
    def decoding(self):
        """Calls made inside are decode calls whatever their token count (a multi-token decode
        step: the decode executors read the union of the tokens' experts once, hits from their
        slots)."""
        for d in self.layers.values():
            d.decoding = True
        try:
            yield
        finally:
            for d in self.layers.values():
                d.decoding = False

    def end_step(self) -> None:
        """After a decode step was evaluated: read what the staged executors left on the device."""
        collect_after_step(self.staged().values())
        self.stats.decode_steps += 1

    def close(self) -> None:
        self.prefetcher.cancel()
        self.reader.shutdown(wait=False, cancel_futures=True)


def collect_after_step(executors) -> int:
    """After a step: read what the staged `executors` left on the device in one host sync (one a
    layer would cost a sync each): the counters of routed experts that were not staged, and the
    routes of calls over a cache holding every expert; add them to each layer's stats. Returns the
    dropped total."""
    pending = [(ex, *ex.take_after_step()) for ex in executors]
    arrays = [a for _, dropped, routes in pending for a in dropped + routes]
    if not arrays:
        return 0
    B.eval(*arrays)
    total = 0
    for ex, dropped, routes in pending:
        n = int(sum(B.to_numpy(d) for d in dropped))
        ex.stats.dropped += n
        total += n
        ex.count_routes([B.to_numpy(r) for r in routes])
    return total
