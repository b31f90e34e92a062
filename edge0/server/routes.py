"""The OpenAI Chat Completions and Completions endpoints, and models, health, stats."""

from __future__ import annotations

from fastapi import APIRouter, Request

from edge0.backend.memory import available as memory_available
from edge0.server.chat_format import ChatFormat, CompletionFormat
from edge0.server.pipeline import Prompt, check_model, chosen_tools, respond, sampling_params
from edge0.server.schemas import ChatCompletion, ChatRequest, Completion, CompletionRequest, ModelCard, ModelList

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict:
    """Liveness, the loaded model, and how many requests are running or waiting."""
    state = request.app.state
    return {
        "status": "stopping" if state.scheduler.stopping else "ok",
        "model": state.engine.model_id,
        "requests_in_flight": state.scheduler.admitted,
    }


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> dict:
    return {"data": [_card(request)]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, request: Request) -> dict:
    check_model(request, model_id)
    return _card(request)


@router.get("/v1/stats")
async def stats(request: Request) -> dict:
    """Cumulative engine and expert-cache statistics, the server's request counters, and the
    memory watcher's (None when --memory-low is off)."""
    state = request.app.state
    return {
        "model": state.engine.model_id,
        "engine": state.engine.stats(),
        "server": {
            "requests_in_flight": state.scheduler.admitted,
            **state.scheduler.counters,
            "between_errors": state.scheduler.between_errors,
        },
        "memory": state.memory.stats() if state.memory else None,
        "machine": _machine_memory(),
    }


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(body: ChatRequest, request: Request):
    """Chat with the tokenizer's template; SSE when `stream` is true."""
    check_model(request, body.model)
    params = sampling_params(
        request,
        body.max_completion_tokens or body.max_tokens,
        "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        body.temperature,
        body.top_p,
        body.seed,
        body.stop_list(),
    )
    prompt = Prompt(
        "messages", body.template_messages(), chosen_tools(body.tool_dicts(), body.tool_mode(), "tool_choice")
    )
    fmt = ChatFormat(request.app.state.engine.model_id, body.include_usage())
    return await respond(request, fmt, prompt, params, body.stream)


@router.post("/v1/completions", response_model=Completion)
async def completions(body: CompletionRequest, request: Request):
    """Raw-text completion, no chat template; SSE when `stream` is true."""
    check_model(request, body.model)
    params = sampling_params(
        request, body.max_tokens, "max_tokens", body.temperature, body.top_p, body.seed, body.stop_list()
    )
    fmt = CompletionFormat(request.app.state.engine.model_id, body.include_usage())
    return await respond(request, fmt, Prompt("prompt", text=body.prompt), params, body.stream)


def _machine_memory() -> dict:
    """`machine` in /v1/stats: the memory this process could still use now (the chat page draws
    the engine's memory against it)."""
    available, source = memory_available()
    return {"memory_available_bytes": available, "memory_source": source}


def _card(request: Request) -> dict:
    return {"id": request.app.state.engine.model_id, "created": request.app.state.started}
