"""Where a node listens: its HTTP application (the routes it is given, the probes, and the
gate that answers 503 while it starts) bound to its host and port, with TLS if configured."""

from __future__ import annotations

import asyncio
import errno
import ssl
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from ..errors import UsageError
from .node_config import NodeConfig
from .probes import Readiness, starting_gate

__all__ = ["Route", "listen"]

Route = tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]


async def listen(
    config: NodeConfig, routes: Sequence[Route], readiness: Readiness
) -> tuple[web.AppRunner, str, ssl.SSLContext | None]:
    """Serve ``routes`` with ``/healthz`` and ``/ready`` on the configured address: the
    runner (clean it up to stop), the address the node announces, and the TLS context its
    peer calls use (None without TLS).

    Raises:
        UsageError: the port is taken, or the address cannot be bound.
    """
    # No endpoint reads a body beyond a few KiB (peer calls read theirs within a bound).
    app = web.Application(client_max_size=64 * 1024, middlewares=[starting_gate(readiness)])
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    app.router.add_get("/healthz", readiness.healthz)
    app.router.add_get("/ready", readiness.ready_handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    tls = config.tls
    server_tls = peer_tls = None
    if tls is not None:  # reads the certificate files: off the event loop
        server_tls = await asyncio.to_thread(tls.server_context)
        peer_tls = await asyncio.to_thread(tls.peer_context)
    host, port = config.host, config.port
    site = web.TCPSite(runner, host, port, ssl_context=server_tls)
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
