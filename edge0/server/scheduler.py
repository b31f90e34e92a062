"""One generation at a time: a FIFO queue in front of a single engine thread.

The engine is synchronous (a Python generator) and owns one KV cache, so every engine call runs
on one dedicated thread, in arrival order. Work that must not overlap a generation (saving the
KV cache, resizing the expert cache) runs on that thread too, between jobs (`between`,
`run_between`). Each job's events are handed to the event loop
through an asyncio queue. Cancelling a job (client gone) makes the thread stop iterating the
engine generator, and the engine checks for it between prefill chunks, which frees the engine
for the next job.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import AsyncIterator, Callable, Generator

from edge0.server.errors import APIError
from edge0.server.generation import generation_events

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


class Scheduler:
    """Runs jobs one at a time, FIFO; at most `max_queue` wait behind the running one."""

    slots = 1  # generations running at once (a BatchScheduler's --max-batch)

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, set when it starts
        self.stopping = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-engine")
        self._lock = threading.Lock()
        self._jobs: set[Job] = set()  # waiting + running
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.between: list[Callable[[], None]] = []  # run on the engine thread after every job
        self.between_errors = 0
        self._soon: set[Callable[[], None]] = set()  # run_between calls queued, not yet run

    @property
    def admitted(self) -> int:
        """Requests waiting or running."""
        return len(self._jobs)

    def generate(self, engine, run) -> Job:
        """Queue the generation `run` (generation.Run) on `engine`; its events come from the Job."""
        return self.submit(partial(generation_events, engine, run))

    def submit(self, produce: Callable[[threading.Event], Generator]) -> Job:
        """Queue `produce(cancelled)`, a generator of events run on the engine thread.

        Raises APIError 429 when `max_queue` requests are already waiting, 503 once stopping.
        """
        job = self._admit()
        self._executor.submit(self._run, job, produce)
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

    def _run(self, job: Job, produce: Callable[[threading.Event], Generator]) -> None:
        outcome = "cancelled"
        try:
            if not job.cancelled.is_set():  # skip jobs whose client left while queued
                events = produce(job.cancelled)
                try:
                    for event in events:
                        if job.cancelled.is_set():
                            break
                        job._put(event)
                finally:
                    events.close()  # stops the engine generator mid-generation
                outcome = "cancelled" if job.cancelled.is_set() else "completed"
        except Exception as e:  # reported to the waiting request; the thread keeps serving
            outcome = "failed"
            job._put(e)
        finally:
            job._put(_END)
            with self._lock:
                self._jobs.discard(job)
                self.counters[outcome] += 1
        for fn in self.between:  # after _END: the response is complete
            self._call(fn)

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
        """Cancel every job so the engine thread ends promptly when the server stops."""
        with self._lock:
            for job in self._jobs:
                job.cancel()
        self._executor.shutdown(wait=False)
