"""Speculative decoding on streamed experts: a drafter proposes k tokens, one multi-token decode
step (the verify forward: k + 1 tokens through every layer, each MoE layer reading the union of
their experts once) checks them, and the KV cache is taken back to the last kept token.

Greedy output is the plain greedy output (the argmax of each position is compared with the draft);
with sampling, the standard accept/reject rule keeps the model's distribution
(edge0.backend.speculative), for a lone sequence and for each row of a batch alike (`accept`). A
seeded request's sampled drafts and verify draws come from its own random stream
(RequestSampler.key), taken in the same order alone and as a batch's row. An adaptive switch
turns drafting off while the measured acceptance and the measured cost of a verify make it slower
than plain steps, and back on when they no longer do (docs/speculative.md)."""

from __future__ import annotations

import time

from edge0.backend import kvcache as bkv
from edge0.backend import speculative as bsp
from edge0.engine.drafters import DEFAULT_NUM_DRAFT, Draft, Drafter
from edge0.errors import Edge0Error

DECAY = 0.9  # weight of the past in the running acceptance and cost estimates, per observation
SWITCH_ON = 1.05  # speculation resumes when it is estimated this much faster than plain steps
PROBE_EVERY = 16  # while off, an expensive drafter drafts (to measure acceptance) every this many tokens
# Before any verify was timed, a verify of T tokens is assumed to cost 1 + PRIOR_SLOPE * (T - 1)
# plain steps (between a GPU's ~0.1 and this CPU's ~0.75); while off, one verify is tried every
# EXPLORE_EVERY plain steps until one was timed, so a wrong prior costs at most one verify.
PRIOR_SLOPE = 0.5
EXPLORE_EVERY = 64
# While off with a verify timed, one is timed again when the estimated gain is at least RETIME_GAIN
# (one slow verify, e.g. on a cold cache, must not keep speculation off for the engine's life),
# after EXPLORE_EVERY plain steps, then twice as many each time it stays off, up to RETIME_MAX.
RETIME_GAIN = 0.75
RETIME_MAX = 1024
COUNTERS = (
    "verifies",
    "verify_tokens",
    "drafted",
    "accepted",
    "yielded",
    "plain_steps",
    "replays",
    "switched_off",
    "switched_on",
    "shadow_drafted",
    "shadow_accepted",
    "unsupported_requests",
)


class Estimates:
    """Running estimates the switch decides from: the per-token acceptance (the chance that a draft
    token is kept given the ones before it were), the time of a plain step, and the time of a
    verify cycle (drafting, the forward, the rule, the rewind) by its token count."""

    def __init__(self):
        self.hits = self.trials = 0.0
        self.plain: float | None = None
        self.cycle: dict[int, float] = {}
        self.cycle_n: dict[int, int] = {}

    def observe_acceptance(self, accepted: int, drafted: int) -> None:
        """`accepted` of `drafted` tokens were kept; a rejection (if any) ended the run."""
        self.hits = DECAY * self.hits + accepted
        self.trials = DECAY * self.trials + accepted + (accepted < drafted)

    def observe_plain(self, seconds: float) -> None:
        self.plain = seconds if self.plain is None else DECAY * self.plain + (1 - DECAY) * seconds

    def observe_cycle(self, tokens: int, seconds: float) -> None:
        # the plain mean of the first observations, then decayed: a second timing counts as much as the first
        n = self.cycle_n[tokens] = self.cycle_n.get(tokens, 0) + 1
        w = max(1 / n, 1 - DECAY)
        self.cycle[tokens] = (1 - w) * self.cycle.get(tokens, 0.0) + w * seconds

    @property
    def acceptance(self) -> float | None:
        return self.hits / self.trials if self.trials else None

    def cycle_cost(self, tokens: int) -> float | None:
        """The time of a verify of `tokens` tokens: measured, or on the line through a plain step
        and the nearest measured verify (through the prior slope before any was)."""
        if tokens in self.cycle:
            return self.cycle[tokens]
        if self.plain is None:
            return None
        if not self.cycle:
            return self.plain * (1 + PRIOR_SLOPE * (tokens - 1))
        near = min(self.cycle, key=lambda t: abs(t - tokens))
        return self.plain + (tokens - 1) * (self.cycle[near] - self.plain) / max(1, near - 1)

    def gain(self, k: int) -> float | None:
        """Estimated speed of verifying k drafts against plain steps (tokens per second ratio)."""
        a, c = self.acceptance, self.cycle_cost(k + 1)
        if a is None or c is None or self.plain is None:
            return None
        return sum(a**i for i in range(k + 1)) * self.plain / c

    def cost_ratio(self, tokens: int) -> float | None:
        c = self.cycle_cost(tokens)
        return c / self.plain if c is not None and self.plain else None


