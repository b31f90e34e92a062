"""OpenAI-compatible HTTP server for an edge0 Engine.

`edge0.server.app.create_app(engine, config)` builds the FastAPI app; `edge0.serve` runs it.
This package never imports mlx: it drives the engine only through docs/engine-api.md.
"""
