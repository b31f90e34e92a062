"""The chat page at `/` and `/ui`: static files shipped in edge0/server/static (no build step), served
with a Content-Security-Policy that lets the page load and call nothing but this server."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from edge0.server.errors import APIError

# Everything from this server ('self'), nothing inline, nothing from another host: the page works
# offline, and injected markup could neither run nor send data anywhere.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# `same-origin`, not `no-referrer`: with no-referrer a browser sends `Origin: null` on the page's
# own POSTs, which the Origin check (hosts.py) would refuse.
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

router = APIRouter(include_in_schema=False)


@lru_cache(maxsize=None)
def assets() -> dict[str, bytes]:
    """The page's files by name, read once from the package."""
    folder = resources.files("edge0.server") / "static"
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file() and f.name[f.name.rfind(".") :] in TYPES}


def _file(name: str) -> Response:
    body = assets().get(name)
    if body is None:
        raise APIError(404, f"No such file of the chat page: /ui/{name}", code="not_found")
    return Response(body, media_type=TYPES[name[name.rfind(".") :]], headers=HEADERS)


# HEAD too: Claude Code sends `HEAD /` to open its connection before the first request.
@router.api_route("/", methods=["GET", "HEAD"])
@router.api_route("/ui", methods=["GET", "HEAD"])
async def page() -> Response:
    """The chat page (HEAD: its headers)."""
    return _file("index.html")


@router.get("/ui/{name}")
async def asset(name: str) -> Response:
    """A script, style sheet or icon of the page (only the files shipped, by name)."""
    return _file(name)