class Speculator:
    """An engine's speculative decoding: its drafter, k, the switch and the statistics."""

    def __init__(self, drafter: Drafter, num_draft: int = DEFAULT_NUM_DRAFT, adaptive: bool = True):
        self.drafter, self.k, self.adaptive = drafter, num_draft, adaptive
        self.estimates = Estimates()
        # adaptive: start off, measuring acceptance with shadow drafts, and switch on once the
        # estimates say a verify pays; the estimates carry over to the next generations
        self.on = not adaptive
        self.off_steps = 0  # plain steps while off since the last verify
        self.retime_every = EXPLORE_EVERY
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.seconds = {"draft": 0.0, "verify": 0.0, "plain": 0.0}
        self._exploring = False  # a batch's verify planned while off (plan_step)

    def for_batches(self) -> Speculator:
        """The speculator a batch's rows draft through (batch.py): the same drafter and k, with its
        own switch and estimates, as a batch's verify and plain steps cost what its rows cost."""
        return Speculator(self.drafter, self.k, self.adaptive)

    def describe(self) -> str:
        switch = "adaptive" if self.adaptive else "always on"
        return f"speculative decoding: {self.drafter.describe()}, {self.k} draft tokens, {switch}"

    # -- the decode loop -----------------------------------------------------------------------
    def decode(self, stepper, cache, prompt, generated, sampler, max_tokens, eos=frozenset()):
        """The tokens after `generated` (its last token not yet fed), a step's at a time (a verify's
        accepted drafts and one more, or a plain step's token), through the engine's `stepper`
        (step.py) and the sequence's `cache`; at each yield the cache holds exactly the tokens fed.
        `sampler`: a plain RequestSampler (temperature and top-p only); `eos`: the end-of-sequence
        ids, where drafts are cut."""
        temp, top_p = sampler.temperature, sampler.top_p
        self.drafter.start(prompt)
        shadow = None  # (tokens, matched so far): a draft made while off, checked against the plain tokens
        since_probe = PROBE_EVERY
        while True:
            k = min(self.k, max_tokens - len(generated) - 1)
            context = prompt + generated
            explore = not self.on and self.should_explore()
            if k > 0 and (self.on or not self.adaptive or explore):
                t0 = time.perf_counter()
                draft = self.drafter.draft(context, k, temp, top_p, sampler.key()).until(eos)
                self.seconds["draft"] += time.perf_counter() - t0
                if draft.tokens:
                    out = self._verify(stepper, cache, generated, draft, sampler)
                    self.estimates.observe_cycle(len(draft.tokens) + 1, time.perf_counter() - t0)
                    self.seconds["verify"] += time.perf_counter() - t0
                    self.off_steps, shadow = 0, None  # a pending shadow draft no longer lines up
                    self.decide(self.k)
                    if explore:
                        self.explored()
                    yield out
                    continue
            if k > 0 and not self.on and shadow is None and (self.drafter.cheap or since_probe >= PROBE_EVERY):
                tokens, since_probe = self.drafter.draft(context, k, temp, top_p, sampler.key()).until(eos).tokens, 0
                self.counts["shadow_drafted"] += len(tokens)
                shadow = (tokens, 0) if tokens else None
            t0 = time.perf_counter()
            y = stepper.decode([generated[-1]], len(generated), sampler, cache)
            dt = time.perf_counter() - t0
            self.estimates.observe_plain(dt)
            self.seconds["plain"] += dt
            self.counts["plain_steps"] += 1
            since_probe += 1
            self.off_steps += not self.on
            if shadow:
                shadow = self._check_shadow(shadow, y)
            if k > 0:
                self.decide(self.k)
            yield [y]

    def _check_shadow(self, shadow: tuple, y: int) -> tuple | None:
        """One plain token `y` against the pending shadow draft (tokens, how many matched so far):
        the draft still pending, or None once it is settled (a mismatch, or all of it matched)."""
        tokens, run = shadow
        if y == tokens[run]:
            self.counts["shadow_accepted"] += 1
            run += 1
            if run < len(tokens):
                return tokens, run
            self.estimates.observe_acceptance(run, run)
        else:
            self.estimates.observe_acceptance(run, run + 1)
        return None

    def _verify(self, stepper, cache, generated, draft, sampler) -> list[int]:
        """One verify step of `generated[-1]` + the draft: the tokens it yields (the accepted draft
        tokens and one more)."""
        k = len(draft.tokens)
        inputs = [generated[-1]] + draft.tokens
        n, nxt, replayed = stepper.verify(
            len(generated), inputs, lambda logprobs: accept(sampler, draft, logprobs), cache
        )
        self.counts["replays"] += replayed
        c = self.counts
        c["verifies"] += 1
        c["verify_tokens"] += len(inputs)
        c["drafted"] += k
        c["accepted"] += n
        c["yielded"] += n + 1
        self.estimates.observe_acceptance(n, k)
        return draft.tokens[:n] + [nxt]

    # -- a batch's steps (batch.py) -------------------------------------------------------------
    def plan_step(self) -> bool:
        """Whether a batch's next step verifies drafts: the switch is on, or a verify is timed
        while it is off (should_explore); a plain step while off is counted."""
        self._exploring = not self.on and self.should_explore()
        if not (self.on or self._exploring):
            self.off_steps += 1
        return self.on or self._exploring

    def draft(self, drafter: Drafter, context: list[int], k: int, eos, sampler) -> Draft:
        """A batch row's draft of at most `k` tokens after `context`, cut at `eos`, at its plain
        `sampler`'s temperature and top-p (drawn from its own stream when seeded, as `decode`
        draws); timed."""
        t0 = time.perf_counter()
        draft = drafter.draft(context, k, sampler.temperature, sampler.top_p, sampler.key()).until(eos)
        self.seconds["draft"] += time.perf_counter() - t0
        return draft

    def observe_batch(self, drafts: list[Draft] | None, out: list[list[int]], seconds: float) -> None:
        """A batch's step took `seconds`: plain (`drafts` None) or a verify of each row's draft
        (empty for a row that did not draft), row i keeping `out[i]`; the estimates, the counts
        and the switch."""
        c = self.counts
        if drafts is None:
            self.estimates.observe_plain(seconds)
            self.seconds["plain"] += seconds
            c["plain_steps"] += 1
        else:
            if self._exploring:
                self.explored()
            width = 1 + max(len(d.tokens) for d in drafts)
            self.estimates.observe_cycle(width, seconds)
            self.seconds["verify"] += seconds
            c["verifies"] += 1
            c["verify_tokens"] += width * len(drafts)
            for d, ys in zip(drafts, out):
                if d.tokens:
                    self.estimates.observe_acceptance(len(ys) - 1, len(d.tokens))
                    c["drafted"] += len(d.tokens)
                    c["accepted"] += len(ys) - 1
                    c["yielded"] += len(ys)
        self.decide(self.k)

    def should_explore(self) -> bool:
        """While off: time a verify now? Once when none was timed yet, and again while the estimated
        gain is within reach of paying (a stale slow timing would otherwise decide forever)."""
        if not self.estimates.cycle:
            return self.off_steps >= EXPLORE_EVERY
        gain = self.estimates.gain(self.k)
        return self.off_steps >= self.retime_every and gain is not None and gain >= RETIME_GAIN

    def explored(self) -> None:
        """A verify was timed while off; if the switch stayed off, wait twice as long before the next."""
        if not self.on:
            self.retime_every = min(2 * self.retime_every, RETIME_MAX)

    def decide(self, k: int) -> None:
        """The adaptive switch: off when verifying k drafts (the configured k: the few last tokens
        of a generation draft fewer, but must not set the state the next one starts with) is
        estimated slower than plain steps, on again when it is estimated SWITCH_ON times faster."""
        if not self.adaptive:
            return
        gain = self.estimates.gain(k)
        if gain is None:
            return
        on = gain >= 1.0 if self.on else gain >= SWITCH_ON
        if on != self.on:
            self.counts["switched_on" if on else "switched_off"] += 1
            self.on = on
            self.retime_every = EXPLORE_EVERY

    # -- statistics ----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {**self.counts, **{f"{k}_s": v for k, v in self.seconds.items()}}

    def call_stats(self, before: dict, totals_before: dict, totals_after: dict, n_gen: int, bytes_read: int) -> dict:
        """One generation's speculation statistics (docs/engine-api.md, "Stats keys"); `bytes_read`:
        expert bytes its decode steps read (the prefill's excluded)."""
        now = self.snapshot()
        d = {k: now[k] - before[k] for k in now}
        routes = totals_after["multi_routes"] - totals_before["multi_routes"]
        union = totals_after["multi_union"] - totals_before["multi_union"]
        est = self.estimates
        return {
            "drafter": self.drafter.name,
            "num_draft": self.k,
            "on": self.on,
            "verifies": d["verifies"],
            "plain_steps": d["plain_steps"],
            "drafted": d["drafted"],
            "accepted": d["accepted"],
            "acceptance": d["accepted"] / d["drafted"] if d["drafted"] else None,
            "tokens_per_verify": d["yielded"] / d["verifies"] if d["verifies"] else None,
            "verify_tokens": d["verify_tokens"],
            "union_per_routed": union / routes if routes else None,
            "expert_bytes_per_token": bytes_read / n_gen if n_gen else None,
            "verify_cost_ratio": est.cost_ratio(self.k + 1) if est.cycle else None,
            "estimated_acceptance": est.acceptance,
            "estimated_gain": est.gain(self.k),
            "switched_off": d["switched_off"],
            "switched_on": d["switched_on"],
            "replays": d["replays"],
            "unsupported_requests": d["unsupported_requests"],
            "draft_ms": 1000 * d["draft_s"],
            "shadow_drafted": d["shadow_drafted"],
            "shadow_accepted": d["shadow_accepted"],
        }

    def stats(self) -> dict:
        """Cumulative statistics (merged into Engine.stats())."""
        est = self.estimates
        return {
            "speculation": {
                "describe": self.describe(),
                "on": self.on,
                **self.counts,
                "acceptance": self.counts["accepted"] / self.counts["drafted"] if self.counts["drafted"] else None,
                "estimated_acceptance": est.acceptance,
                "plain_step_ms": 1000 * est.plain if est.plain else None,
                "verify_ms": {t: 1000 * c for t, c in sorted(est.cycle.items())},
                "estimated_gain": est.gain(self.k),
            }
        }


