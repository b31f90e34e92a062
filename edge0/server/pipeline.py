"""What the three APIs (Chat Completions, Anthropic Messages, Responses) share once a request is
parsed: the served model, sampling parameters and their limits, the prompt limits, the queue,
and turning a generation's events into a streamed or a whole response through the API's Format.

Each API supplies a Format: how its stream starts, carries a text or tool-call segment, ends,
or reports an error (server-sent events, as strings), and the body of a non-streamed answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Iterable, Literal, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from edge0.backend.logits import LogitBias
from edge0.errors import ImagesRefused
from edge0.server import reasoning
from edge0.server.admission import rendered_chars
from edge0.server.conversation import place_system_turns
from edge0.server.errors import APIError
from edge0.server.generation import Finish, Params, Run, Segment
from edge0.server.grammar import Constraint, GrammarError
from edge0.server.images import take_images
from edge0.server.metrics import observe
from edge0.server.scheduler import Job

log = logging.getLogger("edge0.server")


def sse(data: dict | str, event: str | None = None) -> str:
    """One server-sent event carrying `data` (a dict is sent as JSON), named `event` if given."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


class Format(Protocol):
    """One API's shape of a response (one instance per request)."""

    def stream_start(self, prompt_tokens: int) -> Iterable[str]: ...
    def stream_delta(self, segment: Segment) -> Iterable[str]: ...
    def stream_keepalive(self) -> Iterable[str]: ...
    def stream_end(self, finish: Finish) -> Iterable[str]: ...
    def stream_error(self, error: APIError) -> str: ...
    def body(self, segments: list[Segment], finish: Finish) -> dict: ...


@dataclass(frozen=True)
class Prompt:
    """What the engine continues: chat `messages` (and `tools`) rendered with the chat template
    (given `template_kwargs`, e.g. enable_thinking), or raw `text`; and what the output must be
    (`constraint`, named by the request field `constraint_param` in errors). `param` is the
    request field that errors about the prompt name."""

    param: str
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    text: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    constraint: Constraint | None = None
    constraint_param: str | None = None
    thinking_budget: int | None = None  # most reasoning tokens (Anthropic's budget_tokens)
    cache_salt: str | None = None  # only requests with the same salt share cached prefixes (cache_namespace)
    image_param: str | None = None  # where the request's first image is (None: text only)
    # What the request asked that this server adapted rather than refused: (counter, log line) pairs,
    # counted in /v1/stats and logged the first time.
    notes: tuple[tuple[str, str], ...] = ()


def served_id(request: Request) -> str:
    """The model id this server reports: the first --served-model-name, else the store's name."""
    names = request.app.state.config.served_model_names
    return names[0] if names else request.app.state.engine.model_id


def check_model(request: Request, model: str | None) -> str:
    """The id to report for a request naming `model`: any name is this server's one model,
    unless --strict-model-name, which accepts only the served names (404 for another)."""
    config = request.app.state.config
    names = config.served_model_names or (request.app.state.engine.model_id,)
    if config.strict_model_name and model is not None and model not in names:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves {', '.join(repr(n) for n in names)} "
            "(--strict-model-name)",
            "model",
            "model_not_found",
        )
    return served_id(request)


def sampling_params(
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None = None,
    stop: list[str] | None = None,
    **extra,
) -> Params:
    """Params with the APIs' common defaults (temperature 1, top_p 1); `max_tokens` is what the
    request asked (None: as many as allowed), clamped by respond(). `extra`: top_k, logprobs,
    logit_bias."""
    return Params(
        max_tokens,
        1.0 if temperature is None else temperature,
        1.0 if top_p is None else top_p,
        seed,
        [s for s in stop or [] if s],
        **extra,
    )


ToolChoice = Literal["auto", "none", "forced"]


def chosen_tools(tools: list[dict] | None, choice: ToolChoice) -> list[dict] | None:
    """The tools to render: none for "none"."""
    return tools if choice != "none" else None


SYSTEM_FOLDED = (
    "system_turns_folded",
    "a system message inside the conversation was folded into a user turn as a <system-reminder>: this "
    "model's chat template renders no system turn there (counted in /v1/stats as system_turns_folded)",
)


def _adapted(state, prompt: Prompt, record: bool) -> Prompt:
    """`prompt` with its system turns placed for the chat template (conversation.py); with `record`,
    each adaptation is counted in /v1/stats and logged the first time."""
    notes = list(prompt.notes)
    if prompt.messages is not None:
        messages, folded = place_system_turns(prompt.messages, state.mid_system)
        prompt = replace(prompt, messages=messages)
        notes += [SYSTEM_FOLDED] if folded else []
    for name, line in notes if record else ():
        if not state.adapted[name]:
            log.info("%s", line)
        state.adapted[name] += 1
    return prompt


