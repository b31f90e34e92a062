"""The engine's one generation loop: sequences decoded together, joining between steps and
leaving when they end. A lone request is a batch of one (`Engine.stream_generate`, the CLI, the
bench); the server's continuous batching and `Engine.generate_batch` join several.

A sequence that joins an empty batch is the lone sequence (solo.py): in the cache it checked out
of the prompt caches, prefilled whole and stepped as one plain sequence (speculative steps
included), so a batch of one costs what one generation costs. When a second one joins, the
batch goes on as below.

A sequence that joins is prefilled alone into its own KV cache (a conversation's cached prefix
first, from the prompt caches), one span per `advance`, so the running sequences keep decoding
between its spans; the waiting sequence with the fewest prompt tokens left goes first, so a short
request starts within about one span of a long one's prefill. Its cache then joins mlx-lm's
batched cache as a new row (left padding, masked, each row at its own positions), and every step
feeds one token of each row through one forward: each MoE layer reads the union of the batch's
experts once (counted as `multi_union` against `multi_routes`). A sequence that ends leaves the
batch (its cache goes back to the prompt caches when it asked for reuse); the others go on.
Each step tells the step hooks which row every row was at the step before (`StepHooks.rows`):
a pre-router's predictions are by row, and a row that joined since has none.

    # B rows, V vocabulary
    step: tokens [B] -> forward [B, 1] -> log-probs [B, V] -> one sample per row (its own sampler)
"""

from __future__ import annotations

import time

from edge0.backend import core as B
from edge0.backend import kvcache as bkv
from edge0.engine.drafters import Draft
from edge0.engine.parts import Parts
from edge0.engine.reply import Reply, Step
from edge0.engine.request import Request
from edge0.engine.sampler import RequestSampler
from edge0.engine.sequence import Sequence
from edge0.engine.solo import Solo
from edge0.engine.speculative import accept
from edge0.engine.stats import sequence_stats
from edge0.engine.step import sample_row
from edge0.errors import Edge0Error, PeerLost

# Tokens one step feeds while other sequences run or wait (vLLM's per-step token budget): each
# row's decode token first, then prefill spans of the waiting sequences, fewest tokens left first;
# so a request waits at most one step's budget (mlx-lm's server prefills in chunks of this size).
STEP_TOKENS = 2048


