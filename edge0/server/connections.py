"""Connection limits under uvicorn: a cap on open connections, a timeout on request headers, the
descriptor limit the cap needs, and accept() errors logged once a minute instead of per attempt.

uvicorn alone accepts every connection and keeps an idle one open for as long as its client
likes: 2,100 idle connections used up the process's descriptors, and /health stopped answering.
Here a connection over the cap closes the oldest idle one (a connection between requests, or one
that has not finished sending its headers) to make room, so clients that are talking always
get in; when none is idle, the oldest one still sending its request body goes (16 sockets that
sent headers with a large Content-Length and nothing more locked every new client out); only when
every connection is busy with a request it has sent whole is the new one closed at once.
A stream that runs for minutes is busy, never idle, so no limit here cuts it.
"""

from __future__ import annotations

import logging
import resource
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("edge0.server")

# Descriptors the process needs besides its connections: store files, the thread pools' pipes,
# log files, the listening socket, libraries.
RESERVED_FDS = 512
ACCEPT_LOG_EVERY_S = 60.0


def connection_protocol(max_connections: int, header_timeout_s: float):
    """An h11 protocol class for uvicorn (its `http=`) that enforces the cap and the header timeout."""

    class Guarded(_Guarded):
        cap, header_timeout = max_connections, header_timeout_s

    return Guarded


class _Guarded(H11Protocol):
    cap: int
    header_timeout: float
    refused = evicted = header_timeouts = 0  # counted on the class: all connections together

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.opened = time.monotonic()
        self._header_timer = None
        if len(self.connections) > self.cap and not self._make_room():
            type(self).refused += 1
            transport.abort()
            return
        self._arm_header_timer()

    def _make_room(self) -> bool:
        """Close the oldest idle connection other than this one, else the oldest still sending its
        request body; False if there is neither."""
        others = [c for c in self.connections if c is not self and isinstance(c, _Guarded)]
        idle = [c for c in others if c.idle()] or [c for c in others if c.receiving()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.opened)
        type(self).evicted += 1
        self.connections.discard(oldest)  # counted out now: its connection_lost comes on the next loop turn
        oldest.transport.abort()
        return True

    def idle(self) -> bool:
        """No request in progress: before the first one's headers, or between requests."""
        return self.cycle is None or self.cycle.response_complete

    def receiving(self) -> bool:
        """A request whose body is still coming in, with no response started: the server has
        nothing of it to lose yet."""
        cycle = self.cycle
        return cycle is not None and cycle.more_body and not cycle.response_started

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.idle():
            self._cancel_header_timer()
        elif self._header_timer is None and not self.transport.is_closing():
            self._arm_header_timer()  # the first bytes of the next request: its headers are timed

    def on_response_complete(self) -> None:
        self._cancel_header_timer()  # uvicorn's keep-alive timeout runs until the next bytes come
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.idle() and not self.transport.is_closing():
            type(self).header_timeouts += 1
            self.transport.abort()


def connection_stats(protocol) -> dict:
    """The protocol class's counters, for /v1/stats."""
    return {
        "connections_refused": protocol.refused,
        "connections_evicted": protocol.evicted,
        "header_timeouts": protocol.header_timeouts,
    }


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft descriptor limit to what `max_connections` needs (mlx-lm lowers it to 2048 on
    import), up to the hard limit; returns the connections that fit, with a warning if fewer."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fits = max_connections if soft == resource.RLIM_INFINITY else max(1, min(max_connections, soft - RESERVED_FDS))
    if fits < max_connections:
        log.warning(
            "--max-connections %d: the descriptor limit (ulimit -n, hard %d) leaves room for %d; serving with %d",
            max_connections,
            hard,
            fits,
            fits,
        )
    return fits


class AcceptErrors:
    """An event-loop exception handler: errors of accept() (out of descriptors or memory) logged
    once per minute with how many there were, without a traceback; everything else as asyncio
    logs it."""

    def __init__(self, every_s: float = ACCEPT_LOG_EVERY_S):
        self.every_s, self.count, self.last = every_s, 0, -every_s

    def __call__(self, loop, context: dict) -> None:
        if "accept" not in context.get("message", ""):
            return loop.default_exception_handler(context)
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every_s:
            log.warning(
                "cannot accept connections: %s (%d times since the last report; --max-connections bounds "
                "the connections this server keeps open)",
                context.get("exception") or context["message"],
                self.count,
            )
            self.last, self.count = now, 0
