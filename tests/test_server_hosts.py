"""Requests a web page could make against the local server: a foreign `Host` (DNS rebinding), a
missing or empty one, another site's `Origin`, CORS preflights, and JSON sent as `text/plain`;
against the real server on a free port (tests/fake_server.py)."""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest

from edge0.server.app import create_app
from edge0.server.config import ServerConfig
from edge0.server.hosts import HostGuard, host_name, normalize_host, normalize_origin
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server

KEY = "sk-hosts"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": FakeEngine.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
BODIES = {  # a valid body for each POST route, so only the guard can refuse it
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": FakeEngine.model_id, "prompt": "hi", "max_tokens": 8},
    "/v1/responses": {"model": FakeEngine.model_id, "input": "hi", "max_output_tokens": 8},
    "/v1/messages": {"model": FakeEngine.model_id, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
}
BODIES.update(
    {path.removeprefix("/v1"): BODIES[path] for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses")}
)
COUNTS = {
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
}  # generates nothing


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def url(engine):
    with running_server(engine, ServerConfig(api_key=KEY, allowed_hosts=("chat.lan",))) as base:
        yield base


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def flatten(routes):
    for route in routes:  # FastAPI keeps included routers as such (no prefixes here)
        if hasattr(route, "original_router"):
            yield from flatten(route.original_router.routes)
        else:
            yield route


def every_route(engine) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, path parameters filled in."""
    app = create_app(engine, ServerConfig())
    out = []
    for route in flatten(app.routes):
        path = re.sub(r"\{model_id(:path)?\}", FakeEngine.model_id, route.path)
        path = re.sub(r"\{name\}", "app.js", path)
        path = re.sub(r"\{[^}]+\}", "x", path)
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method != "HEAD":
                out.append((method, path))
    return out


def request(url: str, method: str, path: str, headers: dict) -> httpx.Response:
    body = {**BODIES, **COUNTS}.get(path) if method == "POST" else None
    return httpx.request(method, url + path, headers={**AUTH, **headers}, json=body, timeout=10, follow_redirects=False)


def raw(url: str, head: str) -> tuple[int, bytes]:
    """Send `head` (a request without body) as is; the status code and the body."""
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as s:
        s.sendall(head.encode("latin-1"))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def test_host_names_are_parsed_strictly():
    assert host_name("LocalHost:8080") == "localhost"
    assert host_name("[::1]:8080") == host_name("[::1]") == "[::1]"
    assert host_name("127.0.0.1") == "127.0.0.1"
    for bad in ["", " ", ":8080", "127.0.0.1:abc", "127.0.0.1:80:80", "[::1", "evil@127.0.0.1", "a/b", "[::1]x"]:
        assert host_name(bad) is None, bad
    assert normalize_host("::1") == "[::1]" and normalize_host("Chat.LAN:8080") == "chat.lan"
    assert normalize_origin("HTTP://LocalHost:3000/") == "http://localhost:3000"
    for bad in ["localhost:3000", "http://x/app", "null", "ftp://x", "http://u@x", "http://x?q"]:
        with pytest.raises(ValueError):
            normalize_origin(bad)


def test_a_foreign_host_is_refused_on_every_route(url, engine):
    before = len(engine.calls)
    routes = every_route(engine)
    paths = {p for _, p in routes}
    assert {"/", "/ui", "/ui/app.js", "/health", "/v1/stats", "/v1/models", "/openapi.json"} <= paths
    assert set(BODIES) <= paths
    for method, path in routes + [("GET", "/no/such/route")]:
        allowed = request(url, method, path, {})
        assert allowed.status_code == (404 if path == "/no/such/route" else 200), (method, path, allowed.text[:200])
        for host in ["evil.example", f"evil.example:{port_of(url)}", "localhost.evil.example", "127.0.0.1.nip.io"]:
            r = request(url, method, path, {"Host": host})
            assert r.status_code == 403, (method, path, host, r.status_code)
            body = r.json()
            error = body["error"]
            if path.startswith("/v1/messages"):
                assert body["type"] == "error" and error["type"] == "permission_error"
            else:
                assert error["code"] == "host_not_allowed"
            assert "--allowed-host" in error["message"] and host.split(":")[0] in error["message"]
            assert "access-control-allow-origin" not in r.headers
    assert len(engine.calls) - before == len(BODIES)  # the allowed POSTs generated; no refused one did


@pytest.mark.parametrize(
    "host", ["localhost", "LOCALHOST:{port}", "127.0.0.1", "127.0.0.1:{port}", "[::1]", "[::1]:{port}", "chat.lan:9"]
)
def test_loopback_names_and_allowed_hosts_are_answered(url, host):
    r = httpx.get(url + "/v1/stats", headers={**AUTH, "Host": host.format(port=port_of(url))}, timeout=10)
    assert r.status_code == 200 and r.json()["model"] == FakeEngine.model_id


@pytest.mark.parametrize(
    "head",
    [
        "GET /v1/stats HTTP/1.0\r\n\r\n",  # no Host at all (HTTP/1.0 allows it)
        "GET /v1/stats HTTP/1.0\r\nHost:\r\n\r\n",  # an empty Host: the bypass Ollama closed
        "GET /v1/stats HTTP/1.0\r\nHost: \r\n\r\n",
        "GET / HTTP/1.0\r\nHost: 127.0.0.1:abc\r\n\r\n",
    ],
)
def test_a_missing_empty_or_malformed_host_is_400(url, head):
    status, body = raw(url, head)
    assert status == 400
    assert json.loads(body)["error"]["code"] == "bad_host"


def test_http11_without_host_and_two_hosts_are_refused(url):
    """h11 refuses these before the app; the guard refuses them where a parser lets them through."""
    for head in [
        "GET /v1/stats HTTP/1.1\r\nConnection: close\r\n\r\n",
        "GET /health HTTP/1.0\r\nHost: localhost\r\nHost: evil.example\r\n\r\n",
    ]:
        assert raw(url, head)[0] == 400
    guard = HostGuard(None)
    scope = {"server": ("127.0.0.1", 8080), "headers": [(b"host", b"localhost"), (b"host", b"evil.example")]}
    assert guard.check(scope).status == 400
    assert guard.check({**scope, "headers": [(b"host", b"localhost:8080")]}) is None
    assert guard.check({**scope, "headers": []}).code == "bad_host"


def test_the_bound_address_is_a_host():
    """Bound to 127.0.0.2 the server answers to that address, which a server on 127.0.0.1 refuses."""
    with running_server(FakeEngine(), ServerConfig(), host="127.0.0.2") as base:
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        assert httpx.get(base + "/health", headers={"Host": "localhost"}, timeout=10).status_code == 200
    with running_server(FakeEngine(), ServerConfig()) as base:
        r = httpx.get(base + "/health", headers={"Host": "127.0.0.2"}, timeout=10)
        assert r.status_code == 403


def test_another_sites_origin_is_refused_and_the_own_page_is_not(url, engine):
    own = {"Origin": url}
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={**AUTH, **own}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    before = len(engine.calls)
    for origin in ["http://evil.example", "null", "http://localhost:1", url.replace("http:", "https:") + "0"]:
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={**AUTH, "Origin": origin}, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", origin
        assert "--cors-origin" in r.json()["error"]["message"]
        assert "access-control-allow-origin" not in r.headers
    assert len(engine.calls) == before  # refused before the engine saw them


def preflight(url: str, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return httpx.options(url + "/v1/chat/completions", headers=headers, timeout=10)


def test_a_preflight_gets_no_cors_allowance_by_default(url):
    r = preflight(url, "http://localhost:3000")
    assert r.status_code == 403
    assert not any(k.startswith("access-control-") for k in r.headers)


def test_cors_origin_allows_exactly_that_origin():
    config = ServerConfig(api_key=KEY, cors_origins=("http://localhost:3000",))
    with running_server(FakeEngine(), config) as base:
        r = preflight(base, "http://localhost:3000")  # answered without the key: a preflight carries none
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = httpx.post(
            base + "/v1/chat/completions",
            json=CHAT,
            headers={**AUTH, "Origin": "http://localhost:3000"},
            timeout=10,
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert r.json()["choices"][0]["message"]["content"] == "Echo: hi"
        r = httpx.post(base + "/v1/chat/completions", json=CHAT, headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = preflight(base, "http://localhost:3001")
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize(
    "content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded"]
)
def test_json_sent_as_a_simple_content_type_is_400(url, engine, path, content_type):
    """A page may POST text/plain to another site without a preflight; such a body is never parsed."""
    before = len(engine.calls)
    r = httpx.post(
        url + path,
        content=json.dumps(BODIES[path]).encode(),
        headers={**AUTH, "Content-Type": content_type},
        timeout=10,
    )
    assert r.status_code == 400
    body = r.json()
    message = body["error"]["message"]
    assert ("valid dictionary" in message or "object" in message) and len(engine.calls) == before


@pytest.mark.parametrize(
    "argv,field,expected",
    [
        (["--allowed-host", "Chat.LAN", "--allowed-host", "::1"], "allowed_hosts", ("chat.lan", "[::1]")),
        (["--cors-origin", "http://localhost:3000/"], "cors_origins", ("http://localhost:3000",)),
        ([], "allowed_hosts", ()),
        ([], "cors_origins", ()),
    ],
)
def test_serve_flags_fill_the_config(monkeypatch, tmp_path, argv, field, expected):
    from tests.test_server_engine import _serve_main

    ran = _serve_main(monkeypatch, tmp_path, argv)
    assert getattr(ran["app"].state.config, field) == expected


@pytest.mark.parametrize(
    "argv", [["--cors-origin", "localhost:3000"], ["--cors-origin", "http://x/app"], ["--allowed-host", "http://x/"]]
)
def test_bad_host_and_origin_flags_are_one_line_usage_errors(capsys, argv):
    from edge0.cli import serve

    with pytest.raises(SystemExit) as e:
        serve.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and argv[0] in err