class _OwnFailure(Exception):
    """A waiting sequence's own prefill span failed (`error`): only that sequence ends."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def batch_problem(parts: Parts) -> str | None:
    """Why an engine of these `parts` cannot decode a batch (None if it can)."""
    problem = bkv.batch_problem(parts.kv.make())
    return f"{parts.model_id}: {problem}" if problem else None


class Batch:
    """The running batch of an engine (Engine.batching): `join` sequences, `advance` (a prefill
    span and a decode step) until each one's last Step, `leave` to drop one early."""

    def __init__(self, parts: Parts):
        self.parts = parts
        self.solo = Solo(parts)
        self.lone: Sequence | None = None  # the lone sequence (solo.py), while there is one
        # why sequences cannot share a step here (None: they can); a lone one always runs
        self.merge_problem = batch_problem(parts)
        self.waiting: list[Sequence] = []  # prefilling, each in its own cache
        self.rows: list[Sequence] = []  # row i of the merged cache is rows[i]
        self.last_rows: list[Sequence] = []  # the rows of the last step (a pre-router's predictions are by row)
        self.inputs: list[int] = []  # each row's next token to feed
        self.cache = None
        self.steps = 0
        self.counts = {
            "joined": 0,
            "left": 0,
            "spans": 0,
            "steps": 0,
            "row_steps": 0,
            "most_rows": 0,
            "most_kv_bytes": 0,
            "spans_dropped": 0,
            "failed": 0,
        }
        self.interrupt = None  # () -> bool: a request waits to join (the server's arrivals)
        # rows draft (and a step verifies them) when the engine speculates and each row's cache
        # can drop its rejected drafts on its own; not under a pre-router, whose verify routes
        # one sequence's tokens
        spec = parts.batch_speculation
        rows_draft = (
            parts.prerouting is None
            and bkv.rows_can_drop_tails(parts.kv.make())
            and (parts.pipeline is None or parts.pipeline.traits["drop_tails"])  # on every rank
        )
        self.spec = spec if spec is not None and rows_draft else None
        self.stepping = False  # an advance is in flight (an exception out of it leaves caches half fed)

    def close(self) -> None:
        """The batch is over: a lone sequence still in it leaves as `leave` has it (unless an
        advance broke off, when its cache may be half fed), what is left of it goes, and the
        prompt caches' memory bound is back."""
        if self.lone is not None:
            if self.stepping:
                self.lone.cache = None
            self.leave(self.lone)
        self.waiting, self.rows, self.last_rows, self.inputs, self.cache = [], [], [], [], None
        self.parts.kv.lend(0)
        self.parts.streaming.seeding = True  # no row decodes now

    def _fit_pool(self) -> None:
        """The memory budget counts one sequence's KV at the context: what the batch holds beyond
        that (its rows with their padding, and the waiting sequences' own caches) comes out of the
        prompt caches' pool while it runs (what the pool pushes out waits for the disk tier, as at
        any eviction)."""
        kv = self.parts.kv
        held = sum(bkv.prompt_cache_nbytes(c) for c in [self.cache] + [s.cache for s in self.waiting] if c)
        kv.lend(max(0, held - kv.context_bytes))
        self.counts["most_kv_bytes"] = max(self.counts["most_kv_bytes"], held)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.rows)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.rows)

    def join(self, request: Request) -> Sequence:
        """Queue `request` (checked here; prefilled by the next `advance` calls); returns its
        Sequence. The first to join an empty batch is the lone sequence; a request that asked for
        reuse starts from the prompt caches of its namespace and gives its cache back there."""
        request.check()
        e = self.parts
        eos = set() if request.ignore_eos else set(e.tokenizer.eos_token_ids)
        r = request
        sampler = RequestSampler(r.temperature, r.top_p, r.top_k, r.processors, r.logprobs, seed=r.seed)
        seq = Sequence(request, sampler, Reply(e.tokenizer, e.control_ids, eos, r.stop, r.max_tokens))
        if not self:
            seq.lone, self.lone = True, seq
            B.reset_peak_memory()
            self.solo.prepare(seq)
        else:
            if self.merge_problem:
                raise Edge0Error(f"batching: {self.merge_problem}")
            if self.lone is not None:
                self._end_lone()
            self._own_cache(seq)
        spec = e.speculation
        seq.before = (e.streaming.stats.totals(), e.store.io_stats(), spec.snapshot() if spec else None)
        self.waiting.append(seq)
        self.counts["joined"] += 1
        self._fit_pool()
        return seq

    def _own_cache(self, seq: Sequence) -> None:
        """`seq`'s own cache (the prompt caches' longest prefix of it, with reuse) and its drafter."""
        seq.cache, seq.held, seq.receipt = self.parts.kv.checkout(seq.key(seq.prompt), seq.namespace, seq.reuse)
        seq.fed = seq.held
        self.parts.prefiller.place(seq.cache, seq.request.vision)
        self._draft_for(seq)

    def _draft_for(self, seq: Sequence) -> None:
        """`seq`'s own drafter, when the batch's rows speculate and its sampler is plain (greedy,
        or temperature and top-p: what a verify samples exactly, as for the lone sequence). A
        seeded row's drafts and verify draws come from its own stream in the lone sequence's order
        (a plain first step, then draft and verify), so it gets the tokens it gets alone under the
        same switch decisions (speculative.py)."""
        e = self.parts
        if self.spec is not None and seq.sampler.plain:
            seq.drafter = self.spec.drafter.fork()
            seq.drafter.start(seq.prompt)
        elif e.batch_speculation is not None:  # processors, top-k or log-probs, or caches rows cannot cut
            e.batch_speculation.counts["unsupported_requests"] += 1

    def _end_lone(self) -> None:
        """A second sequence joins: the lone one goes on as any other (its cache a row of the
        batch's, once it decodes)."""
        seq, self.lone = self.lone, None
        seq.lone = False
        if seq.first is not None:  # never stepped: as a row it feeds the prompt's last token again
            if not bkv.trim_to(seq.cache, len(seq.prompt) - 1):
                raise RuntimeError("a lone sequence that fed its whole prompt joined a batch before its first step")
            seq.first, seq.fed = None, len(seq.prompt) - 1
        if seq in self.waiting:
            if not seq.prepared:
                self._own_cache(seq)
                return
        else:
            if seq.lane is not None:
                seq.lane.close()
                seq.lane = None
            self.cache, seq.cache = bkv.join_rows(None, seq.cache), None
            self.last_rows = []  # its steps were not a batch's rows
        self._draft_for(seq)

    def leave(self, seq: Sequence) -> None:
        """Drop `seq` (its client is gone) wherever it is. With reuse, what it fed goes back to the
        prompt caches, so a retry of the request resumes there (as a single generation's does)."""
        if seq.lone:
            self.lone = None
            if seq.lane is not None:
                seq.lane.close()
            if seq in self.waiting:
                self.waiting.remove(seq)
            else:
                self.rows, self.inputs = [], []
            fed = Solo.fed(seq)
            if seq.reuse and seq.cache is not None and fed:
                self.parts.kv.checkin(seq.key(fed), seq.cache, len(seq.prompt) if seq.made else 0, seq.namespace)
            seq.cache = None
        elif seq in self.waiting:
            self.waiting.remove(seq)
            if seq.reuse and seq.fed:
                self.parts.kv.checkin(seq.key(seq.prompt[: seq.fed]), seq.cache, 0, seq.namespace)
            seq.cache = None
        elif seq in self.rows:
            self._drop_rows([self.rows.index(seq)])
        self.counts["left"] += 1
        self._fit_pool()

    def advance(self, prefill: bool = True) -> list[tuple[Sequence, Step | Exception]]:
        """One step: its token budget (STEP_TOKENS) spent on one decode token of every row and
        prefill spans of the waiting sequences, the one with the fewest prompt tokens left first
        (each joins the rows once its prompt but the last token is in; once one has, only
        prompts that complete within the budget follow, so its first token does not wait). Returns the Steps made,
        each with its sequence; a sequence's last Step has its finish_reason and stats.

        A sequence alone in the batch has the step to itself: its whole span (each span reads the
        experts again), and `interrupt()`, if set, is checked between its layers: when it says a
        request is waiting to join, the span is dropped (the cache cut back to the spans before
        it) and the step ends, so the newcomer joins at once and the rest goes in budgeted spans.

        A sequence whose own work fails (its prefill span, its sampler) ends alone: its pair holds
        the exception instead of a Step, its cache is dropped, and the others go on."""
        self.stepping = True
        made = self._advance(prefill)
        self.stepping = False
        return made

    def _advance(self, prefill: bool) -> list[tuple[Sequence, Step | Exception]]:
        failed, ready = [], False
        budget = max(1, STEP_TOKENS - len(self.rows))
        for seq in sorted(self.waiting, key=lambda s: len(s.prompt) - s.fed) if prefill else ():
            # a row made ready in this step gets its first token now, not after a span that
            # does not complete the next prompt
            if budget <= 0 or (ready and len(seq.prompt) - 1 - seq.fed > budget):
                break
            try:
                budget -= self._prefill_lone(seq) if seq.lone else self._prefill_span(seq, budget)
                ready = ready or seq in self.rows
            except _OwnFailure as own:  # in its own cache: this sequence ends, the rows go on
                if seq.receipt is not None:
                    self.parts.kv.failed(own.error, seq.receipt)
                self._fail_waiting(seq)
                failed.append((seq, own.error))
        return failed + (self._step() if self.rows else [])

    def _fail_waiting(self, seq: Sequence) -> None:
        if seq.lone:
            self.lone = None
        self.waiting.remove(seq)
        seq.cache, seq.finish = None, "error"
        self.counts["failed"] += 1
        self._fit_pool()

    def prefill_all(self) -> None:
        """Every waiting sequence prefilled and joined (whole spans, no decode step in between)."""
        while self.waiting:
            seq = self.waiting[0]
            if seq.lone:
                self._prefill_lone(seq)
            else:
                self._prefill_span(seq, None)

    def _prefill_lone(self, seq: Sequence) -> int:
        """The lone sequence's prompt, whole unless `interrupt()` says a request waits to join;
        returns the tokens fed."""
        p = self.parts.prefiller
        spans, fed = p.spans + p.chunked_spans, seq.fed
        self.parts.streaming.seeding = not self.rows
        try:
            done = self.solo.prefill(seq, self.interrupt)
        except PeerLost:  # the model lost a rank: not this sequence's failure
            raise
        except Exception as error:  # noqa: BLE001 - the forward of its own cache: its failure alone
            raise _OwnFailure(error) from error
        self.counts["spans"] += p.spans + p.chunked_spans - spans
        if done:
            self._ready(seq)
        else:  # a newcomer is waiting (or its client left): what went into every layer stays
            self.counts["spans_dropped"] += 1
        return seq.fed - fed

    # -- inside ----------------------------------------------------------------------------------
    def _prefill_span(self, seq: Sequence, budget: int | None) -> int:
        """One span of `seq`'s prompt into its own cache, at most `budget` tokens while others run
        or wait (None: its whole span); returns the tokens fed."""
        e = self.parts
        todo = seq.prompt[seq.fed : -1]
        fed = 0
        # its experts take the decode slots only if no row decodes from them (Streaming.seeding)
        e.streaming.seeding = not self.rows
        if todo:
            n = min(len(todo), e.prefiller.span_for(seq.cache))
            stop = None
            if budget is not None and n > budget:
                if len(self) > 1 or not bkv.can_trim_prompt_cache(seq.cache):
                    n = budget  # others wait at most one step's budget; or a span could not be dropped
                else:
                    stop = self.interrupt  # alone: its whole span, unless a request arrives
            try:
                fed = e.prefiller(todo[:n], seq.cache, stop, image=(seq.request.vision, seq.fed))
            except PeerLost:  # the model lost a rank: not this sequence's failure
                raise
            except Exception as error:  # noqa: BLE001 - the forward of its own cache: its failure alone
                raise _OwnFailure(error) from error
            if fed < n:  # a newcomer is waiting: the span's first layers go back to where it began
                bkv.trim_to(seq.cache, seq.fed + fed)
                self.counts["spans_dropped"] += 1
            else:
                self.counts["spans"] += 1
            seq.fed += fed
            seq.receipt = None  # a forward on its restored cache went through
        if seq.fed < len(seq.prompt) - 1:
            self._fit_pool()
            return fed
        self.cache = bkv.join_rows(self.cache, seq.cache)
        seq.cache = None  # a row of the batch's cache now
        self._ready(seq)
        return fed

    def _ready(self, seq: Sequence) -> None:
        """`seq`'s prompt but its last token is in: it decodes from the next step."""
        seq.prefilled = self.parts.streaming.stats.totals()
        self.waiting.remove(seq)
        self.rows.append(seq)
        self.inputs.append(seq.prompt[-1])
        self.counts["most_rows"] = max(self.counts["most_rows"], len(self.rows))

    def _step(self) -> list[tuple[Sequence, Step | Exception]]:
        e = self.parts
        rows = self.rows
        if rows[0].lone:
            return self._lone_step(rows[0])
        drafts = self._drafts()
        at = {id(s): i for i, s in enumerate(self.last_rows)}
        previous = [at.get(id(s)) for s in rows]
        self.last_rows = list(rows)
        t0 = time.perf_counter()
        if drafts is None:
            samplers = [s.sampler for s in rows]
            ending = [i for i, s in enumerate(rows) if len(s.tokens) + 1 >= s.reply.max_tokens]
            out = [[y] for y in e.stepper.decode_batch(self.inputs, self.steps, samplers, self.cache, previous, ending)]
        else:
            out = self._verify(drafts, previous)
        if self.spec is not None:
            self.spec.observe_batch(drafts, out, time.perf_counter() - t0)
        self._count_step(len(rows))
        made, done, failed = [], [], []
        prompt_copies = e.kv.needs_prompt_copy(self.cache)
        for i, (seq, ys) in enumerate(zip(rows, out)):
            if isinstance(ys[-1], Exception):  # its sampler raised (step.sample_row)
                seq.finish = "error"
                made.append((seq, ys[-1]))
                failed.append(i)
                continue
            if self._add_tokens(seq, ys, made):
                done.append(i)
            elif prompt_copies and seq.reuse and len(seq.tokens) == len(ys):  # the step fed its prompt's last token
                e.kv.keep_prompt(seq.key(seq.prompt), bkv.extract_row(self.cache, i), seq.namespace)
            self.inputs[i] = ys[-1]
        if done or failed:
            self._drop_rows(done, failed)
        else:
            self._fit_pool()
        return made

    def _lone_step(self, seq: Sequence) -> list[tuple[Sequence, Step | Exception]]:
        """A step of the lone row in its own cache (solo.py): one token, or a verify's. When it
        ends, with reuse, its cache goes back to the prompt caches holding its prompt and reply
        but the last token, as a row's does."""
        if seq.lane is None:
            seq.lane = self.solo.steps(seq)
        try:
            ys = next(seq.lane)
        except PeerLost:
            raise
        except Exception as error:  # noqa: BLE001 - its own step, the only one: it ends with the error
            seq.cache, seq.finish = None, "error"  # the step may have fed part of it
            self.lone, self.rows, self.inputs = None, [], []
            self.counts["failed"] += 1
            return [(seq, error)]
        self._count_step(1)
        made: list = []
        if self._add_tokens(seq, ys, made):
            seq.lane.close()
            self.lone, self.rows, self.inputs = None, [], []
            if seq.reuse:
                fed = seq.prompt + seq.tokens[:-1]
                if not bkv.trim_to(seq.cache, len(fed)):  # recurrent state holds what its steps fed
                    fed = Solo.fed(seq)
                self.parts.kv.checkin(seq.key(fed), seq.cache, len(seq.prompt), seq.namespace)
            seq.cache = None
        else:
            self.inputs[0] = ys[-1]  # what a step of the batch feeds, if others join
        return made

    def _count_step(self, rows: int) -> None:
        self.steps += 1
        self.counts["steps"] += 1
        self.counts["row_steps"] += rows

    def _add_tokens(self, seq: Sequence, ys: list[int], made: list) -> bool:
        """`seq`'s tokens of a step become its Steps (into `made`); True when it ended with one."""
        for y in ys:
            step = seq.reply.add(y)
            seq.sampler.annotate_step(step)
            if seq.first_token_s is None:
                seq.first_token_s = time.perf_counter() - seq.joined
            made.append((seq, step))
            if step.finish_reason:
                seq.finish = step.finish_reason
                step.stats = sequence_stats(self.parts.streaming, self.parts.store, self.parts.speculation, seq)
                return True
        return False

    # -- speculation ---------------------------------------------------------------------------
    def _drafts(self) -> list[Draft] | None:
        """Each row's draft for this step (empty for a row that does not draft), or None for a
        plain step: no row drafts, or the speculator's switch says so (engine/speculative.py). A
        row drafts from its second step on, as the lone sequence does: its first step feeds its
        prompt's last token alone."""
        spec = self.spec
        if spec is None or not any(s.drafter for s in self.rows) or not spec.plan_step():
            return None
        drafts = []
        for seq in self.rows:
            k = min(spec.k, seq.reply.max_tokens - len(seq.tokens) - 1)
            if seq.drafter and seq.tokens and k > 0:
                drafts.append(spec.draft(seq.drafter, seq.prompt + seq.tokens, k, seq.reply.eos, seq.sampler))
            else:
                drafts.append(Draft([]))
        return drafts if any(d.tokens for d in drafts) else None

    def _verify(self, drafts: list[Draft], previous: list) -> list[list[int]]:
        """One step feeding each row its last token and its draft (rows without one: the last
        token alone); each row keeps what the verify rule accepts (speculative.accept, the lone
        sequence's: greedy, or sampled at its temperature and top-p) and one more token (its own
        sampler's, for a row that did not draft). Returns each row's tokens."""
        rows = self.rows

        def decide(logprobs):
            out, kept = [], []
            for i, (seq, draft) in enumerate(zip(rows, drafts)):
                if not draft.tokens:
                    out.append([sample_row(seq.sampler, logprobs[i, 0])])
                    kept.append(1)
                    continue
                n, nxt = accept(seq.sampler, draft, logprobs[i])
                out.append(draft.tokens[:n] + [nxt])
                kept.append(n + 1)
            return out, kept

        inputs = [[y] + d.tokens for y, d in zip(self.inputs, drafts)]
        return self.parts.stepper.verify_batch(inputs, self.steps, decide, self.cache, previous)

    def _drop_rows(self, done: list[int], failed: list[int] = ()) -> None:
        """Rows `done` leave; a row that asked for reuse gives its cache (its prompt and reply but
        the last token, which was never fed) back to the prompt caches. Rows `failed` leave
        with their caches dropped."""
        self.counts["failed"] += len(failed)
        for i in done:
            seq = self.rows[i]
            if seq.reuse:
                fed = seq.prompt + seq.tokens[:-1]
                row = bkv.extract_row(self.cache, i)
                bkv.trim_to(row, len(fed))  # a verify fed drafts past a stop its tokens ended on
                self.parts.kv.checkin(seq.key(fed), row, len(seq.prompt), seq.namespace)
        stay = [i for i in range(len(self.rows)) if i not in done and i not in failed]
        self.rows = [self.rows[i] for i in stay]
        self.inputs = [self.inputs[i] for i in stay]
        if stay:
            bkv.filter_cache(self.cache, stay)
        else:
            self.cache = None
        self._fit_pool()
