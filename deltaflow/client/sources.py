"""Adapt every supported source kind to one async iterator, with backpressure.

- async iterable: pulled directly, one item at a time, only when the streamer asks.
- iterable: pulled on a worker thread, so a blocking iterator (a file, a cursor) never blocks
  the event loop; each item is handed over as soon as it is read, and the worker reads at most
  a small chunk ahead. A list, tuple or range is already in memory and is chunked on the loop
  itself.
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
import operator
import threading
from collections.abc import AsyncIterable, AsyncIterator, Generator, Iterable, Iterator
from concurrent.futures import CancelledError as FutureCancelledError
from typing import Any

from ..columnar import is_arrow
from ..errors import UsageError

__all__ = ["SourceOverflowError", "aiter_source"]

# Items the worker reads ahead of a row source: a chunk is admitted at once, and the
# admission's per-partition runs grow with it (256 left runs of ~4 items at 64 partitions).
_CHUNK = 4096
# How often a stream waiting on a blocking source looks for items its worker has read.
_POLL = 0.005
#: Rows of Arrow batches the worker reads ahead (a chunk of an Arrow source).
_ARROW_AHEAD_ROWS = 65_536
_END: Any = object()
_second = operator.itemgetter(1)


class SourceOverflowError(UsageError):
    """An Observable emitting on the event loop outran the bounded source buffer."""


def aiter_source(source: Any, *, buffer: int) -> AsyncIterator[Any]:
    """An async iterator over ``source`` (async iterable, iterable or Observable; or one
    table: a pyarrow Table or RecordBatch, a pandas or polars DataFrame, each of whose rows is
    an item)."""
    if is_table(source):  # converted in the worker thread that reads the source
        return ChunkedIterator(_converted(source), blocking=not is_arrow(type(source)))
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
        return ChunkedIterator(iter(source), blocking=False)
    if isinstance(source, Iterable):
        return ChunkedIterator(iter(source))
    raise UsageError(
        f"source of type {type(source).__name__} is not an async iterable, an iterable or a "
        "reactivex Observable"
    )


def is_table(source: Any) -> bool:
    """Whether ``source`` is one table of rows: a pyarrow Table or RecordBatch, a pandas or
    polars DataFrame (by type name: neither library is imported for it)."""
    kind = type(source)
    module = kind.__module__.split(".", 1)[0]
    return is_arrow(kind) or (kind.__name__ == "DataFrame" and module in ("pandas", "polars"))


def _converted(source: Any) -> Iterator[Any]:
    """The table ``source`` as one pyarrow Table: Arrow as it is, a polars DataFrame by
    ``to_arrow()`` (zero-copy), a pandas DataFrame by ``pyarrow.Table.from_pandas`` (zero-copy
    for most numeric columns; a named index becomes a column)."""
    if is_arrow(type(source)):
        yield source
        return
    if type(source).__module__.startswith("polars"):
        yield source.to_arrow()
        return
    try:
        import pyarrow as pa
    except ImportError as exc:
        raise UsageError("streaming a pandas DataFrame needs pyarrow: pip install pyarrow") from exc
    yield pa.Table.from_pandas(source)


def _is_observable(source: Any) -> bool:
    try:
        from reactivex import Observable
    except ImportError:  # pragma: no cover - reactivex is a dependency
        return False
    return isinstance(source, Observable)


class ChunkedIterator:
    """Pulls a blocking iterator in chunks on a worker thread.

    The worker extends a deque straight from the source (C speed, each item visible as soon
    as it is read) while the loop pops from the other end, so a slow iterator's items are never
    held back until a chunk fills: the loop looks every ``_POLL`` seconds while it waits,
    instead of the worker paying a wake-up per item. A chunk (``_CHUNK`` items, or Arrow
    batches of ``_ARROW_AHEAD_ROWS`` rows) bounds how far the worker reads ahead; the next is
    read once the last is taken.

    Items taken from the source but not yet handed out are never lost: :meth:`leftovers`
    returns them (the stream reports them as not applied when it stops early).
    """

    def __init__(self, it: Iterator[Any], *, blocking: bool = True) -> None:
        self._it = it
        self._blocking = blocking
        # Appended by the worker, popped from the left by the loop: each deque operation is
        # atomic, so the two need no lock.
        self._chunk: collections.deque[Any] = collections.deque()
        self._pending: asyncio.Future[tuple[BaseException | None, bool]] | None = None
        self._reading = False  # while the worker runs (it clears this itself when done)
        self._stop: list[None] = []  # non-empty: the worker reads no further item
        self._exhausted = False
        # An error the source raised: handed out after the items read before it.
        self._error: BaseException | None = None

    def __aiter__(self) -> ChunkedIterator:
        return self

    async def __anext__(self) -> Any:
        while not self._chunk:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._exhausted:
                raise StopAsyncIteration
            if not self._blocking:
                await asyncio.sleep(0)  # one yield per chunk keeps the loop fair
                self._finish(self._read_chunk())
            else:
                await self._wait_for_items()
        return self._chunk.popleft()

    async def _wait_for_items(self) -> None:
        """Until the chunk under way ends or ``_POLL`` passes (start a chunk if none runs)."""
        pending = self._pending
        if pending is None:
            self._reading = True
            pending = self._pending = asyncio.ensure_future(asyncio.to_thread(self._read_chunk))
        # Not cancelled with us: a cancelled pull keeps its chunk for leftovers().
        await asyncio.wait((pending,), timeout=_POLL)
        if pending.done():
            self._pending = None
            self._finish(pending.result())

    def _read_chunk(self) -> tuple[BaseException | None, bool]:
        """Append up to ``_CHUNK`` items (Arrow batches: up to ``_ARROW_AHEAD_ROWS`` rows); returns
        the error the source raised, if any, and whether the source ended."""
        chunk = self._chunk
        try:
            for first in self._it:
                chunk.append(first)
                if is_arrow(type(first)):
                    return self._read_arrow(first.num_rows)
                # At C speed: before each item, whether leftovers() asked the worker to stop
                # (zip ends there without reading on); after it, a count of those read.
                stopped = iter(self._stop.__len__, 1)
                read = itertools.count(1)
                rest = zip(stopped, itertools.islice(self._it, _CHUNK - 1), read, strict=False)
                chunk.extend(map(_second, rest))
                return None, next(read) < _CHUNK
        except Exception as exc:  # noqa: BLE001 - the items read before it are kept
            return exc, True
        finally:
            self._reading = False
        return None, True

    def _read_arrow(self, rows: int) -> tuple[BaseException | None, bool]:
        """Read Arrow batches on, each handed out as it is read, while the stream has not
        taken the last one yet (it is busy) and until ``_ARROW_AHEAD_ROWS`` rows were: what
        a source that outpaces the stream yields meanwhile is admitted, and routed, together.
        A stream that keeps up takes each batch at once, and the worker stops there, as it
        did before: it does not wait in a slow source for a batch nobody asked for yet."""
        while rows < _ARROW_AHEAD_ROWS and self._chunk and not self._stop:
            item = next(self._it, _END)
            if item is _END:
                return None, True
            self._chunk.append(item)
            if not is_arrow(type(item)):
                return None, False  # the admission refuses it, naming it
            rows += item.num_rows
        return None, False

    def _finish(self, outcome: tuple[BaseException | None, bool]) -> None:
        self._error, self._exhausted = outcome

    def take_buffered(self) -> list[Any]:
        """The items already pulled and not yet handed out, all at once (no await): the pump
        admits a chunk in one go instead of awaiting each item."""
        chunk = self._chunk
        if self._reading:  # the worker may append meanwhile
            return [chunk.popleft() for _ in range(len(chunk))]
        items = list(chunk)
        chunk.clear()
        return items

    def put_back(self, items: list[Any]) -> None:
        """Return items taken with :meth:`take_buffered` but not admitted (they come first)."""
        self._chunk.extendleft(reversed(items))

    async def leftovers(self) -> list[Any]:
        """Items taken from the source and not handed out: the worker, if reading, stops after
        the item it is waiting for (a thread cannot be interrupted inside the iterator). A
        generator not read to its end is then closed, so its ``finally`` runs now."""
        if self._pending is not None:
            self._stop.append(None)
            # Not cancelled with us; a source error was (or will be) raised by anext.
            await asyncio.wait((self._pending,))
            self._pending = None
        if not self._exhausted and isinstance(self._it, Generator):
            self._it.close()
        return self.take_buffered()


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
