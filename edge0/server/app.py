"""The app factory: `create_app(engine, config)` wires an Engine into the FastAPI app serving the
OpenAI Chat Completions and Responses APIs and Anthropic's Messages API; `run` serves it."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import Counter
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from edge0.backend.memory import available as memory_available
from edge0.engine.api import EngineAPI
from edge0.server import anthropic, hosts, metrics, responses_api, ui
from edge0.server.admission import Tokenizing
from edge0.server.batching import make_scheduler
from edge0.server.config import ServerConfig
from edge0.server.connections import AcceptErrors, connection_protocol, raise_fd_limit
from edge0.server.conversation import renders_mid_system
from edge0.server.errors import install_error_handlers
from edge0.server.grammar import Grammars
from edge0.server.memory import MemoryWatcher
from edge0.server.metrics import CountRequests, Metrics
from edge0.server.middleware import Guard
from edge0.server.routes import router
from edge0.server.scheduler import Scheduler

log = logging.getLogger("edge0.server")


def create_app(engine: EngineAPI, config: ServerConfig | None = None, read_memory=memory_available) -> FastAPI:
    """The app serving `engine` (anything implementing docs/engine-api.md). `read_memory()` ->
    (bytes available, source) feeds the memory watcher when `config.memory_low` is set."""
    config = config or ServerConfig()
    scheduler, batching = make_scheduler(engine, config.max_queue, config.max_batch)
    log.info("requests decoded together: %d (%s)", batching["max_batch"], batching["why"])
    # The KV cache of the finished request goes to disk (with a prompt-cache dir) once its
    # response is complete, before the next request starts.
    scheduler.between.append(engine.persist_prompt_cache)
    watcher = None
    if config.memory_low and not engine.expert_cache()["slots_per_layer"]:
        log.warning(
            "--memory-low: the expert cache has no slots to shrink (--decode-executor exact); not watching memory"
        )
    elif config.memory_low:
        watcher = MemoryWatcher(engine, config.memory_low, config.memory_poll_s, read_memory)
        scheduler.between.append(watcher.apply)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.loop = asyncio.get_running_loop()
        scheduler.loop.set_exception_handler(AcceptErrors())
        if watcher:
            watcher.start(scheduler.run_between)
        yield
        if watcher:
            watcher.stop()
        # On the engine thread, after the jobs in flight: the conversations' caches to disk, so a
        # restarted server resumes them.
        await scheduler.last(engine.flush_prompt_caches)
        scheduler.shutdown()

    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN, on the origin where the chat
    # page keeps the API key. The schema itself stays at /openapi.json.
    app = FastAPI(
        title="edge0",
        summary="OpenAI- and Anthropic-compatible server for an edge0 MoE engine",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.engine, app.state.config, app.state.scheduler, app.state.memory = engine, config, scheduler, watcher
    app.state.batching = batching
    app.state.started = int(time.time())
    app.state.protocol = None  # the connection protocol, once run() serves the app
    # The longest vocabulary entry bounds the characters one token can hold (pipeline.respond).
    vocab = engine.tokenizer.get_vocab()
    app.state.token_chars, app.state.vocab_size = max(map(len, vocab)), max(vocab.values()) + 1
    app.state.grammars = Grammars(engine.tokenizer, engine.chat_format)
    app.state.tokenizing = Tokenizing(config.tokenize_concurrency, config.max_queue)
    app.state.mid_system = renders_mid_system(engine.chat_prompt, engine.tokenizer.decode)
    app.state.adapted = Counter()  # requests adapted rather than refused, by kind (pipeline.Prompt.notes)
    install_error_handlers(app)
    app.add_middleware(
        Guard, api_keys=config.api_keys(), max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s
    )
    hosts.install(app, config.allowed_hosts, config.cors_origins)  # before auth and limits
    app.state.metrics = Metrics(app.state)
    app.add_middleware(CountRequests, metrics=app.state.metrics)  # outermost: every answer counted
    app.include_router(ui.router)
    for routes in (router, anthropic.router, responses_api.router, metrics.router):
        app.include_router(routes)
    return app


class _Server(uvicorn.Server):
    """uvicorn's server; on SIGTERM or Ctrl-C it first ends running and queued generations, so
    open streams end (with an error event) instead of holding the shutdown until they finish."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler):
        super().__init__(config)
        self.scheduler = scheduler
        scheduler.on_fatal = self.stop_serving

    def stop_serving(self) -> None:
        """The engine cannot serve any more (Scheduler.fatal): end the open streams and exit."""
        self.scheduler.stop_soon()
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        self.scheduler.stop_soon()
        super().handle_exit(sig, frame)


def run(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info", sock: socket.socket | None = None
) -> None:
    """Serve `app` until SIGTERM / SIGINT (on `sock` if given, else host:port), with the connection
    limits of its ServerConfig (connections.py); raises the error that stopped it, if one did
    (a lost rank: Scheduler.fatal)."""
    server = _Server(uvicorn_config(app, host=host, port=port, log_level=log_level), app.state.scheduler)
    server.run(sockets=[sock] if sock else None)
    if (fatal := app.state.scheduler.fatal) is not None:
        raise fatal


def uvicorn_config(app: FastAPI, **kwargs) -> uvicorn.Config:
    """uvicorn's settings for `app`: its connection cap (the descriptor limit raised to fit it), the
    header timeout and the keep-alive timeout between requests (the body timeout is middleware.py's)."""
    config: ServerConfig = app.state.config
    cap = raise_fd_limit(config.max_connections)
    app.state.protocol = connection_protocol(cap, config.header_timeout_s)
    return uvicorn.Config(app, http=app.state.protocol, timeout_keep_alive=config.idle_timeout_s, **kwargs)
