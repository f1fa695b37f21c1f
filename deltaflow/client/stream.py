"""One stream: pull the source, partition, accumulate, send, and account for every item."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import DataStreamerError, FrameTooLargeError, UsageError
from ..partitioning import partition_of
from ..protocol import pack_item
from .accumulator import Accumulator, Batch
from .options import StreamerOptions
from .results import OnResult, ResultDispatcher
from .sender import NodeStatistics, Sender
from .sources import aiter_source

if TYPE_CHECKING:
    from .client import Client

__all__ = ["TABLE_RECEIVER", "Delete", "StreamSummary", "run_stream"]

#: Name of the built-in receiver that upserts into a Delta table (registered on every node).
TABLE_RECEIVER = "deltaflow.receivers.TableUpsert"


@dataclass(frozen=True, slots=True)
class Delete:
    """Marks an item as a delete of its key (Ignite 3's REMOVE operation).

    For a table stream, ``item`` is a row holding at least the key columns; for a custom
    receiver, whatever the receiver expects. A delete is ordered with the upserts of its key.
    """

    item: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamSummary:
    """What a finished stream did.

    Attributes:
        stream_id: the id the nodes saw (in their logs and metrics).
        items_sent: items pulled from the source and sent at least once.
        items_acked: items acknowledged as applied.
        items_failed: items not applied (dropped under ``on_failure="drop"``).
        batches_retried: batch resends after retriable errors.
        results: per-item results delivered to ``on_result``.
        duration: seconds from start to the last acknowledgement.
        per_node: acknowledged batches/items and errors by node id.
    """

    stream_id: str
    items_sent: int
    items_acked: int
    items_failed: int
    batches_retried: int
    results: int
    duration: float
    per_node: dict[str, NodeStatistics]

    @property
    def rows_per_second(self) -> float:
        return self.items_acked / self.duration if self.duration > 0 else 0.0


KeyFn = Callable[[Any], Any]


def key_function(key: str | Sequence[str] | KeyFn | None) -> KeyFn:
    """Turn ``key=`` (a column name, several, or a callable) into a function of an item."""
    if key is None:
        raise UsageError("key= is required: a column name, a tuple of column names, or a callable")
    if callable(key):
        return key
    if isinstance(key, str):
        column = key

        def by_column(item: Any) -> Any:
            return item[column]

        return by_column
    columns = tuple(key)
    if not columns or not all(isinstance(c, str) for c in columns):
        raise UsageError(f"key= must name columns as strings, got {key!r}")
    return lambda item: tuple(item[c] for c in columns)


async def run_stream(
    client: Client,
    source: Any,
    *,
    receiver: str,
    receiver_args: Any,
    key: KeyFn,
    on_result: OnResult | None,
    on_ack: Callable[[list[Any]], Any] | None = None,
    options: StreamerOptions,
) -> StreamSummary:
    """Stream ``source`` to the cluster; see :meth:`deltaflow.client.Client.stream_data`."""
    started = time.monotonic()
    sid = uuid.uuid4().hex
    loop = asyncio.get_running_loop()
    partitions = client._partition_count()
    results = (
        ResultDispatcher(on_result, buffer=options.result_buffer) if on_result is not None else None
    )
    failed: list[tuple[int, Any]] = []
    errors: list[BaseException] = []

    def on_failed(batch: Batch, exc: BaseException) -> None:
        failed.extend(zip(batch.positions, batch.items, strict=True))
        if options.on_failure == "fail" and not errors:
            errors.append(exc)
            sender.stop()

    sender = Sender(
        client,
        sid=sid,
        receiver=(receiver, receiver_args),
        options=options,
        on_acked=(lambda batch: on_ack(batch.items)) if on_ack is not None else (lambda b: None),
        on_failed=on_failed,
        results=results.put if results is not None else None,
    )
    acc = Accumulator(
        page_size=options.page_size,
        max_batch_bytes=options.max_batch_bytes,
        flush_interval=options.auto_flush_interval,
        on_timer_cut=sender.submit,
        call_later=loop.call_later,
    )
    max_item = options.max_batch_bytes
    items = aiter_source(source, buffer=options.source_buffer)
    position = 0
    try:
        while not errors:
            await sender.wait_for_room()
            if errors:
                break
            if results is not None and results.error is not None:
                errors.append(results.error)
                break
            try:
                item = await anext(items)
            except StopAsyncIteration:
                break
            is_delete = isinstance(item, Delete)
            value = item.item if is_delete else item
            try:
                p = partition_of(key(value), partitions)
                packed = pack_item(value)
            except Exception as exc:
                failed.append((position, item))
                raise UsageError(
                    f"source item #{position} cannot be sent ({exc!r}); items must be msgpack "
                    "values (dict, list, str, int, float, bool, None, bytes, datetime) and carry "
                    "the key"
                ) from exc
            if len(packed) > max_item:
                failed.append((position, item))
                # Handled below like every other failure: stop the sender, account for items.
                raise FrameTooLargeError(  # noqa: TRY301
                    f"source item #{position} packs to {len(packed)} bytes, more than "
                    f"StreamerOptions.max_batch_bytes={max_item}; split it or raise the limit"
                )
            for batch in acc.add(p, position, item, packed, is_delete):
                sender.submit(batch)
            position += 1
        if not errors:
            for batch in acc.drain():
                sender.submit(batch)
        await sender.join()
    except BaseException as exc:  # noqa: BLE001 - recorded in `errors`, re-raised below
        # Our own failure (bad item, subscriber error, cancellation): stop everything and
        # account for every item that did not make it.
        sender.stop()
        if not isinstance(exc, DataStreamerError):
            errors.insert(0, exc)
        await sender.cancel() if isinstance(exc, asyncio.CancelledError) else await sender.join()
    finally:
        for batch in acc.discard():
            failed.extend(zip(batch.positions, batch.items, strict=True))
        if hasattr(items, "aclose"):
            await items.aclose()
        await client._close_stream(sid)
    if results is not None:
        await results.finish(errors[0] if errors else None)
        if results.error is not None and results.error not in errors:
            errors.insert(0, results.error)

    counters = sender.counters
    duration = time.monotonic() - started
    if errors:
        if isinstance(errors[0], asyncio.CancelledError):
            raise errors[0]
        failed.sort(key=lambda pair: pair[0])
        cause = errors[0]
        raise DataStreamerError(
            f"stream {sid} failed: {cause}; {len(failed)} item(s) not applied "
            f"({counters.acked_items} applied)",
            [item for _, item in failed],
            cause,
        ) from cause
    return StreamSummary(
        stream_id=sid,
        items_sent=counters.sent_items,
        items_acked=counters.acked_items,
        items_failed=counters.failed_items,
        batches_retried=counters.retried_batches,
        results=results.delivered if results is not None else 0,
        duration=duration,
        per_node=counters.per_node,
    )
