"""Connection factories that break real connections as a network would, for
:func:`deltaflow.connect`'s ``connection_factory``: one cuts connections after a number of
batch sends, the other loses requests."""

from __future__ import annotations

import asyncio
from typing import Any

from ..client.connection import Connection
from ..errors import ConnectionLostError

__all__ = ["ConnectionDropper", "RequestDropper"]


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
        self._cuts: set[asyncio.Task[None]] = set()

    async def __call__(self, address: str, **kwargs: Any) -> Connection:
        conn = await Connection.open(address, **kwargs)
        if self.dropped >= self.limit:
            return conn
        original = conn.start_batch  # every batch send goes through it
        sent = 0

        async def cut() -> None:
            await conn._outbox.drain()  # on the wire, then the connection goes
            conn._abort_transport()

        def start_batch(frame: dict[str, Any], *, timeout: float) -> asyncio.Future[Any]:
            nonlocal sent
            sent += 1
            answer = original(frame, timeout=timeout)
            if sent == self.after_batches and self.dropped < self.limit:
                self.dropped += 1
                task = asyncio.ensure_future(cut())
                self._cuts.add(task)
                task.add_done_callback(self._cuts.discard)
            return answer

        conn.start_batch = start_batch  # type: ignore[method-assign]
        return conn


class RequestDropper:
    """Opens real connections and loses every ``every``-th batch request on the way: the frame
    is never sent, so no ack comes and the client's ``ack_timeout`` expires, as on a lossy
    network. (Use a short ``StreamerOptions.ack_timeout`` with it.) A batch is never lost twice
    in a row: with ``every`` batches of a lane resent in lock-step, the stride could otherwise
    lose the one the others wait for on every resend, until the client gives up.

    Attributes:
        dropped: requests lost so far (counted across all connections it opened).
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.sent = 0
        self.dropped = 0
        self._lost: set[tuple[Any, ...]] = set()  # batches whose last send was lost

    async def __call__(self, address: str, **kwargs: Any) -> Connection:
        conn = await Connection.open(address, **kwargs)
        original = conn.start_batch  # every batch send goes through it

        def lost(answer: asyncio.Future[Any], timeout: float) -> None:
            if not answer.done():
                answer.set_exception(
                    ConnectionLostError(
                        f"no ack from {address} within {timeout}s (request lost by "
                        "deltaflow.testing)"
                    )
                )

        def start_batch(frame: dict[str, Any], *, timeout: float) -> asyncio.Future[Any]:
            self.sent += 1
            batch = (frame.get("sid"), frame.get("p"), frame.get("seq"))
            if self.sent % self.every == 0 and batch not in self._lost:
                self._lost.add(batch)
                self.dropped += 1
                answer = asyncio.get_running_loop().create_future()
                asyncio.get_running_loop().call_later(timeout, lost, answer, timeout)
                return answer  # the ack that never comes
            self._lost.discard(batch)
            return original(frame, timeout=timeout)

        conn.start_batch = start_batch  # type: ignore[method-assign]
        return conn
