"""Continuous batching: requests decode together on the engine thread, joining the running batch
between steps and leaving when they end or their client goes (up to --max-batch at once; more
wait in the queue, up to --max-queue).

One coordinator runs on the engine thread while any request is in flight (`_coordinate`): it
joins arrivals to the engine's Batch (edge0/engine/batch.py), drops cancelled ones, and calls
`advance()`, which prefills one span of a joining request (the one with the fewest prompt tokens
left) and runs one decode step of the rest, so a long prompt does not hold up the others and a
short request starts within about one span. Each Step becomes the request's events (Events, as a
single generation's). A request whose own work fails (its prefill, its sampler, its events) ends
alone; a failure of the shared step ends every request with one error that names none of them.
Between-request work (saving the last conversation's KV cache, the memory watcher) runs once the
batch is empty, as it does after a single generation.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from edge0.engine.sampler import RequestSampler
from edge0.sampling import check_sampling
from edge0.server.generation import Events, Run
from edge0.server.scheduler import _END, Job, Scheduler

log = logging.getLogger("edge0.server")


class BatchFailed(RuntimeError):
    """The shared step of a batch failed; what each of its requests is told."""


@dataclass
class _Request:
    job: Job
    run: Run
    events: Events
    seq: object = None  # its engine Sequence, once joined


class BatchScheduler(Scheduler):
    """Runs up to `max_batch` generations together (module docstring); the rest of the Scheduler
    (queue bound, between-request work, shutdown) is unchanged."""

    def __init__(self, max_queue: int, max_batch: int):
        super().__init__(max_queue)
        self.slots = max_batch
        self._arrivals: deque[_Request] = deque()
        self._coordinating = False
        self._batch = None  # the engine's Batch while one runs
        self._done = {
            "batches": 0,
            "steps": 0,
            "row_steps": 0,
            "spans": 0,
            "spans_dropped": 0,
            "most_rows": 0,
            "failed_batches": 0,
        }

    def stats(self) -> dict:
        """Batches run, decode steps, rows fed (row_steps / steps: the mean batch), prefill spans
        interleaved with them (and spans dropped for a newcomer) and the most rows at once, the
        running batch included."""
        out = dict(self._done, max_batch=self.slots)
        if (batch := self._batch) is not None:
            c = batch.counts
            out.update({k: out[k] + c[k] for k in ("steps", "row_steps", "spans", "spans_dropped")})
            out["most_rows"] = max(out["most_rows"], c["most_rows"])
        out["mean_rows"] = out["row_steps"] / out["steps"] if out["steps"] else None
        return out

    def generate(self, engine, run: Run) -> Job:
        job = self._admit()
        request = _Request(job, run, Events(engine, run))
        with self._lock:
            self._arrivals.append(request)
            start, self._coordinating = not self._coordinating, True
        if start:
            self._executor.submit(self._coordinate, engine)
        return job

    # -- the engine thread -------------------------------------------------------------------------
    def _coordinate(self, engine) -> None:
        live: list[_Request] = []
        try:
            with engine.batching() as batch:
                self._batch = batch
                self._done["batches"] += 1
                # a long span alone gives way to a request that can join, or to its client leaving
                batch.interrupt = lambda: (
                    (bool(self._arrivals) and len(batch) < self.slots) or any(r.job.cancelled.is_set() for r in live)
                )
                while self._admit_arrivals(engine, batch, live):
                    for r in [r for r in live if r.job.cancelled.is_set()]:
                        batch.leave(r.seq)
                        self._end(r, live, "cancelled")
                    if not batch.busy:
                        continue
                    by_seq = {id(r.seq): r for r in live}
                    for seq, step in batch.advance():
                        self._deliver(batch, by_seq[id(seq)], step, live)
        except Exception:  # the batch's cache is lost: every request in it or waiting for it fails
            self._done["failed_batches"] += 1
            log.exception("batch failed")
            with self._lock:
                waiting, self._coordinating = list(self._arrivals), False
                self._arrivals.clear()
            # one error for all, naming none of them: the cause may be another client's request
            error = BatchFailed("the batch this request was decoding in failed (the server log has the cause); retry")
            for r in live + waiting:
                r.job._put(error)
                self._end(r, live, "failed")
        finally:
            if self._batch is not None:
                self._count(self._batch)
                self._batch = None
        for fn in self.between:  # the batch is empty: as after a single generation
            self._call(fn)

    def _admit_arrivals(self, engine, batch, live: list[_Request]) -> bool:
        """Join arrivals while the batch has room; False (and the coordinator ends) when nothing
        is left to do."""
        while True:
            with self._lock:
                if not self._arrivals or len(batch) >= self.slots:
                    if not self._arrivals and not batch.busy and not live:
                        self._coordinating = False
                        return False
                    return True
                r = self._arrivals.popleft()
            if r.job.cancelled.is_set():  # its client left while it waited
                self._end(r, live, "cancelled")
                continue
            try:
                r.seq = batch.join(*_join_args(engine, r.run), reuse=True, namespace=r.run.namespace)
            except Exception as e:  # this request's settings; the batch goes on
                r.job._put(e)
                self._end(r, live, "failed")
                continue
            live.append(r)

    def _deliver(self, batch, r: _Request, step, live: list[_Request]) -> None:
        """A Step of `r` becomes its events. Its own failure (a Step that is an exception: its
        prefill or sampler raised; or its events: a parser) ends it alone."""
        try:
            if isinstance(step, Exception):
                raise step
            for event in r.events.step(step):
                r.job._put(event)
        except Exception as e:  # noqa: BLE001 - this request's own: the batch goes on
            log.error("a request in the batch failed: %s: %s", type(e).__name__, e)
            if r.seq is not None and not r.seq.finish:
                batch.leave(r.seq)
            r.job._put(e)
            self._end(r, live, "failed")
            return
        if step.finish_reason:
            self._end(r, live, "completed")

    def _end(self, r: _Request, live: list[_Request], outcome: str) -> None:
        r.job._put(_END)
        if r in live:
            live.remove(r)
        with self._lock:
            self._jobs.discard(r.job)
            self.counters[outcome] += 1

    def _count(self, batch) -> None:
        c, s = batch.counts, self._done
        s["steps"] += c["steps"]
        s["row_steps"] += c["row_steps"]
        s["spans"] += c["spans"]
        s["spans_dropped"] += c["spans_dropped"]
        s["most_rows"] = max(s["most_rows"], c["most_rows"])


def _join_args(engine, run: Run) -> tuple:
    """Batch.join's arguments for `run`: its prompt, sampler (the request's own seeded stream,
    processors and log-probs), limit, end-of-sequence ids and stop strings."""
    p = run.params
    check_sampling(p.temperature, p.top_p, p.seed, top_k=p.top_k)
    sampler = RequestSampler(p.temperature, p.top_p, p.top_k, run.processors, p.logprobs, seed=p.seed)
    return run.prompt, sampler, p.max_tokens, set(engine.tokenizer.eos_token_ids), p.stop or None


DEFAULT_MAX_BATCH = 8  # the most requests decoded together when memory allows more


def default_max_batch(engine) -> tuple[int, str]:
    """(requests decoded together, why): one, plus as many as the prompt caches' memory holds
    contexts' KV caches (each one beyond the first takes that much from the pool while it runs,
    engine/batch.py), at most DEFAULT_MAX_BATCH."""
    kv = engine.kv
    pool, per_row = (kv.pool.max_bytes if kv.pool is not None else 0), kv.context_bytes
    if not per_row:
        return DEFAULT_MAX_BATCH, "no KV footprint known"
    n = max(1, min(DEFAULT_MAX_BATCH, 1 + pool // per_row))
    return n, f"the prompt caches' memory holds {n - 1} more contexts' KV (--prompt-cache-memory)"


def make_scheduler(engine, max_queue: int, max_batch: int | None) -> tuple[Scheduler, dict]:
    """The scheduler for `engine`: a BatchScheduler when it can decode requests together and the
    batch is over one, else one generation at a time; and what /v1/stats says of the choice."""
    why_not = engine.batch_problem() if hasattr(engine, "batch_problem") else "this engine decodes one at a time"
    if max_batch is None:
        max_batch, why = default_max_batch(engine) if why_not is None else (1, why_not)
    else:
        why = "--max-batch" if why_not is None or max_batch == 1 else why_not
        max_batch = max_batch if why_not is None else 1
    if max_batch > 1:
        return BatchScheduler(max_queue, max_batch), {"max_batch": max_batch, "why": why}
    return Scheduler(max_queue), {"max_batch": 1, "why": why}
