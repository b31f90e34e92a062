"""Bounds on the work a request costs before the queue admits it: a count of the characters the
chat template can render (checked before anything is rendered), and a bound on tokenizations
running and waiting at once (rendering and tokenizing a prompt near the body limit costs
hundreds of MB; unbounded, 64 such requests at once took 600 MiB)."""

from __future__ import annotations

import asyncio

from starlette.concurrency import run_in_threadpool

from edge0.backend.core import trim_heap
from edge0.server.errors import APIError

# A tokenization of at least this many characters gives its memory back to the OS when it ends
# and no other one runs (glibc otherwise keeps the freed pages of a large render in its heap).
TRIM_AFTER_CHARS = 1 << 16


def rendered_chars(value) -> int:
    """The characters a chat template renders for a JSON-like value: every string, dict keys included
    (tools are rendered as JSON, their parameter names too; a message's own keys stand for the
    markup the template puts around each message, which is longer), every number as written, and
    one separator per item, so that a million empty strings cannot pass as nothing. Iterative: a
    request may nest its lists as deep as the JSON parser allows."""
    total, todo = 0, [value]
    while todo:
        node = todo.pop()
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, dict):
            total += sum(len(str(k)) + 1 for k in node)
            todo.extend(node.values())
        elif isinstance(node, (list, tuple)):
            total += len(node)
            todo.extend(node)
        elif node is not None:
            total += len(str(node))
    return total


class Tokenizing:
    """At most `concurrency` prompts rendered and tokenized at once, at most `waiting` more waiting
    for their turn (--max-queue: the same bound as the generation queue); beyond that a request
    is refused with 429 before any of its work is done."""

    def __init__(self, concurrency: int, waiting: int):
        self.concurrency, self.waiting = concurrency, waiting
        self._slots = asyncio.Semaphore(concurrency)
        self.queued = self.running = self.peak = 0
        self.refused = 0

    async def run(self, fn, *args, chars: int = 0):
        """`fn(*args)` in a worker thread once a slot is free; `chars`: the size of the prompt, so
        that a large one gives its memory back when it ends."""
        if self._slots.locked() and self.queued >= self.waiting:
            self.refused += 1
            raise APIError(
                429,
                f"{self.concurrency} prompts are being tokenized and {self.queued} wait; try again shortly "
                "(--max-queue)",
                code="queue_full",
            )
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            return await run_in_threadpool(fn, *args)
        finally:
            self.running -= 1
            self._slots.release()
            if chars >= TRIM_AFTER_CHARS and not self.running:
                await run_in_threadpool(trim_heap)

    def stats(self) -> dict:
        return {
            "tokenizing": self.running,
            "tokenizing_peak": self.peak,
            "tokenize_waiting": self.queued,
            "tokenize_refused": self.refused,
        }
