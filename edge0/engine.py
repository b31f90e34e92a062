"""The engine: load a store, prefill and decode with streamed experts, sampling, stats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from edge0.backend import core as B
from edge0.backend import io as bio
from edge0.backend import nn as bnn
from edge0.errors import Edge0Error
from edge0.spec import MoESpec
from edge0.store import ExpertStore, open_manifest
from edge0.streaming.dispatch import Streaming, StreamingOptions
from edge0.streaming.pool import format_size
from edge0.textstream import StopMatcher


@dataclass
class Step:
    token: int
    text: str
    finish_reason: str | None = None
    stats: dict | None = None


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)


def load(path=None, *, dtype: str | None = None, top_k: int | None = None, verify: bool = False,
         expert_cache=None, cache_policy: str = "lru", prefill_executor: str = "whole",
         decode_executor: str = "staged", layer_executors: dict | None = None,
         prerouter=None, prerouter_diagnostics: bool = False, lora=None, cold_reads: bool = False,
         cache_weights=None, smoe_window: int | None = None, substitute_alpha: float = 0.0) -> "Engine":
    """Open an edge0 store and assemble its model. See docs/engine-api.md.

    `prerouter`: None = the store's prerouter.safetensors if present, False = none, or a path.
    `lora`: None = the store's adapter for this K and routing (lora-k{K}.safetensors or
    lora.safetensors) if there is one, False = none, or a path."""
    from edge0.models import resolve_model

    root = resolve_model(path)
    manifest = open_manifest(root, verify=verify)
    config = bio.load_config(root)
    spec = MoESpec.from_dict(manifest["spec"]) if manifest.get("spec") else None
    if top_k is not None and spec is None:
        raise Edge0Error(f"--top-k: {manifest['model_type']} has no MoESpec (universal level); the serving width can only be changed for spec'd families")
    k = spec.serving_k(top_k) if spec else None
    ckpt_dtype = next((t["dtype"] for l in manifest["expert_layers"] for n, t in l["tensors"].items() if n.endswith("scales")), "F32")
    compute = B.pick_compute_dtype(dtype, B.ST_DTYPES.get(ckpt_dtype, "float32"))
    store = ExpertStore(root, manifest, cold_reads=cold_reads)
    options = StreamingOptions(expert_cache, cache_policy, prefill_executor, decode_executor,
                               layer_executors=layer_executors or {}, cache_weights=cache_weights,
                               smoe_window=smoe_window, substitute_alpha=substitute_alpha)
    if spec is None and (cache_policy == "smoe" or substitute_alpha):
        flag = "--cache-policy smoe" if cache_policy == "smoe" else "--substitute-alpha"
        raise Edge0Error(f"{flag} needs router scores, which Edge0 has only for spec'd families ({manifest['model_type']} "
                         "is served at the universal level); use --cache-policy lru, lfu or arc without substitution")
    model = bnn.assemble(root, manifest, config, spec, k, compute)
    streaming = Streaming(store, compute, k or _native_k(config), bnn.resident_bytes(model), options)
    bnn.attach_executors(model, streaming.layers)
    engine = Engine(root, model, bio.load_tokenizer(root), store, streaming, spec, k, compute)
    heads_path = _heads_path(root, prerouter, spec)
    if heads_path is not None:
        from edge0.prerouter.serve import attach_prerouter

        attach_prerouter(engine, heads_path, manifest, diagnostics=prerouter_diagnostics)
    if lora is not False:
        from edge0.lora.serve import attach_lora, store_adapter

        adapter, engine.lora_note = (Path(lora).expanduser(), "") if lora is not None else store_adapter(engine)
        if adapter is not None:
            attach_lora(engine, adapter)
    return engine


def _heads_path(root: Path, prerouter, spec):
    from edge0.prerouter.heads import DEFAULT_NAME

    if prerouter is False:
        return None
    if prerouter is None:
        auto = root / DEFAULT_NAME
        return auto if auto.is_file() and spec is not None else None
    if spec is None:
        raise Edge0Error(f"--prerouter {prerouter}: this model is served at the universal level (no MoESpec); the pre-router needs a spec'd family")
    return Path(prerouter).expanduser()


def _native_k(config: dict) -> int:
    """Experts per token of a universal-level family (its slot sets must hold one route)."""
    c = {**config, **config.get("text_config", {})}
    return int(c.get("num_experts_per_tok") or c.get("moe_top_k") or c.get("top_k") or 1)


class Engine:
    """A loaded model. generate / stream_generate / chat; see docs/engine-api.md."""

    def __init__(self, root: Path, model, tokenizer, store, streaming, spec, k, compute_dtype):
        self.root = Path(root)
        self.model_id = self.root.name
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.streaming = streaming
        self.executor_stats = streaming.stats
        self.spec, self.k, self.compute_dtype = spec, k, compute_dtype
        self.resident_bytes = bnn.resident_bytes(model)
        self._cache = None
        self._cache_tokens: list[int] = []
        self._cache_dirty = False  # set while the KV cache may be ahead of _cache_tokens
        # Stages each decode step's experts: the pre-router's cross-token stager or a test oracle.
        # Hooks (all optional but before_step): after_forward(engine, step, outputs) once a
        # step's graph is built, step_done(step), before_step(engine, step) at the boundary,
        # finish(engine) when a generation ends.
        self.stager = None
        self.prerouting = None  # set by attach_prerouter
        self.heads_path = None
        self.lora_path = None  # set by attach_lora
        self.lora_note = ""  # why the store's adapter is not served, if it is not
        self._recall: dict[int, list[int]] = {}

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise Edge0Error("prompt is empty; pass some text or token ids")
        return tokens

    def chat_prompt(self, messages, tools=None) -> list[int]:
        """Token ids of `messages` rendered with the tokenizer's chat template."""
        kwargs = {"tools": tools} if tools else {}
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs))

    def chat(self, messages, tools=None, **kwargs) -> GenerationResult:
        return self.generate(self.chat_prompt(messages, tools), **kwargs)

    def logits(self, prompt):
        """Float32 logits of every prompt position [T, V] (no cache; for checks and evaluation)."""
        return bnn.full_logits(self.model, self.encode(prompt))

    # -- generation ----------------------------------------------------------------------------
    def reset_cache(self) -> None:
        self._cache, self._cache_tokens = None, []

    def _prepare_cache(self, tokens: list[int], reuse: bool) -> int:
        """Make a cache holding a prefix of `tokens`; returns that prefix's length."""
        if reuse and self._cache is not None and not self._cache_dirty:
            common = 0
            for a, b in zip(self._cache_tokens, tokens[:-1]):
                if a != b:
                    break
                common += 1
            drop = len(self._cache_tokens) - common
            if drop == 0:
                return common
            if common > 0 and all(c.is_trimmable() for c in self._cache):
                for c in self._cache:
                    c.trim(drop)
                self._cache_tokens = self._cache_tokens[:common]
                return common
        self._cache = bnn.make_prompt_cache(self.model)
        self._cache_tokens = []
        return 0

    def stream_generate(self, prompt, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                        seed: int | None = None, stop=None, reuse_cache: bool = False, ignore_eos: bool = False):
        """Yield one Step per generated token; the last Step carries finish_reason and stats."""
        tokens = self.encode(prompt)
        if max_tokens < 1:
            raise Edge0Error(f"max_tokens must be >= 1 (got {max_tokens})")
        if seed is not None:
            B.seed(seed)
        sampler = bnn.make_sampler(temp=temperature, top_p=top_p)
        eos = set(self.tokenizer.eos_token_ids) if not ignore_eos else set()
        before = self.executor_stats.totals()
        B.reset_peak_memory()
        t0 = time.perf_counter()

        stager = self.stager
        try:
            yield from self._generate(tokens, max_tokens, sampler, eos, stop, reuse_cache, stager, before, t0)
        finally:
            if stager is not None and hasattr(stager, "finish"):
                stager.finish(self)

    def _step(self, tokens: list[int], step: int, sampler, stager) -> int:
        """One forward of `tokens` (the prompt's last token or a generated one) and a sample."""
        if stager is not None and step > 0:
            stager.before_step(self, step)
        logprobs = bnn.forward(self.model, tokens, self._cache)
        if stager is not None and hasattr(stager, "after_forward"):
            stager.after_forward(self, step, logprobs)
        y = bnn.sample(sampler, logprobs)
        if stager is not None and hasattr(stager, "step_done"):
            stager.step_done(step)
        self.streaming.end_step()
        self._collect_recall()
        return y

    def _generate(self, tokens, max_tokens, sampler, eos, stop, reuse_cache, stager, before, t0):
        if self.prerouting is not None:
            self.prerouting.reset()
        cached = self._prepare_cache(tokens, reuse_cache)
        new = tokens[cached:]
        self._cache_dirty = True
        bnn.prefill(self.model, new[:-1], self._cache)
        y = self._step(new[-1:], 0, sampler, stager)
        self._cache_tokens = list(tokens)
        self._cache_dirty = False
        t_prefill = time.perf_counter() - t0

        detok = self.tokenizer.detokenizer
        detok.reset()
        stopper = StopMatcher(stop or [])
        generated: list[int] = []
        t1 = time.perf_counter()
        finish = None
        while True:
            generated.append(y)
            if y in eos:
                finish = "stop"
                detok.finalize()
                text = stopper.flush(detok.last_segment)
            else:
                detok.add_token(y)
                text, hit = stopper.feed(detok.last_segment)
                if hit:
                    finish = "stop"
                elif len(generated) >= max_tokens:
                    finish = "length"
                    detok.finalize()
                    text += stopper.flush(detok.last_segment)
            if finish:
                stats = self._call_stats(len(tokens), len(new), len(generated), t_prefill, time.perf_counter() - t1, before)
                yield Step(y, text, finish, stats)
                return
            yield Step(y, text)
            self._cache_dirty = True
            y = self._step([y], len(generated), sampler, stager)
            self._cache_tokens.append(generated[-1])
            self._cache_dirty = False

    def generate(self, prompt, max_tokens: int = 256, **kwargs) -> GenerationResult:
        """Run to completion; returns text, generated token ids, finish_reason and stats."""
        parts, tokens, last = [], [], None
        for last in self.stream_generate(prompt, max_tokens, **kwargs):
            parts.append(last.text)
            tokens.append(last.token)
        return GenerationResult("".join(parts), tokens, last.finish_reason, last.stats)

    def _collect_recall(self) -> None:
        """Diagnostic mode: read the device-side counts of predicted experts the gate agreed with."""
        pr = self.prerouting
        if pr is None or not pr.overlaps:
            return
        for layer, hits in pr.overlaps.items():
            r = self._recall.setdefault(layer, [0, 0])
            r[0] += sum(int(h.item()) for h in hits)
            r[1] += len(hits) * pr.k
        pr.overlaps = {}

    def prerouted_logits(self, prompt):
        """Float32 logits [T, V] of every position in one forward pass, with each pre-routed layer
        using at position t the route its head predicted at t-1 (position 0 uses the gate) --
        the same routes as `decode_logits`, computed in parallel. Without a pre-router this is
        `logits`."""
        pr = self.prerouting
        if pr is None:
            return self.logits(prompt)
        pr.reset()
        pr.parallel = True
        try:
            return bnn.full_logits(self.model, self.encode(prompt))
        finally:
            pr.parallel = False
            pr.reset()

    def decode_logits(self, prompt):
        """Float32 log-probs [T, V] of every position, computed token by token through the KV
        cache, as decoding does: with a pre-router, each step's routes are the predictions made at
        the previous token (teacher forcing). `logits` instead runs all positions at once with
        gate routing."""
        tokens = self.encode(prompt)
        kept = []

        def keep(logprobs):
            kept.append(logprobs)
            return B.argmax(logprobs, axis=-1)

        self._cache, self._cache_tokens = bnn.make_prompt_cache(self.model), []
        if self.prerouting is not None:
            self.prerouting.reset()
        try:
            for i, t in enumerate(tokens):
                self._step([t], i, keep, self.stager)
        finally:
            if self.stager is not None and hasattr(self.stager, "finish"):
                self.stager.finish(self)
            self.reset_cache()
        out = B.to_numpy(B.concatenate(kept, axis=0).astype(B.float32))
        return out.reshape(len(tokens), -1)

    def observe_routes(self, fn) -> None:
        """Call fn(layer, indices [T, K] int array, scores [T, E] float32) for every forward pass
        of every spec'd MoE layer (None stops). Each call syncs to the host: for traces only."""
        if self.spec is None:
            raise Edge0Error(f"{self.model_id}: route tracing needs a spec'd family (this one is served at the universal level)")
        for layer, block in bnn.moe_blocks(self.model):
            object.__setattr__(block, "observer", None if fn is None else (lambda i, s, layer=layer: fn(layer, i, s)))

    # -- stats ---------------------------------------------------------------------------------
    def _call_stats(self, n_prompt, n_prefill, n_gen, t_prefill, t_decode, before) -> dict:
        after = self.executor_stats.totals()
        return {
            "prompt_tokens": n_prompt,
            "prefill_tokens": n_prefill,
            "generation_tokens": n_gen,
            "prefill_tps": n_prefill / t_prefill if t_prefill > 0 else 0.0,
            "decode_tps": (n_gen - 1) / t_decode if n_gen > 1 and t_decode > 0 else 0.0,
            "peak_memory_bytes": B.peak_memory(),
            "peak_rss_bytes": B.peak_rss(),
            "expert_bytes_read": after["bytes_read"] - before["bytes_read"],
            "expert_hit_rate": _rate(after["hits"] - before["hits"], after["misses"] - before["misses"]),
            "host_syncs": after["host_syncs"] - before["host_syncs"],
            "stall_ms_per_step": (after["stall_ms"] - before["stall_ms"]) / max(1, n_gen),
            "fallbacks": after["fallbacks"] - before["fallbacks"],
            "dropped_experts": after["dropped"] - before["dropped"],
            "substitutions": after["substitutions"] - before["substitutions"],
        }

    def stats(self) -> dict:
        """Cumulative engine statistics, with a per-layer breakdown."""
        st = self.streaming
        totals = st.stats.totals()
        return {
            "model": self.model_id,
            "compute_dtype": self.compute_dtype,
            "serving_top_k": self.k,
            "resident_bytes": self.resident_bytes,
            "expert_cache_bytes": st.budget,
            "slots_per_layer": st.n_slots,
            "cache_policy": st.options.cache_policy,
            "substitute_alpha": st.options.substitute_alpha,
            "prefill_executor": st.options.prefill_executor,
            "decode_executor": st.options.decode_executor,
            "decode_steps": st.stats.decode_steps,
            "stall_ms_per_step": totals["stall_ms"] / max(1, st.stats.decode_steps),
            "totals": totals,
            "layers": {n: s.as_dict() for n, s in sorted(st.stats.layers.items())},
            "peak_rss_bytes": B.peak_rss(),
            "prerouter": self._prerouter_stats(),
        }

    def _prerouter_stats(self):
        pr = self.prerouting
        if pr is None:
            return None
        return {
            "heads": str(self.heads_path),
            "diagnostics": pr.diagnostics,
            "routed_by_head": dict(pr.routed_by_head),
            "routed_by_gate": dict(pr.routed_by_gate),
            "recall": {l: h / n for l, (h, n) in sorted(self._recall.items()) if n} if pr.diagnostics else None,
        }

    def describe(self) -> str:
        """One line about the loaded model and how its experts are streamed."""
        lora = f", LoRA {Path(self.lora_path).name}" if self.lora_path else (f"; {self.lora_note}" if self.lora_note else "")
        return f"{self.model_id}: {self.compute_dtype}, resident {format_size(self.resident_bytes)}, {self.streaming.describe()}{lora}"

    def close(self) -> None:
        self.streaming.close()
        self.store.close()


def _rate(hits: int, misses: int):
    return hits / (hits + misses) if hits + misses else None
