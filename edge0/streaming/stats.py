"""Per-layer executor statistics: loads, hits, misses, bytes, stalls, slot rewrites, fallbacks,
substitutions, and the multi-token decode calls (a speculative verify) with their union of experts."""

from __future__ import annotations

from dataclasses import dataclass, field

COUNTERS = (
    "calls",
    "host_syncs",
    "loads",
    "hits",
    "misses",
    "bytes_read",
    "bytes_used",
    "slot_rewrites",
    "slot_scatters",
    "seeded",
    "fallbacks",
    "overlapped",
    "dropped",
    "substitutions",
    "multi_calls",
    "multi_tokens",
    "multi_routes",
    "multi_union",
    "span_whole",
    "span_union",
    "beyond_ahead",
    "beyond_ahead_used",
    "lookahead_predicted",
    "lookahead_agreed",
    "lookahead_reads",
    "lookahead_used",
    "lookahead_wasted_bytes",
    "early_experts",
    "early_unused",
)


@dataclass
class LayerStats:
    calls: int = 0
    host_syncs: int = 0  # routing indices copied to the host
    loads: int = 0  # experts read from storage
    hits: int = 0  # routed experts already resident (slot or hot set)
    misses: int = 0  # routed experts that had to be read
    bytes_read: int = 0
    bytes_used: int = 0  # bytes of the distinct experts each call actually used
    slot_rewrites: int = 0
    slot_scatters: int = 0  # slot tensors rewritten by a device scatter, not in place (see SlotSet.apply)
    seeded: int = 0  # experts a whole-layer prefill read left in the decode slots (StagedExecutor.fill)
    fallbacks: int = 0  # staged calls whose experts outnumbered the slots: the rest read for that call only
    overlapped: int = 0  # host-routed calls whose hits computed while their misses were read
    dropped: int = 0  # routed experts that were not staged (trusted staged mode only)
    substitutions: int = 0  # routed experts replaced by a cached one (--substitute-alpha; lossy)
    # decode calls with T > 1 tokens of one sequence (a speculative verify): tokens, T x K routed
    # (token, expert) pairs, and the distinct experts among them (each read or hit once per call)
    multi_calls: int = 0
    multi_tokens: int = 0
    multi_routes: int = 0
    multi_union: int = 0
    span_whole: int = 0  # layer-major prefill spans that read this layer whole
    span_union: int = 0  # ... that read only the union of their routes
    beyond_ahead: int = 0  # experts of a batch's staged union beyond the slots, read ahead too
    beyond_ahead_used: int = 0  # ... that its step then routed (the others were read for nothing)
    # the layer before's predictions of this layer's decode routes (streaming/lookahead.py):
    # experts routed while a prediction stood, those it foretold, experts read ahead on it, those
    # the route then took, and the bytes of the others (read for nothing)
    lookahead_predicted: int = 0
    lookahead_agreed: int = 0
    lookahead_reads: int = 0
    lookahead_used: int = 0
    lookahead_wasted_bytes: int = 0
    # predicted experts a token's call computed before its route reached the host, and those of
    # them it did not route (computed for nothing)
    early_experts: int = 0
    early_unused: int = 0
    stall_s: float = 0.0  # time blocked waiting for expert data
    distinct_experts: set = field(default_factory=set)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in COUNTERS}
        d["stall_ms"] = 1000 * self.stall_s
        d["distinct_experts"] = len(self.distinct_experts)
        d["read_amplification"] = self.bytes_read / self.bytes_used if self.bytes_used else None
        return d


@dataclass
class ExecutorStats:
    layers: dict = field(default_factory=dict)
    decode_steps: int = 0

    def layer(self, n: int) -> LayerStats:
        return self.layers.setdefault(n, LayerStats())

    def totals(self) -> dict:
        out = {k: sum(getattr(s, k) for s in self.layers.values()) for k in COUNTERS}
        out["stall_ms"] = 1000 * sum(s.stall_s for s in self.layers.values())
        out["distinct_experts"] = sum(len(s.distinct_experts) for s in self.layers.values())
        lookups = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / lookups if lookups else None
        out["read_amplification"] = out["bytes_read"] / out["bytes_used"] if out["bytes_used"] else None
        predicted = out["lookahead_predicted"]
        out["lookahead_recall"] = out["lookahead_agreed"] / predicted if predicted else None
        return out
