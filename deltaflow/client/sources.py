"""Adapt every supported source kind to one async iterator, with backpressure.

- async iterable: pulled directly, one item at a time, only when the streamer asks.
- iterable: pulled in small chunks on a worker thread, so a blocking iterator (a file, a
  cursor) never blocks the event loop; a list, tuple or range is already in memory and is
  chunked on the loop itself.
- reactivex Observable: subscribed on a dedicated thread and bridged through a bounded queue.
  ``on_next`` called off the event loop blocks the emitting thread while the queue is full (real
  backpressure); ``on_next`` called *on* the event loop cannot block, so overflowing the queue
  fails the stream with :class:`SourceOverflowError` (emit from another thread, or raise
  ``StreamerOptions.source_buffer``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from concurrent.futures import CancelledError as FutureCancelledError
from typing import Any

from ..columnar import is_arrow
from ..errors import UsageError

__all__ = ["SourceOverflowError", "aiter_source"]

_CHUNK = 256
_END = object()


class SourceOverflowError(UsageError):
    """An Observable emitting on the event loop outran the bounded source buffer."""


def aiter_source(source: Any, *, buffer: int) -> AsyncIterator[Any]:
    """An async iterator over ``source`` (async iterable, iterable or Observable)."""
    if isinstance(source, AsyncIterable):
        return source.__aiter__()
    if _is_observable(source):
        return _ObservableBridge(source, buffer).__aiter__()
    if isinstance(source, (str, bytes, dict)):
        raise UsageError(
            f"source is a {type(source).__name__}; pass an iterable of items (e.g. a list of rows)"
        )
    if isinstance(source, (list, tuple, range)):
        # Already in memory: nothing can block, so no worker thread (a hop per chunk).
        return _ChunkedIterator(iter(source), blocking=False)
    if isinstance(source, Iterable):
        return _ChunkedIterator(iter(source))
    raise UsageError(
        f"source of type {type(source).__name__} is not an async iterable, an iterable or a "
        "reactivex Observable"
    )


def _is_observable(source: Any) -> bool:
    try:
        from reactivex import Observable
    except ImportError:  # pragma: no cover - reactivex is a dependency
        return False
    return isinstance(source, Observable)


class _ChunkedIterator:
    """Pulls a blocking iterator in chunks on a worker thread.

    Items taken from the source but not yet handed out are never lost: :meth:`leftovers`
    returns them (the stream reports them as not applied when it stops early).
    """

    def __init__(self, it: Iterator[Any], *, blocking: bool = True) -> None:
        self._it = it
        self._blocking = blocking
        self._chunk: collections.deque[Any] = collections.deque()
        self._pending: asyncio.Future[tuple[list[Any], BaseException | None, bool]] | None = None
        self._exhausted = False
        # An error the source raised: handed out after the items read before it.
        self._error: BaseException | None = None

    def __aiter__(self) -> _ChunkedIterator:
        return self

    async def __anext__(self) -> Any:
        if not self._chunk:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._exhausted:
                raise StopAsyncIteration
            if not self._blocking:
                await asyncio.sleep(0)  # one yield per chunk keeps the loop fair
                self._take(self._read_chunk())
            else:
                if self._pending is None:
                    self._pending = asyncio.ensure_future(asyncio.to_thread(self._read_chunk))
                # Shielded: a cancelled pull keeps its chunk for the next call or leftovers().
                chunk = await asyncio.shield(self._pending)
                self._pending = None
                self._take(chunk)
            if not self._chunk:
                return await self.__anext__()  # the end, or the source's error
        return self._chunk.popleft()

    def _read_chunk(self) -> tuple[list[Any], BaseException | None, bool]:
        """Up to ``_CHUNK`` items (an Arrow batch, which holds many rows, alone), the error the
        source raised after them if any, and whether the source ended."""
        items: list[Any] = []
        try:
            for first in self._it:
                items.append(first)
                if is_arrow(type(first)):
                    return items, None, False
                items.extend(itertools.islice(self._it, _CHUNK - 1))
                break
        except Exception as exc:  # noqa: BLE001 - the items read before it are kept
            return items, exc, True
        return items, None, len(items) < _CHUNK

    def _take(self, chunk: tuple[list[Any], BaseException | None, bool]) -> None:
        items, error, ended = chunk
        self._chunk.extend(items)
        self._exhausted = ended
        self._error = error

    def take_buffered(self) -> list[Any]:
        """The items already pulled and not yet handed out, all at once (no await): the pump
        admits a chunk in one go instead of awaiting each item."""
        items = list(self._chunk)
        self._chunk.clear()
        return items

    def put_back(self, items: list[Any]) -> None:
        """Return items taken with :meth:`take_buffered` but not admitted (they come first)."""
        self._chunk.extendleft(reversed(items))

    async def leftovers(self) -> list[Any]:
        """Items taken from the source and not handed out (waits for a pull under way)."""
        if self._pending is not None:
            items, _, _ = await self._pending  # a source error was (or will be) raised by anext
            self._chunk.extend(items)
            self._pending = None
        items = list(self._chunk)
        self._chunk.clear()
        return items


class _ObservableBridge:
    def __init__(self, observable: Any, buffer: int) -> None:
        self._observable = observable
        self._buffer = buffer

    async def __aiter__(self) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=self._buffer)
        loop_thread = threading.get_ident()
        stopped = threading.Event()
        waits: set[Any] = set()
        overflow: list[BaseException] = []

        def push(value: Any) -> None:
            if stopped.is_set():
                return
            if threading.get_ident() == loop_thread:
                try:
                    queue.put_nowait(value)
                except asyncio.QueueFull:
                    overflow.append(
                        SourceOverflowError(
                            f"the Observable emitted more than {self._buffer} items on the event "
                            "loop thread without yielding; emit from another thread (e.g. "
                            "subscribe_on a thread pool) or raise StreamerOptions.source_buffer"
                        )
                    )
                    stopped.set()
                return
            fut = asyncio.run_coroutine_threadsafe(queue.put(value), loop)
            waits.add(fut)
            if stopped.is_set():  # stopped while we registered: nobody will cancel it for us
                fut.cancel()
            try:
                fut.result()  # blocks the emitting thread while the buffer is full
            except FutureCancelledError:
                pass
            finally:
                waits.discard(fut)

        def on_error(exc: Exception) -> None:
            push(("error", exc))

        observer_args = {
            "on_next": lambda v: push(("item", v)),
            "on_error": on_error,
            "on_completed": lambda: push(("end", None)),
        }
        holder: dict[str, Any] = {}

        def subscribe() -> None:
            holder["sub"] = self._observable.subscribe(**observer_args)

        thread = threading.Thread(target=subscribe, name="deltaflow-observable", daemon=True)
        thread.start()
        try:
            while True:
                if overflow:
                    raise overflow[0]
                kind, value = await queue.get()
                if kind == "item":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            stopped.set()
            for fut in list(waits):
                fut.cancel()
            sub = holder.get("sub")
            if sub is not None:
                sub.dispose()
