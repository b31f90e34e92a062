"""The server's one scheduler: requests decode together on the engine thread, joining the engine's
running batch (edge0/engine/batch.py) between steps and leaving when they end or their client
goes; up to `slots` at once (--max-batch; 1 where the engine cannot batch), more wait in the
queue, up to `max_queue`.

The engine owns its KV caches and is synchronous, so every engine call runs on one dedicated
thread. A coordinator runs there while any request is in flight (`_coordinate`): it joins
arrivals to the batch, drops cancelled ones, and calls `advance()`, which prefills one span of a
joining request and runs one decode step of the rest, so a long prompt does not hold up the
others; a lone request is a batch of one. Each Step becomes the request's events (Events). A
request whose own work fails (its prefill, its sampler, its events) ends alone; a failure of the
shared step ends every request with one error that names none of them. Work that must not
overlap a generation (saving the last conversation's KV cache, the memory watcher) runs on that
thread each time the batch is empty (`between`, `run_between`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from edge0.engine.api import EngineAPI
from edge0.engine.request import Request
from edge0.errors import PeerLost
from edge0.server.errors import APIError
from edge0.server.generation import Events, Run

_END = object()
log = logging.getLogger("edge0.server")


class Job:
    """A submitted generation; iterate `events()` on the event loop, `cancel()` to abandon it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.cancelled = threading.Event()
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def cancel(self) -> None:
        self.cancelled.set()

    def abort(self, error: APIError) -> None:
        """Cancel, and make `events()` raise `error` after what was already produced (event loop only)."""
        self.cancel()
        self._queue.put_nowait(error)

    def _put(self, item) -> None:  # called from the engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel()

    async def events(self) -> AsyncIterator:
        """Yield the job's events; re-raises an exception raised by the job."""
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item


class BatchFailed(RuntimeError):
    """The shared step of a batch failed; what each of its requests is told."""


@dataclass
class _Request:
    job: Job
    run: Run
    events: Events
    seq: object = None  # its engine Sequence, once joined


