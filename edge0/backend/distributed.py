"""mx.distributed behind narrow functions: the group of ranks started by `mlx.launch` (ring
backend), point-to-point messages between pipeline stages and an all-gather of short byte strings
(a stage's model setup: backend/stages.py)."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import select
import signal
import socket
import stat
import sys
import threading
import time

import mlx.core as mx
import numpy as np

from edge0.errors import Edge0Error

LAUNCH = "mlx.launch -n N --backend ring --hostfile HOSTS.json -- edge0 ..."


def launched() -> bool:
    """True in a process that mlx.launch started."""
    return "MLX_RANK" in os.environ


def _hosts() -> list:
    """The ring's addresses from the hostfile mlx.launch wrote ([] for a single process)."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return []
    try:
        text = open(path).read().strip()
        return json.loads(text) if text else []
    except (OSError, ValueError) as e:
        raise Edge0Error(
            f"MLX_HOSTFILE {path}: unreadable ring hostfile ({e}); start the ranks with {LAUNCH}"
        ) from None


def init_group(timeout: float):
    """The group of all ranks (ring backend; None when mlx.launch started only one), or an
    Edge0Error when the peers cannot be reached.

    MLX's ring set-up blocks in accept() with the GIL held, so a Python thread cannot time it
    out; SIGALRM interrupts the accept instead. A rank that connects rather than accepts gives up
    after MLX's own retries (about 31 s), whatever `timeout` says."""
    if not os.environ.get("MLX_HOSTFILE"):
        raise Edge0Error("edge0 runs across machines with MLX's ring backend only; start the ranks with " + LAUNCH)
    hosts = _hosts()
    if len(hosts) < 2:
        return None
    rank = int(os.environ["MLX_RANK"])
    if threading.current_thread() is not threading.main_thread():
        raise Edge0Error("a distributed engine is loaded from the main thread (its peer timeout uses SIGALRM)")
    t0 = time.monotonic()
    previous = signal.signal(signal.SIGALRM, lambda *_: None)  # the signal only interrupts accept()
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return mx.distributed.init(strict=True, backend="ring")
    except RuntimeError as e:
        peers = ", ".join(a for r, addrs in enumerate(hosts) if r != rank for a in addrs)
        raise Edge0Error(
            f"rank {rank} of {len(hosts)}: could not reach its peers at {peers} in "
            f"{time.monotonic() - t0:.0f} s ({e}); "
            f"start every rank ({LAUNCH}) and check the hostfile's addresses"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def ring_sockets() -> list[int]:
    """File descriptors of the ring's connections (TCP sockets to or from a hostfile address).
    MLX's ring receive busy-polls, a full core per waiting rank; a rank that expects a message
    blocks in select() on these first and then receives it (MLX still carries every byte)."""
    addrs = set()
    for rank in _hosts():
        for a in rank:
            ip, _, port = a.rpartition(":")
            addrs.add((ip, int(port)))
    fds = []
    for fd in range(3, min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 4096)):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as s:
                ends = {s.getsockname()[:2], s.getpeername()[:2]}
        except OSError:  # not open, or a socket that is not connected (the ring's listener)
            continue
        if ends & addrs:
            fds.append(fd)
    return fds


_TCP_MAX_S = 32767  # Linux's bound on the keepalive idle time and interval
_TCP_RXT_CONNDROPTIME = 0x80  # macOS (netinet/tcp.h): seconds of retransmission before a connection drops


def keep_alive(fds: list[int], timeout: float) -> str | None:
    """Let the kernel find a peer machine that is gone without closing its connections (asleep,
    off the network, powered off): TCP keepalive probes on the ring's idle connections, the first
    after half of `timeout` seconds of silence and the connection dropped once three go unanswered
    (about `timeout` in all), and data sent but not acknowledged for `timeout` seconds drops it
    too (Linux's TCP_USER_TIMEOUT, macOS's TCP_RXT_CONNDROPTIME). The rank waiting on such a
    connection then fails like one whose peer exited. A peer process that is alive but stuck still
    answers at the kernel level: not found this way. Best effort: returns why it could not (None
    when it did), which the pipeline's stats show."""
    idle, interval = min(_TCP_MAX_S, max(1, int(timeout / 2))), min(_TCP_MAX_S, max(1, int(timeout / 6)))
    try:
        for fd in fds:
            with socket.socket(fileno=os.dup(fd)) as s:  # the same connection as MLX's descriptor
                s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                idle_option = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))  # macOS
                if idle_option is not None:
                    s.setsockopt(socket.IPPROTO_TCP, idle_option, idle)
                for name, value in (("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3)):
                    if hasattr(socket, name):
                        s.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
                if hasattr(socket, "TCP_USER_TIMEOUT"):
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, min(2**31 - 1, int(timeout * 1000)))
                elif sys.platform == "darwin":
                    s.setsockopt(socket.IPPROTO_TCP, _TCP_RXT_CONNDROPTIME, min(2**31 - 1, int(timeout)))
    except OSError as e:
        return f"TCP keepalive not set on the ring's connections ({e}): a silent peer machine is not detected"
    return None


def keep_alive_settings(fds: list[int]) -> list[dict]:
    """What `keep_alive` set on each connection, as the kernel reports it."""
    out = []
    for fd in fds:
        with socket.socket(fileno=os.dup(fd)) as s:
            got = {"keepalive": s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)}
            for name in ("TCP_KEEPIDLE", "TCP_KEEPALIVE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT"):
                if hasattr(socket, name):
                    got[name] = s.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
            out.append(got)
    return out