async def prompt_tokens(request: Request, prompt: Prompt, record: bool = False) -> tuple[list[int], object]:
    """The token ids the engine would prefill for `prompt`, after the limits on messages, tools and
    prompt length (APIError when they refuse it), and its images' prompt (None: text only; the ids
    are then its tokens, each image's expanded). `record`: count what was adapted (a generation)."""
    state = request.app.state
    engine, config = state.engine, state.config
    prompt = _adapted(state, prompt, record)
    if prompt.messages is not None and len(prompt.messages) > config.max_messages:
        raise APIError(
            400,
            f"{len(prompt.messages)} messages is above this server's limit of {config.max_messages} (--max-messages)",
            prompt.param,
            "too_many_messages",
        )
    if prompt.image_param is not None and not engine.takes_images:
        raise APIError(
            400,
            f"{engine.model_id}: this model does not take images ({engine.model_type}: its store holds no vision "
            f"tower; Edge0 serves the language model only), and {prompt.image_param} is one; send the request "
            "without images",
            prompt.image_param,
            "images_unsupported",
        )
    if prompt.tools and not engine.chat_format.calls:
        raise APIError(
            400,
            f"{engine.model_id}: its chat template has no tool-call format Edge0 knows ({engine.model_type}); "
            "docs/clients.md lists the families whose tool calls are served",
            "tools",
            "tools_unsupported",
        )
    # No token is longer than the longest vocabulary entry, so more characters than this cannot
    # fit in the token limit: refuse them before paying for the template and the tokenizer.
    chars, most = (
        rendered_chars([prompt.messages, prompt.tools, prompt.text]),
        config.max_prompt_tokens * state.token_chars,
    )
    if chars > most:
        raise APIError(
            400,
            f"The prompt is {chars} characters, more than this server's limit of "
            f"{config.max_prompt_tokens} tokens (--max-prompt-tokens) can hold (tokens of this model "
            f"are at most {state.token_chars} characters)",
            prompt.param,
            "context_length_exceeded",
        )
    # read (fetched, with --fetch-image-urls) before the template renders their parts
    images, image_params = await run_in_threadpool(take_images, prompt.messages, config.fetch_image_urls)
    tokens = await state.tokenizing.run(_tokenize, engine, prompt, chars=chars)  # bounded: admission.py
    vision = None
    if images:
        try:
            vision = await state.tokenizing.run(engine.image_prompt, tokens, images, chars=chars)
        except ImagesRefused as e:
            param = image_params[e.index] if e.index is not None else prompt.param
            raise APIError(400, str(e), param, "invalid_image") from None
        tokens = vision.tokens
    if len(tokens) > config.max_prompt_tokens:
        raise APIError(
            400,
            f"The prompt is {len(tokens)} tokens, above this server's limit of "
            f"{config.max_prompt_tokens} (--max-prompt-tokens)",
            prompt.param,
            "context_length_exceeded",
        )
    return tokens, vision


def generation_limit(config, asked: int | None, prompt_tokens: int, param: str) -> int:
    """The most tokens to generate: what the request asked (else --default-max-tokens), at most
    --max-tokens and what the model's context leaves after the prompt."""
    left = config.context_length - prompt_tokens
    if left < 1:
        raise APIError(
            400,
            f"The prompt is {prompt_tokens} tokens: it fills the model's context of {config.context_length} "
            "tokens and leaves none to generate",
            param,
            "context_length_exceeded",
        )
    limits = [left, asked, config.max_tokens, None if asked else config.default_max_tokens]
    return min(n for n in limits if n is not None)


