"""Who may talk to the server from a browser: the `Host` allowlist (against DNS rebinding), the
`Origin` check (against cross-site requests) and the CORS origins named with `--cors-origin`.

A web page whose domain is rebound to 127.0.0.1 reaches a local server with its own name in
`Host`; a page on another site that posts to 127.0.0.1 sends its own `Origin`. Both are refused
before anything else runs, on every route. Clients outside a browser send the host they dial and
no `Origin`, so they are unaffected.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.middleware.cors import CORSMiddleware

from edge0.server.errors import APIError, error_response

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def host_name(value: str) -> str | None:
    """The host of a `Host` header value, lower-case, without its port (IPv6 in brackets);
    None when the value is empty or malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[: end + 1], value[end + 1 :]
    else:
        host, sep, port = value.partition(":")
        rest = sep + port
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return None
    if not host or any(c in host for c in "/@?#\\ \t"):
        return None
    return host


def normalize_host(name: str) -> str:
    """A host name as `host_name` gives it: `::1` -> `[::1]`; raises ValueError when malformed."""
    name = name.strip()
    if ":" in name and not name.startswith("["):
        name = f"[{name}]" if name.count(":") > 1 else name  # a bare IPv6 address
    host = host_name(name)
    if host is None:
        raise ValueError(f"not a host name: {name!r} (give a name or address, without scheme or path)")
    return host


def normalize_origin(origin: str) -> str:
    """`scheme://host[:port]` as browsers send it in `Origin`; raises ValueError otherwise."""
    parts = urlsplit(origin.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
        raise ValueError(f"not an origin: {origin!r} (expected scheme://host[:port], e.g. http://localhost:3000)")
    if parts.query or parts.fragment or "@" in parts.netloc or host_name(parts.netloc) is None:
        raise ValueError(f"not an origin: {origin!r} (expected scheme://host[:port], e.g. http://localhost:3000)")
    return f"{parts.scheme}://{parts.netloc.lower()}"


class HostGuard:
    """ASGI middleware: refuse a request whose `Host` is missing, empty, malformed (400) or not
    allowed (403), and one whose `Origin` is neither this server's own nor a CORS origin (403).

    Allowed hosts: the loopback names, the address the connection arrived on (the bound
    address; for 0.0.0.0 the interface the client reached), and `allowed_hosts`.
    """

    def __init__(self, app, allowed_hosts=(), cors_origins=()):
        self.app = app
        self.allowed = set(LOOPBACK_HOSTS) | {normalize_host(h) for h in allowed_hosts}
        self.cors_origins = {normalize_origin(o) for o in cors_origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self.check(scope)
        if error is not None:
            return await error_response(scope["path"], error)(scope, receive, send)
        await self.app(scope, receive, send)

    def check(self, scope) -> APIError | None:
        """The error refusing this request, or None to let it through."""
        values = [v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"host"]
        if len(values) != 1 or host_name(values[0]) is None:
            seen = "no Host header" if not values else f"Host {values!r}" if len(values) > 1 else f"Host {values[0]!r}"
            return APIError(400, f"Bad request: {seen}; send one Host header naming this server", code="bad_host")
        host = host_name(values[0])
        if host not in self.allowed and host != _bound(scope):
            return APIError(
                403,
                f"Host {values[0]!r} is not allowed: this server answers to {', '.join(sorted(self._names(scope)))} "
                f"(a web page can point its own domain at this machine to reach local servers). "
                f"If you reach it by this name, start it with --allowed-host {host}",
                code="host_not_allowed",
            )
        origins = [v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"origin"]
        for origin in origins:
            if not self._origin_ok(origin, values[0]):
                return APIError(
                    403,
                    f"Cross-origin request from {origin!r} refused: only this server's own page may call it "
                    f"from a browser. To allow that site, start the server with --cors-origin {origin}",
                    code="origin_not_allowed",
                )
        return None

    def _origin_ok(self, origin: str, host_header: str) -> bool:
        try:
            origin = normalize_origin(origin)
        except ValueError:  # "null" (sandboxed frames, file://) and anything malformed
            return False
        return origin in self.cors_origins or urlsplit(origin).netloc == host_header.strip().lower()

    def _names(self, scope) -> set[str]:
        bound = _bound(scope)
        return self.allowed | ({bound} if bound else set())


def _bound(scope) -> str | None:
    """The local address the connection arrived on, as a Host would name it."""
    server = scope.get("server")
    if not server or not server[0]:
        return None
    address = str(server[0]).lower()
    return f"[{address}]" if ":" in address else address


def install(app, allowed_hosts=(), cors_origins=()) -> None:
    """Add the guards to `app`, outside every other middleware: CORS for `cors_origins` (with
    preflight answered before auth, which a preflight never carries), then the Host and Origin
    checks outermost."""
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=sorted({normalize_origin(o) for o in cors_origins}),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            max_age=600,
        )
    app.add_middleware(HostGuard, allowed_hosts=allowed_hosts, cors_origins=cors_origins)