class Heartbeat:
    """Each rank tells the others it is alive several times a second: UDP datagrams to their
    ring addresses (UDP ports are apart from the ring's TCP ones), tagged with the launch's
    hostfile. A rank waiting for a message asks `silent()` which peer it has not heard from for
    `timeout` seconds: a process stopped or stuck while its machine, whose kernel still answers
    TCP keepalives, is up. MLX releases the GIL while it computes, so a rank busy with a long
    prompt still beats. A peer never heard from (a firewall that passes the ring's TCP but not
    UDP) is not judged: its silence says nothing (`unheard` names it for the stats)."""

    def __init__(self, timeout: float):
        hosts, self.rank = _hosts(), int(os.environ["MLX_RANK"])
        self.timeout, self.interval = timeout, max(0.05, min(0.5, timeout / 10))
        self.peers = {r: _address(h[0]) for r, h in enumerate(hosts) if r != self.rank}
        self.tag = hashlib.sha256(json.dumps(hosts).encode()).hexdigest()[:16].encode()
        self.heard: dict[int, float | None] = dict.fromkeys(self.peers)  # None: never heard
        self.stopped = threading.Event()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind(_address(hosts[self.rank][0]))
        except OSError:
            self.sock.close()
            raise
        self.sock.settimeout(self.interval)
        self.thread = threading.Thread(target=self._run, name="edge0-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        beat = self.tag + b" %d" % self.rank
        due = 0.0
        while not self.stopped.is_set():
            now = time.monotonic()
            if now >= due:
                for addr in self.peers.values():
                    self._send(beat, addr)
                due = now + self.interval
            try:
                data = self.sock.recv(64)
            except OSError:  # the timeout, or the socket closed by stop()
                continue
            tag, _, rank = data.partition(b" ")
            if tag == self.tag and rank.isdigit() and int(rank) in self.heard:
                first = self.heard[int(rank)] is None
                self.heard[int(rank)] = time.monotonic()
                if first:  # our beats so far may have come before it listened: one now, or it may
                    self._send(beat, self.peers[int(rank)])  # be stopped before our next and never hear us

    def _send(self, beat: bytes, addr) -> None:
        try:
            self.sock.sendto(beat, addr)
        except OSError:  # the peer's machine unreachable now: its silence will tell
            pass

    def silent(self) -> int | None:
        """A peer rank heard from before but not for `timeout` seconds now, or None."""
        now = time.monotonic()
        return next((r for r, t in sorted(self.heard.items()) if t is not None and now - t > self.timeout), None)

    def unheard(self) -> list[int]:
        """The peer ranks never heard from."""
        return sorted(r for r, t in self.heard.items() if t is None)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=2 * self.interval + 1)
        self.sock.close()


def _address(text: str) -> tuple[str, int]:
    ip, _, port = text.rpartition(":")
    return ip, int(port)


def wait_for_message(fds: list[int], heartbeat: Heartbeat | None = None) -> None:
    """Block (without using the CPU) until one of the ring's connections has data; an Edge0Error
    when a peer's heartbeat stops meanwhile."""
    while not select.select(fds, [], [], 0.5 if heartbeat else None)[0]:
        silent = heartbeat.silent()
        if silent is not None:
            raise Edge0Error(
                f"rank {silent} sent no heartbeat for {heartbeat.timeout:g} s (--peer-timeout): it is stopped or "
                "stuck while its machine still answers; stop it (its own output may say why) and start every rank again"
            )


def all_gather_bytes(group, data: bytes) -> list[bytes]:
    """Every rank's `data` (all the same length), in rank order."""
    out = mx.distributed.all_gather(mx.array(np.frombuffer(data, dtype=np.uint8)), group=group)
    flat = bytes(np.array(deliver(out)))
    return [flat[i * len(data) : (i + 1) * len(data)] for i in range(group.size())]


def deliver(x):
    """Evaluate messages (sends, receives, collectives); a lost peer becomes an Edge0Error."""
    try:
        mx.eval(x)
    except RuntimeError as e:
        if "[ring]" in str(e):
            raise Edge0Error(
                f"lost a peer rank ({e}): another rank exited or its machine is unreachable; its own output says why"
            ) from None
        raise
    return x


def send(x, dst: int, group):
    """Send `x` to rank `dst` now (returns when it is handed to the transport)."""
    deliver(mx.distributed.send(x, dst, group=group))


def recv(shape, dtype: str, src: int, group):
    """Receive an array of `shape` and `dtype` from rank `src` (blocks until it arrives)."""
    return deliver(mx.distributed.recv(tuple(shape), getattr(mx, dtype), src, group=group))


def int_array(values) -> mx.array:
    return mx.array(np.asarray(values, dtype=np.int32))