async def respond(request: Request, fmt: Format, prompt: Prompt, params: Params, stream: bool):
    """Check the prompt against the limits, queue its generation, and answer: server-sent events
    when `stream`, else one JSON body. Raises APIError for a request the limits refuse."""
    state = request.app.state
    tokens, vision = await prompt_tokens(request, prompt, record=True)
    params = params.with_max_tokens(generation_limit(state.config, params.max_tokens, len(tokens), prompt.param))
    run = await generation_run(request, prompt, params, tokens, vision)
    job = state.scheduler.generate(state.engine, run)
    events = observe(state.metrics, job.events(), time.monotonic())
    if stream:
        # The background task also covers a client that leaves before the stream starts.
        return StreamingResponse(
            _stream(job, events, fmt, len(tokens), state.config.keepalive_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(job.cancel),
        )
    return JSONResponse(await _collect(request, job, events, fmt))


async def generation_run(request: Request, prompt: Prompt, params: Params, tokens: list[int], vision=None) -> Run:
    """What the engine thread needs: the reasoning markers, the logits processors (logit bias,
    thinking budget, grammar) and, for log-probs, each token's bytes."""
    state = request.app.state
    tokenizer, fmt = state.engine.tokenizer, state.engine.chat_format
    run = Run(tokens, params, prompt.tools, namespace=cache_namespace(request, prompt.cache_salt), vision=vision)
    run.chat = prompt.messages is not None
    found = fmt.think if run.chat else None
    opened = bool(found) and reasoning.opens_reasoning(fmt, tokenizer, tokens)
    run.opened = opened
    if params.logit_bias:
        run.processors.append(LogitBias(params.logit_bias))
    if found and prompt.thinking_budget:
        limit = reasoning.budget(fmt, tokenizer, prompt.thinking_budget, opened)
        state.grammars.stats["thinking_budgets" if limit else "thinking_budgets_unenforced"] += 1
        run.processors += [limit] if limit else []
    if prompt.constraint is not None:
        # Reasoning comes first when the prompt opened a block or the request asked for it.
        asked = found and (opened or prompt.template_kwargs.get("enable_thinking"))
        run.processors.append(await _grammar(request, prompt, (*found, opened) if asked else None))
    if params.logprobs is not None:
        try:  # the grammar library's token table gives each token's bytes (built on first use)
            await run_in_threadpool(state.grammars.ll_tokenizer)
        except GrammarError as e:
            raise APIError(400, f"Log-probs are not available: {e}", "logprobs", "unsupported_value") from None
        run.token_bytes = state.grammars.token_bytes
    return run


def cache_namespace(request: Request, salt: str | None) -> str:
    """The prompt caches a request may reuse and fills: those of its `salt` (the request's
    cache_salt) and, with several --api-key values, of its key (the Guard names it); "" for the
    shared default. A digest, so no salt or key is kept with the caches."""
    key = getattr(request.state, "api_key_id", None)
    if not salt and key is None:
        return ""
    return hashlib.sha256(f"key\0{key or ''}\0salt\0{salt or ''}".encode()).hexdigest()[:32]


async def _grammar(request: Request, prompt: Prompt, think: tuple[str, str, bool] | None):
    """The grammar processor of a constrained request (the tokenizer's token table is built on
    first use, in a worker thread)."""
    grammars = request.app.state.grammars
    if prompt.constraint.tools and not request.app.state.engine.chat_format.json_calls:
        raise APIError(
            400,
            'Forcing a tool call needs a JSON tool-call format (<tool_call>{"name": ..., "arguments": ...}); '
            "this model's is another; use tool_choice auto",
            prompt.constraint_param,
            "unsupported_value",
        )
    try:
        return await run_in_threadpool(grammars.processor, prompt.constraint, think)
    except GrammarError as e:
        raise APIError(400, f"Cannot enforce this format: {e}", prompt.constraint_param, "invalid_value") from None


def _tokenize(engine, prompt: Prompt) -> list[int]:
    if prompt.text is not None:
        return engine.tokenizer.encode(prompt.text)
    try:
        fmt = engine.chat_format
        messages = fmt.render_messages(prompt.messages, prompt.tools)
        return engine.chat_prompt(messages, fmt.render_tools(prompt.tools), **prompt.template_kwargs)
    except Exception as e:  # the template (Jinja) rejects some conversations, e.g. bad role order
        raise APIError(400, f"Could not apply the chat template: {e}", prompt.param, "invalid_messages") from None


async def _stream(job: Job, events: AsyncIterator, fmt: Format, prompt_tokens: int, keepalive_s: float):
    """SSE body of `job`'s `events`. Leaving this generator early (client gone) cancels the job.
    While no event comes for `keepalive_s` (a long prefill, a tool call being written), the
    Format's keep-alive goes out, so that clients' stream idle watchdogs do not fire (docs/clients.md)."""
    events = events.__aiter__()
    pending = None
    try:
        for event in fmt.stream_start(prompt_tokens):
            yield event
        while True:
            pending = pending or asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:
                for event in fmt.stream_keepalive():
                    yield event
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                break
            for event in fmt.stream_end(item) if isinstance(item, Finish) else fmt.stream_delta(item):
                yield event
    except APIError as e:  # headers are sent: report the failure in-stream, as the APIs do
        yield fmt.stream_error(e)
    except Exception as e:
        log.exception("generation failed")
        yield fmt.stream_error(APIError(500, f"Generation failed: {type(e).__name__}: {e}"))
    finally:
        if pending is not None:
            pending.cancel()
        job.cancel()


async def _collect(request: Request, job: Job, events: AsyncIterator, fmt: Format) -> dict:
    """Run a job to the end (its `events`) for a non-streaming response, cancelling it if the client leaves."""

    async def watch_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    segments, finish = [], None
    try:
        async for event in events:
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