class Scheduler:
    """Runs up to `slots` generations together (module docstring); at most `max_queue` wait."""

    def __init__(self, max_queue: int, slots: int = 1):
        self.max_queue = max_queue
        self.slots = slots
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, set when it starts
        self.stopping = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-engine")
        self._lock = threading.Lock()
        self._jobs: set[Job] = set()  # waiting + running
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.between: list[Callable[[], None]] = []  # run on the engine thread after every job
        self.between_errors = 0
        self._soon: set[Callable[[], None]] = set()  # run_between calls queued, not yet run
        self._arrivals: deque[_Request] = deque()
        self._coordinating = False
        self._batch = None  # the engine's Batch while one runs
        # an error after which the engine cannot serve (a lost rank): the server stops with it
        self.fatal: PeerLost | None = None
        self.on_fatal: Callable[[], None] = lambda: None  # set by the server: stop serving
        self._done = {
            "batches": 0,
            "steps": 0,
            "row_steps": 0,
            "spans": 0,
            "spans_dropped": 0,
            "most_rows": 0,
            "failed_batches": 0,
        }

    @property
    def admitted(self) -> int:
        """Requests waiting or running."""
        return len(self._jobs)

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

    def generate(self, engine: EngineAPI, run: Run) -> Job:
        """Queue the generation `run` on `engine`; its events come from the Job.

        Raises APIError 429 when `max_queue` requests are already waiting, 503 once stopping."""
        job = self._admit()
        request = _Request(job, run, Events(engine, run))
        with self._lock:
            self._arrivals.append(request)
            start, self._coordinating = not self._coordinating, True
        if start:
            self._executor.submit(self._coordinate, engine)
        return job

    def _admit(self) -> Job:
        """A Job for a new request, if the queue has room (APIError 429 or 503 if not)."""
        if self.stopping:
            raise APIError(503, "The server is shutting down", code="server_shutting_down")
        job = Job(asyncio.get_running_loop())
        with self._lock:
            if len(self._jobs) >= self.max_queue + self.slots:
                self.counters["rejected"] += 1
                raise APIError(
                    429,
                    f"Server busy: {self.max_queue} requests are already waiting (--max-queue); retry later",
                    code="queue_full",
                )
            self._jobs.add(job)
        return job

    # -- the engine thread -------------------------------------------------------------------------
    def _coordinate(self, engine: EngineAPI) -> None:
        """Batches until no request is left; each time one is empty, the between-request work."""
        more = True
        while more:
            more = self._run_batch(engine)
            if self.fatal is not None:
                self.on_fatal()
                return
            for fn in self.between:
                self._call(fn)

    def _run_batch(self, engine: EngineAPI) -> bool:
        """One batch, from its first request until it is empty; returns whether requests wait."""
        live: list[_Request] = []
        closing: list[_Request] = []  # finished with the batch's last step: answered once it has ended
        try:
            with engine.batching() as batch:
                self._batch = batch
                self._done["batches"] += 1
                # a long span alone gives way to a request that can join, or to its client leaving
                batch.interrupt = lambda: (
                    (bool(self._arrivals) and len(batch) < self.slots) or any(r.job.cancelled.is_set() for r in live)
                )
                while True:
                    self._admit_arrivals(batch, live)
                    for r in [r for r in live if r.job.cancelled.is_set()]:
                        batch.leave(r.seq)
                        self._end(r, live, "cancelled")
                    if not batch.busy:
                        break
                    by_seq = {id(r.seq): r for r in live}
                    done = []
                    for seq, step in batch.advance():
                        r = by_seq[id(seq)]
                        if self._deliver(batch, r, step, live):
                            done.append(r)
                    if not batch.busy:  # empty: the batch ends (every rank's books settle), then the between work
                        closing = done
                        break
                    for r in done:
                        self._end(r, live, "completed")
        except Exception as e:  # the batch's cache is lost: every request in it or waiting for it fails
            self._done["failed_batches"] += 1
            if isinstance(e, PeerLost):  # said once, by the command, as the server exits with it
                self.fatal = e
            else:
                log.exception("batch failed")
            with self._lock:
                waiting = list(self._arrivals)
                self._arrivals.clear()
            # one error for all, naming none of them: the cause may be another client's request
            error = BatchFailed("the batch this request was decoding in failed (the server log has the cause); retry")
            if self.fatal is not None:
                error = APIError(503, "The server is stopping: the model lost one of its ranks", code="server_stopping")
            for r in live + waiting:
                r.job._put(error)
                self._end(r, live, "failed")
        finally:
            if self._batch is not None:
                self._count(self._batch)
                self._batch = None
            for r in closing:  # after the batch's end, so /v1/stats read on the answer includes it
                self._end(r, live, "completed")
        with self._lock:
            if self._arrivals:
                return True
            self._coordinating = False
            return False

    def _admit_arrivals(self, batch, live: list[_Request]) -> None:
        """Join arrivals while the batch has room."""
        while True:
            with self._lock:
                if not self._arrivals or len(batch) >= self.slots:
                    return
                r = self._arrivals.popleft()
            if r.job.cancelled.is_set():  # its client left while it waited
                self._end(r, live, "cancelled")
                continue
            try:
                r.seq = batch.join(engine_request(r.run))
            except Exception as e:  # this request's settings; the batch goes on
                r.job._put(e)
                self._end(r, live, "failed")
                continue
            live.append(r)

    def _deliver(self, batch, r: _Request, step, live: list[_Request]) -> bool:
        """A Step of `r` becomes its events; True when it was `r`'s last (the caller ends it). Its
        own failure (a Step that is an exception: its prefill or sampler raised; or its events: a
        parser) ends it alone."""
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
            return False
        return bool(step.finish_reason)

    def _end(self, r: _Request, live: list[_Request], outcome: str) -> None:
        r.job._put(_END)
        if r in live:
            live.remove(r)
        with self._lock:
            self._jobs.discard(r.job)
            self.counters[outcome] += 1

    def _count(self, batch) -> None:
        c, s = batch.counts, self._done
        for k in ("steps", "row_steps", "spans", "spans_dropped"):
            s[k] += c[k]
        s["most_rows"] = max(s["most_rows"], c["most_rows"])

    def run_between(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread once the jobs queued now are done (at once when idle);
        a call of the same `fn` already queued is not repeated."""
        with self._lock:
            if fn in self._soon or self.stopping:
                return
            self._soon.add(fn)

        def run():
            with self._lock:
                self._soon.discard(fn)
            self._call(fn)

        try:
            self._executor.submit(run)
        except RuntimeError:  # shut down: the server is stopping
            self._soon.discard(fn)

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # logged and counted (/v1/stats); the thread keeps serving
            self.between_errors += 1
            log.exception("between requests: %s failed", getattr(fn, "__qualname__", fn))

    def stop(self) -> None:
        """The server is stopping (event loop only): refuse new jobs, and end every running or
        queued one with a 503 error, which open streams send as their last event."""
        self.stopping = True
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.abort(
                APIError(503, "The server is shutting down; this generation was cancelled", code="server_shutting_down")
            )

    def stop_soon(self) -> None:
        """`stop()` from a signal handler: it may interrupt the loop's thread anywhere, even
        inside this scheduler's lock, so the work is handed to the loop."""
        self.stopping = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.stop)

    async def last(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the engine thread after every job queued now (the server is stopping);
        a failure is logged and counted, as between requests."""
        try:
            await asyncio.wrap_future(self._executor.submit(self._call, fn))
        except RuntimeError:  # the executor is already shut down
            pass

    def shutdown(self) -> None:
        """Cancel every job so the engine thread ends promptly when the server stops, and wait
        for it: a thread that ran compiled MLX code frees its thread-local compile cache as it
        exits, which takes the GIL; left to exit during the interpreter's own exit, it aborted the
        process ("terminate called without an active exception")."""
        with self._lock:
            for job in self._jobs:
                job.cancel()
        self._executor.shutdown(wait=True)


def engine_request(run: Run) -> Request:
    """The engine's Request for `run`: its prompt, limit, sampling (its own seeded stream,
    processors and log-probs) and stop strings, reusing the prompt caches of its namespace."""
    p = run.params
    return Request(
        run.prompt,
        p.max_tokens,
        p.temperature,
        p.top_p,
        p.top_k,
        p.seed,
        p.stop or None,
        run.processors,
        p.logprobs,
        reuse=True,
        namespace=run.namespace,
        vision=run.vision,
    )
