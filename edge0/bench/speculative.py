"""The speculative-decoding bench: a controlled drafter (it drafts the true greedy continuation,
each token right with probability p, so acceptance is set, not hoped for), the measured cost of a
T-token verify forward against a 1-token step, and one engine's curve over p and k against plain
staged decoding (scripts/bench_speculative.py runs it; docs/speculative.md reads it)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from edge0.backend import forward as bfw
from edge0.backend import speculative as bsp
from edge0.engine.drafters import Draft, Drafter
from edge0.engine.speculative import Speculator


class ControlledDrafter(Drafter):
    """Drafts `reference` (the plain greedy tokens of the prompt being generated from): each
    drafted token is the true one with probability `p`, else another token."""

    def __init__(self, reference: list[int], p: float, seed: int = 0, vocab: int = 2**15):
        self.reference, self.p, self.vocab = reference, p, vocab
        self.rng = np.random.default_rng(seed)
        self.name = f"controlled p={p}"
        self.n0 = 0

    def start(self, prompt: list[int]) -> None:
        self.n0 = len(prompt)

    def draft(self, context, k, temp=0.0, top_p=1.0, key=None) -> Draft:
        i = len(context) - self.n0
        true = self.reference[i : i + k]
        return Draft([t if self.rng.random() < self.p else (t + 1) % self.vocab for t in true])


def staged_engine(model, cache_share: str | None = None, io: str | None = None):
    """The bench's engine: staged decode, exact prefill, no pre-router or adapter, on `model` (a
    bench-model directory with store/, or a store); with `cache_share` (e.g. "20%") an expert cache
    of that share of all experts, with `io` that reading strategy."""
    import edge0

    store = Path(model) / "store" if (Path(model) / "store").is_dir() else Path(model)
    opts = dict(prerouter=False, lora=False, decode_executor="staged", prefill_executor="exact")
    if cache_share is not None:
        probe = edge0.load(store, prerouter=False, lora=False, decode_executor="exact")
        total = probe.streaming.total_expert_bytes
        probe.close()
        opts["expert_cache"] = int(total * float(cache_share.rstrip("%")) / 100)
    if io is not None:
        opts["io"] = io
    return edge0.load(store, **opts)


def forward_cost(
    engine, prompt: list[int], reference: list[int], tokens: int, repeats: int, warmup: int = 0, before_steps=None
) -> float:
    """Median seconds of one decode step of `tokens` tokens after `prompt`, as the engine runs it
    (the forward through the decode executors, the greedy token of every position, the step's
    end): a plain step for 1 token, the verify's work for more. The steps walk the true
    continuation `reference` `tokens` at a time, as verifies whose drafts are all kept do, so
    their routes and expert-cache hits are a real continuation's (random tokens route apart). The
    first `warmup` steps are run and not timed; `before_steps()` is called after the prompt's
    prefill (the concurrency bench switches its synthetic routes there)."""
    repeats = min(repeats, len(reference) // tokens - warmup)
    if repeats < 1:
        raise ValueError(
            f"forward_cost: a reference of {len(reference)} tokens has no timed step of {tokens} after {warmup}"
        )
    cache = engine.kv.make()
    engine.hooks.start()  # synthetic routes start over: step i routes as a generation's step i
    bfw.prefill(engine.model, prompt, cache)
    if before_steps is not None:
        before_steps()
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        engine.stepper.run(
            i,
            tokens,
            lambda i=i: bfw.forward_all(engine.model, reference[i * tokens : (i + 1) * tokens], cache),
            lambda logprobs: (bsp.greedy_tokens(logprobs), tokens - 1 if tokens > 1 else None),  # all kept
        )
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    engine.hooks.finish()
    return statistics.median(times)


def controlled(engine, reference, p: float, k: int, adaptive: bool, seed: int = 0) -> Speculator:
    """A speculator with the controlled drafter for `engine`."""
    return Speculator(ControlledDrafter(reference, p, seed, len(engine.tokenizer.get_vocab())), k, adaptive)


def run_setting(engine, prompt, n, reference, speculator=None) -> dict:
    """One generation of `n` tokens: plain, or with `speculator`; its numbers."""
    engine.use_speculation(speculator)
    res = engine.generate(prompt, max_tokens=n, ignore_eos=True)
    engine.use_speculation(None)
    s = res.stats
    out = {
        "decode_tps": s["decode_tps"],
        "expert_bytes_per_token": (s["expert_bytes_read"] - s["prefill_expert_bytes_read"]) / len(res.tokens),
        "hit_rate": s["expert_hit_rate"],
        "identical": res.tokens == reference[:n],
    }
    sp = s.get("speculation")
    if sp:
        out.update(
            {
                key: sp[key]
                for key in (
                    "verifies",
                    "plain_steps",
                    "acceptance",
                    "tokens_per_verify",
                    "union_per_routed",
                    "switched_off",
                    "switched_on",
                    "on",
                )
            }
        )
    return out
