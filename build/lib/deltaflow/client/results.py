"""Per-stream result dispatch: a bounded queue between the connection reader and the subscriber.

A slow subscriber fills the queue, which makes the reader wait, which slows the node's sends:
memory stays bounded by ``StreamerOptions.result_buffer``. A subscriber that raises stops the
dispatcher; the stream then fails with that error.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any, Protocol, cast

__all__ = ["OnResult", "ResultDispatcher"]

#: A callable (sync or async) taking one result, or a reactivex Observer (``on_next``...).
OnResult = Callable[[Any], Any] | Any

_DONE = object()


class _Observer(Protocol):
    """The part of a reactivex Observer the dispatcher calls."""

    def on_next(self, value: Any) -> Any: ...
    def on_completed(self) -> Any: ...
    def on_error(self, error: BaseException) -> Any: ...


class ResultDispatcher:
    """Delivers result values to ``on_result`` in arrival order on its own task."""

    def __init__(
        self,
        on_result: OnResult,
        *,
        buffer: int,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._observer: _Observer | None = (
            cast(_Observer, on_result) if hasattr(on_result, "on_next") else None
        )
        fn = self._observer.on_next if self._observer is not None else on_result
        if not callable(fn):
            raise TypeError("on_result must be a callable or a reactivex Observer")
        self._fn: Callable[[Any], Any] = fn
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=buffer)
        self.delivered = 0
        self.error: BaseException | None = None
        self._failed = asyncio.Event()
        self._on_error = on_error
        self._task = asyncio.create_task(self._run(), name="deltaflow-results")

    async def put(self, values: list[Any]) -> None:
        """Queue values (waits while the buffer is full; drops them once the subscriber failed)."""
        queue = self._queue
        for value in values:
            if self.error is not None:
                return
            if not queue.full():  # the common case: no task, no wait
                queue.put_nowait(value)
                continue
            put = asyncio.ensure_future(queue.put(value))
            failed = asyncio.ensure_future(self._failed.wait())
            try:
                await asyncio.wait((put, failed), return_when=asyncio.FIRST_COMPLETED)
            finally:
                put.cancel()
                failed.cancel()

    async def _run(self) -> None:
        while True:
            value = await self._queue.get()
            if value is _DONE:
                return
            try:
                out = self._fn(value)
                if inspect.isawaitable(out):
                    await out
                self.delivered += 1
            # Whatever the subscriber raises stops delivery and becomes the stream's error.
            except Exception as exc:  # noqa: BLE001
                self.error = exc
                self._failed.set()
                if self._on_error is not None:
                    self._on_error(exc)
                return

    async def finish(self, error: BaseException | None) -> None:
        """Deliver what is queued, then signal the Observer's completion or error."""
        if self.error is None:
            await self.put([_DONE])
            await self._task
        else:
            self._task.cancel()
        if self._observer is not None:
            final = error or self.error
            if final is None:
                self._observer.on_completed()
            else:
                self._observer.on_error(final)
