"""Where a node listens: its HTTP application (the routes it is given, the probes, and the
gate that answers 503 while it starts) bound to its host and port, with TLS if configured,
and what a connection may cost the node before it has proven anything.

Every accepted connection passes a :class:`ConnectionGuard`, a thin asyncio protocol in front
of aiohttp's:

- beyond the node's cap of open connections, or its remote address's, the connection is
  answered 503 and closed as it is accepted, before a byte of it is read;
- a request whose headers are not complete within ``header_timeout`` (of the accept, or of
  its first byte on a kept-alive connection) is answered 408 and closed;
- a kept-alive connection idle for ``idle_timeout`` is closed (aiohttp's keep-alive timeout);
- a handler may cap what a connection sends until it has proven itself
  (:meth:`ConnectionGuard.limit_reading`: a stranger's WebSocket until its hello passes).

The caps stay below the process's open-file limit (``RLIMIT_NOFILE``) by a reserve
(:func:`connection_caps`), so the node's own files and sockets never meet ``EMFILE``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from ..errors import UsageError
from .node_config import NodeConfig
from .probes import Readiness, starting_gate

__all__ = [
    "MIN_FILE_RESERVE",
    "ConnectionCaps",
    "ConnectionGuard",
    "Route",
    "connection_caps",
    "connection_guard",
    "listen",
]

log = logging.getLogger(__name__)

Route = tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]

#: File descriptors kept free of connections: the node's files, its peer calls, the engine.
MIN_FILE_RESERVE: Final = 128
#: Seconds between two warnings that a cap refuses connections.
_WARN_EVERY: Final = 10.0


@dataclass(frozen=True, slots=True)
class ConnectionCaps:
    """The caps a node applies: its settings, lowered to fit the open-file limit."""

    total: int
    per_address: int
    open_files: int | None  # the soft RLIMIT_NOFILE; None: unlimited


def connection_caps(
    max_connections: int, per_address: int, open_files: int | None = None
) -> ConnectionCaps:
    """The caps for the settings ``max_connections`` and ``per_address`` under an open-file
    limit (``open_files``; default: this process's soft ``RLIMIT_NOFILE``): the node cap keeps
    a quarter of the limit (at least :data:`MIN_FILE_RESERVE`) free for the node's own files,
    and one address gets at most half the node's cap, so it cannot lock out every other."""
    if open_files is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        open_files = None if soft == resource.RLIM_INFINITY else soft
    total = max_connections
    if open_files is not None:
        total = min(total, open_files - max(MIN_FILE_RESERVE, open_files // 4))
    total = max(total, 2)  # a node must be reachable at all, even under a tiny limit
    return ConnectionCaps(total, min(per_address, max(1, total // 2)), open_files)


def _refusal(status: str, message: str, retry: bool) -> bytes:
    """A whole HTTP response that closes the connection, written before any request is read."""
    body = json.dumps({"error": message}).encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
    if retry:
        head += "Retry-After: 1\r\n"
    head += f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


_HEADERS_OVERDUE: Final = _refusal(
    "408 Request Timeout", "the request's headers did not arrive in time", retry=False
)


class _Gate:
    """The open connections of one listener: counted, by address, and found by transport."""

    def __init__(self, node_id: str, caps: ConnectionCaps, header_timeout: float) -> None:
        self.node_id = node_id
        self.caps = caps
        self.header_timeout = header_timeout
        self._open: dict[asyncio.BaseTransport, ConnectionGuard] = {}
        self._per_address: dict[str, int] = {}
        self._warned = 0.0

    def admit(self, guard: ConnectionGuard, transport: asyncio.BaseTransport) -> bytes | None:
        """Count ``guard`` in, or the response that refuses it (over a cap)."""
        address = guard.address
        held = self._per_address.get(address, 0)
        if len(self._open) >= self.caps.total:
            return self._refuse(f"node {self.node_id} has {len(self._open)} connections open, "
                                f"its cap ({self.caps.total}); try again later")  # fmt: skip
        if held >= self.caps.per_address:
            return self._refuse(f"node {self.node_id} has {held} connections open from "
                                f"{address}, its cap per address ({self.caps.per_address}); "
                                "try again later")  # fmt: skip
        self._open[transport] = guard
        self._per_address[address] = held + 1
        return None

    def _refuse(self, message: str) -> bytes:
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY:  # one line per flood, not one per connection
            self._warned = now
            log.warning("%s: refusing connections (raise max_connections or "
                        "max_connections_per_address if they are clients)", message)  # fmt: skip
        return _refusal("503 Service Unavailable", message, retry=True)

    def release(self, transport: asyncio.BaseTransport) -> None:
        guard = self._open.pop(transport, None)
        if guard is not None:
            left = self._per_address[guard.address] - 1
            if left:
                self._per_address[guard.address] = left
            else:
                del self._per_address[guard.address]

    def guard_of(self, transport: asyncio.BaseTransport | None) -> ConnectionGuard | None:
        return self._open.get(transport) if transport is not None else None

    @property
    def open(self) -> int:
        return len(self._open)


class ConnectionGuard(asyncio.Protocol):
    """One accepted connection, in front of aiohttp's protocol for it: counted against the
    caps, its request headers on a deadline, and what it may send capped on demand."""

    def __init__(self, gate: _Gate, inner: asyncio.Protocol) -> None:
        self._gate = gate
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self.address = "?"
        self._admitted = False
        self._in_request = False  # a handler runs (its headers came whole)
        self._deadline: asyncio.TimerHandle | None = None
        self._budget: int | None = None  # bytes it may still send; None: no limit
        self._on_exceeded: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if peer else "?"
        refusal = self._gate.admit(self, transport)
        if refusal is not None:
            transport.write(refusal)
            transport.close()
            return
        self._admitted = True
        self._arm()
        self._inner.connection_made(transport)

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self._gate.header_timeout, self._headers_overdue)

    def _headers_overdue(self) -> None:
        self._deadline = None
        if not self._in_request and self._transport is not None:
            self._transport.write(_HEADERS_OVERDUE)
            self._transport.close()

    def request_started(self) -> None:
        """A request's headers came whole (its handler runs): no deadline while it runs."""
        self._in_request = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def request_done(self) -> None:
        """Its handler returned: the next request's headers are on a deadline from its first
        byte (until then the connection is idle: aiohttp's keep-alive timeout)."""
        self._in_request = False

    def limit_reading(self, budget: int, on_exceeded: Callable[[], None]) -> None:
        """From now on, take at most ``budget`` more bytes from the connection: past them,
        stop reading, drop what still arrives and call ``on_exceeded`` (once, from
        ``data_received``: it must not block)."""
        self._budget, self._on_exceeded = budget, on_exceeded

    def lift_reading_limit(self) -> None:
        """The connection proved itself: read it as any other."""
        self._budget = self._on_exceeded = None

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        if self._deadline is None and not self._in_request:
            self._arm()  # the first byte of the next request on a kept-alive connection
        if self._budget is not None:
            if len(data) > self._budget:
                data = data[: self._budget]
                self._exceeded()
            self._budget -= len(data)
        if data:
            self._inner.data_received(data)

    def _exceeded(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()  # aiohttp may resume it: what comes is dropped
        callback, self._on_exceeded = self._on_exceeded, None
        if callback is not None:
            callback()  # before the parser sees the bytes within the budget

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._admitted else None

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._transport is not None:
            self._gate.release(self._transport)
        if self._admitted:
            self._inner.connection_lost(exc)


_GATE: Final = web.AppKey("deltaflow-connections", _Gate)


def connection_guard(request: web.Request) -> ConnectionGuard | None:
    """The guard of the connection ``request`` came on (None: served without :func:`listen`)."""
    gate = request.app.get(_GATE)
    return gate.guard_of(request.transport) if gate is not None else None


def _requests_tracked(gate: _Gate) -> Middleware:
    """A middleware telling each connection's guard when its handler runs."""

    @web.middleware
    async def tracked(request: web.Request, handler: Handler) -> web.StreamResponse:
        guard = gate.guard_of(request.transport)
        if guard is not None:
            guard.request_started()
        try:
            return await handler(request)
        finally:
            if guard is not None:
                guard.request_done()

    return tracked


class _GuardedSite(web.BaseSite):
    """A TCP site whose every connection passes a :class:`ConnectionGuard` (aiohttp's
    ``TCPSite`` with the protocol factory wrapped)."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        gate: _Gate,
        *,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host, self._port, self._gate = host, port, gate

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        gate = self._gate
        self._server = await asyncio.get_running_loop().create_server(
            lambda: ConnectionGuard(gate, server()),
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            # The guard sees a TLS connection once its handshake is done: this bounds that.
            ssl_handshake_timeout=gate.header_timeout if self._ssl_context else None,
        )


async def listen(
    config: NodeConfig, routes: Sequence[Route], readiness: Readiness
) -> tuple[web.AppRunner, str, ssl.SSLContext | None]:
    """Serve ``routes`` with ``/healthz`` and ``/ready`` on the configured address: the
    runner (clean it up to stop), the address the node announces, and the TLS context its
    peer calls use (None without TLS).

    Raises:
        UsageError: the port is taken, or the address cannot be bound.
    """
    caps = connection_caps(config.max_connections, config.max_connections_per_address)
    if caps.total < config.max_connections:
        log.warning("node %s: at most %d connections (not max_connections=%d): the open-file "
                    "limit is %s; raise it (ulimit -n) to allow more", config.node_id,
                    caps.total, config.max_connections, caps.open_files)  # fmt: skip
    gate = _Gate(config.node_id, caps, config.header_timeout)
    # No endpoint reads a body beyond a few KiB (peer calls read theirs within a bound).
    app = web.Application(
        client_max_size=64 * 1024,
        middlewares=[_requests_tracked(gate), starting_gate(readiness)],
    )
    app[_GATE] = gate
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    app.router.add_get("/healthz", readiness.healthz)
    app.router.add_get("/ready", readiness.ready_handler)
    runner = web.AppRunner(
        app, access_log=None, shutdown_timeout=2.0, keepalive_timeout=config.idle_timeout
    )
    await runner.setup()
    tls = config.tls
    server_tls = peer_tls = None
    if tls is not None:  # reads the certificate files: off the event loop
        server_tls = await asyncio.to_thread(tls.server_context)
        peer_tls = await asyncio.to_thread(tls.peer_context)
    host, port = config.host, config.port
    site = _GuardedSite(runner, host, port, gate, ssl_context=server_tls)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        why = (
            "the port is in use (another node or program listens there); pick another with "
            "--port, or stop that one"
            if exc.errno == errno.EADDRINUSE
            else (exc.strerror or str(exc))
        )
        raise UsageError(f"node {config.node_id} cannot listen on {host}:{port}: {why}") from exc
    return runner, config.advertise or f"{host}:{runner.addresses[0][1]}", peer_tls
