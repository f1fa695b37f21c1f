"""Seams for fault injection and test receivers, shipped so users can test like we do.

- :class:`ConnectionDropper`: a ``connection_factory`` for :func:`deltaflow.connect` that cuts
  real connections after a number of batch frames, as a network failure would.
- :class:`Echo`, :class:`EchoStream`, :class:`FailOn`, :class:`AppendRows`: receivers to
  register on a node (``--receiver deltaflow.testing.Echo``) for smoke tests of a deployment.
- ``DELTAFLOW_FAULT_KILL_AFTER_COMMIT=N`` in a node's environment: the node SIGKILLs itself
  right after its N-th table commit, before acknowledging it (crash between commit and ack).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from .client.connection import Connection
from .errors import ConnectionLostError, OverloadedError
from .receivers.base import Receiver, ReceiverContext

__all__ = [
    "AppendRows",
    "ConnectionDropper",
    "Discard",
    "Echo",
    "EchoStream",
    "FailOn",
    "RequestDropper",
]


class ConnectionDropper:
    """Opens real connections, and aborts each one's socket after ``after_batches`` batch sends.

    The batch that trips the limit is sent first, so the node may apply it while the client
    never sees the ack: exactly the lost-ack case resends must survive.

    Attributes:
        dropped: connections cut so far.
        limit: how many connections to cut at most (later ones are left alone).
    """

    def __init__(self, after_batches: int, *, limit: int = 1) -> None:
        self.after_batches = after_batches
        self.limit = limit
        self.dropped = 0

    async def __call__(self, address: str, **kwargs: Any) -> Connection:
        conn = await Connection.open(address, **kwargs)
        if self.dropped >= self.limit:
            return conn
        original = conn.send_batch
        sent = 0

        async def send_batch(frame: dict[str, Any], *, timeout: float) -> dict[str, Any]:
            nonlocal sent
            sent += 1
            if sent == self.after_batches and self.dropped < self.limit:
                self.dropped += 1
                await conn._send(frame)
                conn._abort_transport()
            return await original(frame, timeout=timeout)

        conn.send_batch = send_batch  # type: ignore[method-assign]
        return conn


class RequestDropper:
    """Opens real connections and loses every ``every``-th batch request on the way: the frame
    is never sent, so no ack comes and the client's ``ack_timeout`` expires, as on a lossy
    network. (Use a short ``StreamerOptions.ack_timeout`` with it.)

    Attributes:
        dropped: requests lost so far (counted across all connections it opened).
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.sent = 0
        self.dropped = 0

    async def __call__(self, address: str, **kwargs: Any) -> Connection:
        conn = await Connection.open(address, **kwargs)
        original = conn.send_batch

        async def send_batch(frame: dict[str, Any], *, timeout: float) -> dict[str, Any]:
            self.sent += 1
            if self.sent % self.every == 0:
                self.dropped += 1
                await asyncio.sleep(timeout)  # the ack that never comes
                raise ConnectionLostError(
                    f"no ack from {address} within {timeout}s (request lost by deltaflow.testing)"
                )
            return await original(frame, timeout=timeout)

        conn.send_batch = send_batch  # type: ignore[method-assign]
        return conn


class Discard(Receiver):
    """Accepts every item and does nothing (a no-op receiver, for load tests)."""

    async def receive(self, items: list[Any], ctx: ReceiverContext) -> None:
        return None


class Echo(Receiver):
    """Returns each item as its result."""

    async def receive(self, items: list[Any], ctx: ReceiverContext) -> list[Any]:
        return items


class EchoStream(Receiver):
    """Yields each item as its result as it goes (an async-generator receiver)."""

    async def receive(  # type: ignore[override]
        self, items: list[Any], ctx: ReceiverContext
    ) -> AsyncIterator[Any]:
        for item in items:
            yield item


class FailOn(Receiver):
    """Returns items like :class:`Echo`, but raises on an item equal to ``args["fail_on"]``.

    ``args["retriable"]`` true raises a retriable error instead (the client resends), but only
    the first ``args.get("times", 1)`` times on this node.
    """

    raised = 0

    async def receive(self, items: list[Any], ctx: ReceiverContext) -> list[Any]:
        args = ctx.args or {}
        if args.get("fail_on") in items:
            if args.get("retriable"):
                if FailOn.raised < args.get("times", 1):
                    FailOn.raised += 1
                    raise OverloadedError("injected retriable failure")
            else:
                raise ValueError(f"injected failure on item {args['fail_on']!r}")
        return items


class AppendRows(Receiver):
    """Appends every item (a row) to the table ``args["table"]``: not idempotent by itself,
    so it shows that resent batches are not applied twice."""

    async def receive(self, items: list[Any], ctx: ReceiverContext) -> None:
        await ctx.table(ctx.args["table"]).append(items)
