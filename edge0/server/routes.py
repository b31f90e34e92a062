"""The endpoints: chat completions, completions, models, health, stats."""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from edge0.server.errors import APIError, error_body
from edge0.server.generation import Finish, Params, generation_events
from edge0.server.responses import ChatFormat, CompletionFormat, sse
from edge0.server.scheduler import Job, QueueFull
from edge0.server.schemas import (ChatCompletion, ChatRequest, Completion, CompletionRequest, ModelCard,
                                  ModelList, SamplingRequest)

log = logging.getLogger("edge0.server")
router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict:
    """Liveness, the loaded model, and how many requests are running or waiting."""
    state = request.app.state
    return {"status": "ok", "model": state.engine.model_id, "requests_in_flight": state.scheduler.admitted}


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> dict:
    return {"data": [_card(request)]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, request: Request) -> dict:
    _check_model(request, model_id)
    return _card(request)


@router.get("/v1/stats")
async def stats(request: Request) -> dict:
    """Cumulative engine and expert-cache statistics, plus the server's request counters."""
    state = request.app.state
    return {"model": state.engine.model_id, "engine": state.engine.stats(),
            "server": {"requests_in_flight": state.scheduler.admitted, **state.scheduler.counters}}


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(body: ChatRequest, request: Request):
    """Chat with the tokenizer's template; SSE when `stream` is true."""
    engine, config = request.app.state.engine, request.app.state.config
    _check_model(request, body.model)
    if len(body.messages) > config.max_messages:
        raise APIError(400, f"{len(body.messages)} messages is above this server's limit of "
                       f"{config.max_messages} (--max-messages)", "messages", "too_many_messages")
    tools = body.tool_dicts()
    if tools and not engine.tokenizer.has_tool_calling:
        raise APIError(400, "This model's tokenizer declares no tool-call format", "tools", "tools_unsupported")
    params = _params(request, body, body.max_completion_tokens or body.max_tokens)
    messages = body.template_messages()
    try:
        prompt = await run_in_threadpool(engine.chat_prompt, messages, tools)
    except Exception as e:  # the template (Jinja) rejects some conversations, e.g. bad role order
        raise APIError(400, f"Could not apply the chat template: {e}", "messages", "invalid_messages") from None
    return await _respond(request, prompt, params, tools, body, ChatFormat(engine.model_id), "messages")


@router.post("/v1/completions", response_model=Completion)
async def completions(body: CompletionRequest, request: Request):
    """Raw-text completion, no chat template; SSE when `stream` is true."""
    engine = request.app.state.engine
    _check_model(request, body.model)
    params = _params(request, body, body.max_tokens)
    prompt = await run_in_threadpool(engine.tokenizer.encode, body.prompt)
    return await _respond(request, prompt, params, None, body, CompletionFormat(engine.model_id), "prompt")


def _card(request: Request) -> dict:
    return {"id": request.app.state.engine.model_id, "created": request.app.state.started}


def _check_model(request: Request, model: str | None) -> None:
    served = request.app.state.engine.model_id
    if model is not None and model != served:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served}'",
                       "model", "model_not_found")


def _params(request: Request, body: SamplingRequest, max_tokens: int | None) -> Params:
    config = request.app.state.config
    max_tokens = max_tokens or config.default_max_tokens
    if max_tokens > config.max_tokens:
        raise APIError(400, f"max_tokens is {max_tokens}, above this server's limit of {config.max_tokens} "
                       "(--max-tokens)", "max_tokens", "max_tokens_exceeded")
    # OpenAI's defaults: temperature 1, top_p 1.
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    return Params(max_tokens, temperature, top_p, body.seed, body.stop_list())


async def _respond(request: Request, prompt: list[int], params: Params, tools, body: SamplingRequest, fmt, param: str):
    limit = request.app.state.config.max_prompt_tokens
    if len(prompt) > limit:
        raise APIError(400, f"The prompt is {len(prompt)} tokens, above this server's limit of {limit} "
                       "(--max-prompt-tokens)", param, "context_length_exceeded")
    try:
        job = request.app.state.scheduler.submit(partial(generation_events, request.app.state.engine, prompt,
                                                         params, tools))
    except QueueFull as e:
        raise APIError(429, f"Server busy: {e}; retry later", code="queue_full") from None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # The background task also covers a client that leaves before the stream starts.
        return StreamingResponse(_stream(job, fmt, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(job.cancel))
    return await _collect(request, job, fmt)


async def _stream(job: Job, fmt, include_usage: bool):
    """SSE body. Leaving this generator early (client gone) cancels the job."""
    try:
        if (first := fmt.start()) is not None:
            yield sse(first)
        async for event in job.events():
            if isinstance(event, Finish):
                yield sse(fmt.end(event))
                if include_usage:
                    yield sse(fmt.usage_chunk(event))
            else:
                yield sse(fmt.delta(event))
        yield sse("[DONE]")
    except Exception as e:  # headers are sent: report the failure in-stream, as OpenAI does
        log.exception("generation failed")
        yield sse(error_body(500, f"Generation failed: {type(e).__name__}: {e}"))
    finally:
        job.cancel()


async def _collect(request: Request, job: Job, fmt) -> dict:
    """Run a job to the end for a non-streaming response, cancelling it if the client leaves."""

    async def watch_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    segments, finish = [], None
    try:
        async for event in job.events():
            if isinstance(event, Finish):
                finish = event
            else:
                segments.append(event)
    finally:
        watcher.cancel()
        job.cancel()
    if finish is None:  # cancelled: the client is gone, nobody reads this
        raise APIError(499, "Client closed the request", code="cancelled")
    return fmt.body(segments, finish)
