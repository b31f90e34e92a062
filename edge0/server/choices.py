"""`n > 1` on Chat Completions and Completions: several samples of one prompt.

Choice 0 is queued first; the others once its first event comes, that is once its prompt is
prefilled and kept in the prompt cache, so they reuse that prefix instead of prefilling it again
(the prompt caches' memory tier, engine/kv.py). With a
`seed`, choice i samples with seed + i: the same request gives the same choices. Streamed, each
chunk carries its choice's `index`; usage counts the prompt once and every choice's tokens."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from edge0.sampling import SEED_MAX
from edge0.server.chat_format import openai_usage
from edge0.server.errors import APIError
from edge0.server.generation import Finish, Usage
from edge0.server.metrics import observe
from edge0.server.pipeline import Prompt, generation_limit, generation_run, prompt_tokens

log = logging.getLogger("edge0.server")
_END = object()
_UNSTARTED = object()  # choice 0 ended before the others were queued


def merged_usage(finishes: list[Finish]) -> Usage:
    """The prompt once (as choice 0 saw it: what it reused of a cache), every choice's tokens."""
    first = finishes[0].usage
    return Usage(
        first.prompt_tokens,
        sum(f.usage.completion_tokens for f in finishes),
        first.cached_tokens,
        sum(f.usage.reasoning_tokens for f in finishes),
    )


class Choices:
    """The n jobs of one request, their events merged into one queue as (index, event)."""

    def __init__(self, request: Request, runs: list):
        self.state = request.app.state
        self.runs, self.jobs = runs, []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.admitted = time.monotonic()
        self._pumps: list[asyncio.Task] = []
        self._submit(0)  # an APIError here (queue full) is the request's answer

    def _submit(self, i: int) -> None:
        job = self.state.scheduler.generate(self.state.engine, self.runs[i])
        self.jobs.append(job)
        self._pumps.append(asyncio.ensure_future(self._pump(i, job)))

    async def _pump(self, i: int, job) -> None:
        try:
            async for event in observe(self.state.metrics, job.events(), self.admitted):
                if i == 0 and len(self.jobs) == 1:  # choice 0's prompt is in the cache now
                    for k in range(1, len(self.runs)):
                        self._submit(k)
                self.queue.put_nowait((i, event))
        except Exception as e:  # a job's failure, or a later choice refused (queue full)
            self.queue.put_nowait((i, e))
        if i == 0 and len(self.jobs) == 1:  # ended with no event (cancelled): the others never start
            self.queue.put_nowait((None, _UNSTARTED))
        self.queue.put_nowait((i, _END))

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()
        for task in self._pumps:
            task.cancel()

    async def events(self, keepalive_s: float | None = None):
        """(index, event) until every choice has ended; (None, None) after `keepalive_s` with none.
        Raises the first failure."""
        ended = 0
        while ended < len(self.runs):
            try:
                i, event = await asyncio.wait_for(self.queue.get(), keepalive_s)
            except asyncio.TimeoutError:
                yield None, None
                continue
            if event is _END:
                ended += 1
            elif event is _UNSTARTED:
                ended += len(self.runs) - 1
            elif isinstance(event, BaseException):
                raise event
            else:
                yield i, event


async def respond_choices(request: Request, fmt, prompt: Prompt, params, stream: bool, n: int):
    """As pipeline.respond, for `n` choices (module docstring)."""
    state = request.app.state
    tokens, vision = await prompt_tokens(request, prompt, record=True)
    params = params.with_max_tokens(generation_limit(state.config, params.max_tokens, len(tokens), prompt.param))
    runs = []
    for i in range(n):
        seed = None if params.seed is None else (params.seed + i) % (SEED_MAX + 1)
        runs.append(await generation_run(request, prompt, replace(params, seed=seed), tokens, vision))
    formats = [fmt.choice(i) for i in range(n)]
    choices = Choices(request, runs)
    if stream:
        # The background task also covers a client that leaves before the stream starts.
        return StreamingResponse(
            _stream(choices, formats, len(tokens), state.config.keepalive_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(choices.cancel),
        )
    return JSONResponse(await _collect(request, choices, formats))


async def _stream(choices: Choices, formats: list, prompt_tokens: int, keepalive_s: float):
    finishes: dict[int, Finish] = {}
    try:
        for f in formats:
            for event in f.stream_start(prompt_tokens):
                yield event
        async for i, event in choices.events(keepalive_s):
            if i is None:
                for chunk in formats[0].stream_keepalive():
                    yield chunk
            elif isinstance(event, Finish):
                finishes[i] = event
                for chunk in formats[i].stream_finish(event):
                    yield chunk
            else:
                for chunk in formats[i].stream_delta(event):
                    yield chunk
        for chunk in formats[0].stream_close(merged_usage([finishes[i] for i in range(len(formats))])):
            yield chunk
    except APIError as e:
        yield formats[0].stream_error(e)
    except Exception as e:
        log.exception("generation failed")
        yield formats[0].stream_error(APIError(500, f"Generation failed: {type(e).__name__}: {e}"))
    finally:
        choices.cancel()


async def _collect(request: Request, choices: Choices, formats: list) -> dict:
    async def watch_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        choices.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    segments: list[list] = [[] for _ in formats]
    finishes: dict[int, Finish] = {}
    try:
        async for i, event in choices.events():
            if isinstance(event, Finish):
                finishes[i] = event
            else:
                segments[i].append(event)
    finally:
        watcher.cancel()
        choices.cancel()
    if len(finishes) < len(formats):  # cancelled: the client is gone, nobody reads this
        raise APIError(499, "Client closed the request", code="cancelled")
    bodies = [f.body(segments[i], finishes[i]) for i, f in enumerate(formats)]
    whole = bodies[0]
    whole["choices"] = [c for b in bodies for c in b["choices"]]
    whole["usage"] = openai_usage(merged_usage([finishes[i] for i in range(len(formats))]))
    return whole
