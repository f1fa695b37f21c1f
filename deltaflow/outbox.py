"""The outbox: frames waiting to go out on one WebSocket, joined into fewer messages, with
backpressure on their senders. Client and node both send through one (see ``docs/protocol.md``,
"Transport")."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Final

__all__ = ["COALESCE_BYTES", "QUEUE_HIGH_WATER", "Outbox"]

#: Frames queued in one event-loop turn share a message up to this size; larger ones go alone.
#: Joining saves a system call and a wake-up per small frame; for large frames it saves next
#: to nothing, costs a copy, and the receiver cannot start on the first frame until the whole
#: message arrived.
COALESCE_BYTES: Final = 128 * 1024
#: An :class:`Outbox` makes its senders wait while more than this many bytes are queued.
QUEUE_HIGH_WATER: Final = 4 * 1024 * 1024


class Outbox:
    """Frames waiting to go out on one WebSocket, written one message at a time, in order.

    The first frame of an event-loop turn given to :meth:`send` is written at once (no added
    latency for a lone frame). Frames sent while a write is running, later in the same turn, or
    with :meth:`send_nowait`, queue up and are written by the outbox's task: with ``multi``
    (both sides listed the capability) joined into messages of up to ``limit`` bytes, else one
    message each. Fewer messages mean fewer system calls and wake-ups per batch on both ends.

    :meth:`send` waits while more than :data:`QUEUE_HIGH_WATER` bytes are queued, so a peer
    that stops reading slows its senders down instead of growing memory. :meth:`send_nowait`
    queues without waiting, for callers that need no task of their own per frame (a batch sent
    from the code that cut it, an ack sent from the lane that applied it); they check
    :attr:`has_room` first and wait with :meth:`wait_for_room` when it is False.

    Args:
        write: sends one message.
        multi: several frames may share a message.
        on_error: called with what ``write`` raised. The frames still queued behind a failed
            write are dropped (the connection is gone; its owner fails whatever waited on them).
        limit: the largest message that joins frames: :data:`COALESCE_BYTES`, or the peer's
            frame limit if lower. A frame alone may be larger (its sender checks it).
    """

    def __init__(
        self,
        write: Callable[[bytes], Awaitable[None]],
        *,
        multi: bool,
        on_error: Callable[[BaseException], None],
        limit: int = COALESCE_BYTES,
    ) -> None:
        self._write = write
        self._multi = multi
        self._limit = min(limit, COALESCE_BYTES)
        self._on_error = on_error
        self._queue: collections.deque[bytes] = collections.deque()
        self._queued_bytes = 0
        self._task: asyncio.Task[None] | None = None
        self._hot = False  # a frame went out at once in this loop turn
        self._idle = asyncio.Event()  # no write is running
        self._idle.set()
        self._room = asyncio.Event()  # the queue is below its high-water mark
        self._room.set()

    async def send(self, data: bytes) -> None:
        """Send one encoded frame (see the class). Never raises a write's error: that goes to
        ``on_error``."""
        if self._task is None and not self._hot and self._idle.is_set():
            self._hot = True
            asyncio.get_running_loop().call_soon(self._cool)
            await self._write_one(data)
            return
        self.send_nowait(data)
        await self.wait_for_room()

    def send_nowait(self, data: bytes) -> None:
        """Queue one encoded frame for the outbox's task, which writes it (with the others of
        this turn) on the next loop turn. Never waits: the caller checks :attr:`has_room`."""
        self._queue.append(data)
        self._queued_bytes += len(data)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush())
        if self._queued_bytes > QUEUE_HIGH_WATER:
            self._room.clear()

    @property
    def has_room(self) -> bool:
        """At most :data:`QUEUE_HIGH_WATER` bytes are queued: a frame may be added now."""
        return self._room.is_set()

    async def wait_for_room(self) -> None:
        """Wait while more than :data:`QUEUE_HIGH_WATER` bytes are queued."""
        while not self._room.is_set():
            await self._room.wait()

    def _cool(self) -> None:
        self._hot = False

    async def drain(self) -> None:
        """Wait until every frame sent so far was written (or its write failed)."""
        while self._task is not None or not self._idle.is_set():
            if self._task is not None:
                await asyncio.shield(self._task)
            else:  # an immediate write waiting for the socket to drain
                await self._idle.wait()

    async def _write_one(self, data: bytes) -> bool:
        """Write one message after any write still running; False if it failed."""
        while not self._idle.is_set():
            await self._idle.wait()
        self._idle.clear()
        try:
            await self._write(data)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- reported to the owner, which fails the waiters
            self._on_error(exc)
            return False
        finally:
            self._idle.set()
        return True

    async def _flush(self) -> None:
        queue = self._queue
        try:
            while queue:
                data = queue.popleft()
                taken = len(data)
                if self._multi and queue and len(data) < self._limit:
                    parts = [data]
                    while queue and taken + len(queue[0]) <= self._limit:
                        taken += len(queue[0])
                        parts.append(queue.popleft())
                    data = b"".join(parts)
                self._queued_bytes -= taken
                if self._queued_bytes <= QUEUE_HIGH_WATER:
                    self._room.set()
                if not await self._write_one(data):
                    break
        finally:
            queue.clear()  # empty unless a write failed or the task was cancelled
            self._queued_bytes = 0
            self._room.set()
            self._task = None
