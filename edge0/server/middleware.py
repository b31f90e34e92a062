"""ASGI middleware that guards every request before FastAPI sees it: auth, then body size and time.

Both run before the body is parsed, so an unauthenticated or oversized request is refused
without reading it (and without a validation error masking the real reason).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac

from starlette.concurrency import run_in_threadpool

from edge0.backend.core import trim_heap
from edge0.server.errors import APIError, error_response

# A request body at least this large is followed by malloc_trim once answered: the objects parsed
# from it are freed into glibc's heap, which keeps the pages otherwise (six refused 3.9 MB bodies
# left 16-23 MiB of RSS behind).
TRIM_AFTER_BYTES = 1 << 20

# The OpenAI routes also served without their /v1 prefix (routes.py, responses_api.py).
UNPREFIXED = ("/chat/completions", "/completions", "/responses", "/models")


def needs_key(path: str) -> bool:
    """With --api-key: every /v1 route and its unprefixed alias, and /metrics (it tells the load
    and the token counts)."""
    return (
        path.startswith("/v1") or path == "/metrics" or any(path == p or path.startswith(p + "/") for p in UNPREFIXED)
    )


def takes_body(method: str, path: str) -> bool:
    """Whether a route may read a request body: POST, PUT and PATCH, except on /health (a GET
    route: another method gets its 405 without the body being read)."""
    return method in ("POST", "PUT", "PATCH") and path != "/health"


class Guard:
    """API-key auth on /v1/* and the unprefixed aliases (when a key is set) and a request-body size limit.

    A key is accepted as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY`
    (Anthropic clients), on every route. With several keys, the request's state names its key
    (`api_key_id`, a digest): each key's requests share prompt caches only among themselves.
    """

    def __init__(self, app, api_keys: tuple[str, ...], max_body_bytes: int, body_timeout_s: float = 60.0):
        self.app, self.api_keys, self.max_body_bytes = app, tuple(api_keys), max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = self._key(headers) if self.api_keys and needs_key(path) else None
        if self.api_keys and needs_key(path) and key is None:
            error = APIError(
                401,
                "Missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
            )
            return await error_response(path, error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if key is not None and len(self.api_keys) > 1:  # read as request.state.api_key_id
            scope.setdefault("state", {})["api_key_id"] = hashlib.sha256(key.encode()).hexdigest()[:16]
        if not takes_body(scope["method"], path):  # answered without waiting for a body nobody reads
            return await self.app(scope, receive, send)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        # Read the body here (a chunked body declares no length) and replay it to the app.
        messages, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while True:
            try:  # a body that trickles in would hold a connection and its buffer for ever
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await self._too_slow(scope, receive, send)
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            # After the body, pass through: the app listens here for the client disconnecting.
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
        if size >= TRIM_AFTER_BYTES:  # its parsed JSON is freed now: give the C heap's pages back
            messages.clear()
            await run_in_threadpool(trim_heap)

    def _key(self, headers: dict) -> str | None:
        """The configured key the request sends, or None."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        sent = [token.strip() if scheme.lower() == "bearer" else "", headers.get("x-api-key", "").strip()]
        for key in self.api_keys:  # every key compared, in constant time each
            if any(hmac.compare_digest(s.encode(), key.encode()) for s in sent):
                return key
        return None

    async def _too_slow(self, scope, receive, send):
        error = APIError(
            408, f"The request body did not arrive within {self.body_timeout_s:g} s (--body-timeout-s)", code="timeout"
        )
        await error_response(scope["path"], error, {"Connection": "close"})(scope, receive, send)

    async def _too_large(self, scope, receive, send):
        error = APIError(
            413, f"Request body is larger than {self.max_body_bytes} bytes (--max-body-bytes)", code="request_too_large"
        )
        await error_response(scope["path"], error)(scope, receive, send)
