"""One generation at a time: a FIFO queue in front of a single engine thread.

The engine is synchronous (a Python generator) and owns one KV cache, so every engine call runs
on one dedicated thread, in arrival order. Each job's events are handed to the event loop
through an asyncio queue. Cancelling a job (client gone) makes the thread stop iterating the
engine generator, which frees the engine for the next job.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Generator

_END = object()


class QueueFull(Exception):
    """The bounded queue has no room for another request."""


class Job:
    """A submitted generation; iterate `events()` on the event loop, `cancel()` to abandon it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.cancelled = threading.Event()
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def cancel(self) -> None:
        self.cancelled.set()

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

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-engine")
        self._lock = threading.Lock()
        self._jobs: set[Job] = set()  # waiting + running
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}

    @property
    def admitted(self) -> int:
        """Requests waiting or running."""
        return len(self._jobs)

    def submit(self, produce: Callable[[threading.Event], Generator]) -> Job:
        """Queue `produce(cancelled)`, a generator of events run on the engine thread.

        Raises QueueFull when `max_queue` requests are already waiting.
        """
        job = Job(asyncio.get_running_loop())
        with self._lock:
            if len(self._jobs) > self.max_queue:
                self.counters["rejected"] += 1
                raise QueueFull(f"{self.max_queue} requests are already waiting (--max-queue)")
            self._jobs.add(job)
        self._executor.submit(self._run, job, produce)
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

    def shutdown(self) -> None:
        """Cancel every job so the engine thread ends promptly when the server stops."""
        with self._lock:
            for job in self._jobs:
                job.cancel()
        self._executor.shutdown(wait=False)
