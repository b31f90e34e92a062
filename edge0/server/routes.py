"""The OpenAI Chat Completions and Completions endpoints, and models, health, stats. Each OpenAI
route also answers without its /v1 prefix (clients configured with a bare base URL)."""

from __future__ import annotations

from datetime import datetime, timezone

from fastapi import APIRouter, Request

from edge0.backend.memory import available as memory_available
from edge0.server.chat_format import ChatFormat, CompletionFormat
from edge0.server.choices import respond_choices
from edge0.server.connections import connection_stats
from edge0.server.pipeline import Prompt, check_model, chosen_tools, respond, sampling_params, served_id
from edge0.server.schemas import (
    AnthropicModelCard,
    AnthropicModelList,
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from edge0.server.structured import format_constraint, logit_bias, thinking_switch, tool_constraint

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict:
    """Liveness, the loaded model, and how many requests are running or waiting."""
    state = request.app.state
    return {
        "status": "stopping" if state.scheduler.stopping else "ok",
        "model": served_id(request),
        "requests_in_flight": state.scheduler.admitted,
    }


@router.get("/v1/models", response_model=ModelList | AnthropicModelList)
@router.get("/models", response_model=ModelList | AnthropicModelList, include_in_schema=False)
async def list_models(request: Request) -> dict:
    """The served model (its id first), and each --served-model-name alias; in Anthropic's shape
    when the request carries `anthropic-version` (the anthropic SDKs send it)."""
    names = request.app.state.config.served_model_names or (served_id(request),)
    cards = [_card(request, name) for name in names]
    if _anthropic(request):
        return {"data": cards, "has_more": False, "first_id": names[0], "last_id": names[-1]}
    return {"data": cards}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard | AnthropicModelCard)
@router.get("/models/{model_id:path}", response_model=ModelCard | AnthropicModelCard, include_in_schema=False)
async def get_model(model_id: str, request: Request) -> dict:
    check_model(request, model_id)
    config = request.app.state.config
    return _card(request, model_id if model_id in config.served_model_names else served_id(request))


@router.get("/v1/stats")
async def stats(request: Request) -> dict:
    """Cumulative engine and expert-cache statistics, the server's request counters and batching
    (batching.py), and the memory watcher's (None when --memory-low is off)."""
    state = request.app.state
    return {
        "model": served_id(request),
        "engine": state.engine.stats(),
        "server": {
            "requests_in_flight": state.scheduler.admitted,
            **state.scheduler.counters,
            "between_errors": state.scheduler.between_errors,
            "batching": {**state.batching, **state.scheduler.stats()},
            "sampling": dict(state.grammars.stats),
            "adapted": dict(state.adapted),
            **state.tokenizing.stats(),
            **(connection_stats(state.protocol) if state.protocol else {}),
        },
        "memory": state.memory.stats() if state.memory else None,
        "machine": _machine_memory(),
    }


@router.post("/v1/chat/completions", response_model=ChatCompletion)
@router.post("/chat/completions", response_model=ChatCompletion, include_in_schema=False)
async def chat_completions(body: ChatRequest, request: Request):
    """Chat with the tokenizer's template; SSE when `stream` is true."""
    model = check_model(request, body.model)
    params = sampling_params(
        body.max_completion_tokens or body.max_tokens,
        body.temperature,
        body.top_p,
        body.seed,
        body.stop_list(),
        logprobs=body.logprobs_count(),
        logit_bias=logit_bias(body.logit_bias, request.app.state.vocab_size),
    )
    tools = body.tool_dicts()
    if body.tool_mode() == "forced":
        constraint, where = tool_constraint(body.tool_specs(), body.forced_tool(), "tool_choice"), "tool_choice"
    else:
        constraint, where = format_constraint(body.response_format, "response_format"), "response_format"
    switch = thinking_switch(body.reasoning_effort)
    if constraint is not None and not switch:  # reasoning before the constrained output: only when asked
        switch = {"enable_thinking": False}
    prompt = Prompt(
        "messages",
        body.template_messages(),
        chosen_tools(tools, body.tool_mode()),
        template_kwargs=switch,
        constraint=constraint,
        constraint_param=where,
        cache_salt=body.cache_salt,
        image_param=body.image_param(),
    )
    fmt = ChatFormat(model, body.include_usage())
    if body.n > 1:
        return await respond_choices(request, fmt, prompt, params, body.stream, body.n)
    return await respond(request, fmt, prompt, params, body.stream)


@router.post("/v1/completions", response_model=Completion)
@router.post("/completions", response_model=Completion, include_in_schema=False)
async def completions(body: CompletionRequest, request: Request):
    """Raw-text completion, no chat template; SSE when `stream` is true."""
    model = check_model(request, body.model)
    params = sampling_params(
        body.max_tokens,
        body.temperature,
        body.top_p,
        body.seed,
        body.stop_list(),
        logprobs=body.logprobs,
        logit_bias=logit_bias(body.logit_bias, request.app.state.vocab_size),
    )
    fmt = CompletionFormat(model, body.include_usage())
    prompt = Prompt("prompt", text=body.prompt, cache_salt=body.cache_salt)
    if body.n > 1:
        return await respond_choices(request, fmt, prompt, params, body.stream, body.n)
    return await respond(request, fmt, prompt, params, body.stream)


def _machine_memory() -> dict:
    """`machine` in /v1/stats: the memory this process could still use now (the chat page draws
    the engine's memory against it)."""
    available, source = memory_available()
    return {"memory_available_bytes": available, "memory_source": source}


def _anthropic(request: Request) -> bool:
    return "anthropic-version" in request.headers


def _card(request: Request, name: str) -> dict:
    state = request.app.state
    if not _anthropic(request):
        return {"id": name, "created": state.started}
    config = state.config
    return {
        "id": name,
        "display_name": name,
        "created_at": datetime.fromtimestamp(state.started, timezone.utc).isoformat().replace("+00:00", "Z"),
        "max_input_tokens": config.max_prompt_tokens,
        "max_tokens": config.max_tokens or config.context_length,
    }