def accept(sampler, draft: Draft, logprobs) -> tuple[int, int]:
    """The verify's rule, for one sequence and for each row of a batch: how many tokens of `draft`
    (k) a step keeps, and the token after them, from the target's log-probs [k + 1, V] (a batch
    row's may run longer: padding, not read), at the request's plain `sampler`'s temperature and
    top-p. Greedy: the draft while each token is the argmax, then the argmax (the plain greedy
    tokens, exactly); sampled: the accept/reject rule, which keeps the target's distribution
    (backend/speculative.py; `draft.probs` [k, V] the drafter's, None for a deterministic one),
    drawn from the sampler's own stream when it is seeded. Returns (n, next token)."""
    tokens, logprobs = draft.tokens, logprobs[: len(draft.tokens) + 1]
    if sampler.temperature == 0:
        best = bsp.greedy_tokens(logprobs)
        n = next((i for i in range(len(tokens)) if best[i] != tokens[i]), len(tokens))
        return n, best[n]
    p = bsp.sampling_probs(logprobs, sampler.temperature, sampler.top_p)
    return bsp.accept_reject(p, tokens, draft.probs, sampler.key())


def check_speculation(engine) -> None:
    """Speculative decoding needs a KV cache that can be taken back, on every rank."""
    if engine.pipeline is not None:
        problem = engine.pipeline.traits["rewind_problem"]
        if problem is None and engine.prerouting is not None and engine.pipeline.traits["replays"]:
            # a replay runs inside the verify's step on rank 0, but reaches the others as a prompt
            # span after theirs ended: the heads' routes would not be one process's
            raise Edge0Error(
                f"--draft: {engine.model_id} across ranks: with pre-router heads, rejected drafts fed again "
                "(recurrent or sliding-window layers) would route differently on the other ranks; use --draft "
                "none or --no-prerouter"
            )
    else:
        problem = bkv.rewind_problem(engine.kv.make())
    if problem:
        raise Edge0Error(
            f"--draft: {engine.model_id}: {problem}, so rejected drafts cannot be dropped; use --draft none"
        )
