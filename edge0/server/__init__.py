"""HTTP server for an edge0 Engine: OpenAI's Chat Completions and Responses APIs and Anthropic's
Messages API, sharing one engine thread, queue, key and limits (pipeline.py).

`edge0.server.app.create_app(engine, config)` builds the FastAPI app; `edge0.server.app.run`
serves it (`edge0 serve`).
This package never imports mlx: it drives the engine only through docs/engine-api.md.
"""
