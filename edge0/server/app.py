"""The app factory: `create_app(engine, config)` wires an Engine into the FastAPI app."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from edge0.server.config import ServerConfig
from edge0.server.errors import install_error_handlers
from edge0.server.middleware import Guard
from edge0.server.routes import router
from edge0.server.scheduler import Scheduler


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """An OpenAI-compatible app serving `engine` (anything implementing docs/engine-api.md)."""
    config = config or ServerConfig()
    scheduler = Scheduler(config.max_queue)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        scheduler.shutdown()

    app = FastAPI(title="edge0", summary="OpenAI-compatible server for an edge0 MoE engine", lifespan=lifespan)
    app.state.engine, app.state.config, app.state.scheduler = engine, config, scheduler
    app.state.started = int(time.time())
    install_error_handlers(app)
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes)
    app.include_router(router)
    return app
