"""One stream: pull the source, partition, accumulate, send, and account for every item."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import operator
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..columnar import ArrowRows, byte_offsets, is_arrow
from ..errors import (
    DataStreamerError,
    FrameTooLargeError,
    ItemFailedError,
    UsageError,
)
from ..partitioning import partition_many, partition_of, partition_table
from ..protocol import pack_item, pack_items
from .accumulator import Accumulator, Batch, SizeBatchCreator
from .latency import AckLatency
from .ledger import CommitPosition, Ledger, Watermark, locate
from .options import StreamerOptions
from .results import OnResult, ResultDispatcher
from .sender import NodeStatistics, Sender, StreamStoppedError
from .sources import _ChunkedIterator, aiter_source

if TYPE_CHECKING:
    from .client import Client

log = logging.getLogger(__name__)

__all__ = [
    "DEAD_LETTER_RECEIVER",
    "TABLE_RECEIVER",
    "CommitPosition",
    "Delete",
    "StreamStatistics",
    "StreamSummary",
    "run_stream",
]

#: Name of the built-in receiver that upserts into a Delta table (registered on every node).
TABLE_RECEIVER = "deltaflow.receivers.TableUpsert"
#: Name of the built-in receiver that appends failed items to a dead-letter table.
DEAD_LETTER_RECEIVER = "deltaflow.receivers.DeadLetter"


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
        items_dead_lettered: items written to the dead-letter table (``on_failure="fallback"``).
        batches_retried: batch resends after retriable errors.
        results: per-item results delivered to ``on_result``.
        duration: seconds from start to the last acknowledgement.
        per_node: acknowledged batches/items and errors by node id.
        ack_latency: quantiles of the seconds from a batch's first send to its
            acknowledgement (:class:`.AckLatency`).
    """

    stream_id: str
    items_sent: int
    items_acked: int
    items_failed: int
    items_dead_lettered: int
    batches_retried: int
    results: int
    duration: float
    per_node: dict[str, NodeStatistics]
    ack_latency: AckLatency = dataclasses.field(default_factory=AckLatency)

    @property
    def rows_per_second(self) -> float:
        return self.items_acked / self.duration if self.duration > 0 else 0.0


KeyFn = Callable[[Any], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamStatistics:
    """A snapshot of a running stream (``Client.statistics()``).

    Attributes:
        stream_id: the stream's id.
        pulled: items taken from the source so far.
        buffered: items waiting in partition buffers (not yet in a batch).
        in_flight: batches sent and not yet acknowledged.
        acked: items acknowledged as applied.
        failed: items that failed (or were dropped).
        dead_lettered: items written to the dead-letter table.
        retried: batch resends.
        commit_position: :class:`CommitPosition` count (contiguous settled prefix; tracked
            only when ``on_commit`` is given).
        per_node: per-node acknowledged batches/items and errors.
        ack_latency: quantiles of the ack latency so far (as :attr:`StreamSummary.ack_latency`).
    """

    stream_id: str
    pulled: int
    buffered: int
    in_flight: int
    acked: int
    failed: int
    dead_lettered: int
    retried: int
    commit_position: int
    per_node: dict[str, NodeStatistics]
    ack_latency: AckLatency = dataclasses.field(default_factory=AckLatency)


def key_function(key: str | Sequence[str] | KeyFn | None) -> KeyFn:
    """Turn ``key=`` (a column name, several, or a callable) into a function of an item."""
    if key is None:
        raise UsageError("key= is required: a column name, a tuple of column names, or a callable")
    if callable(key):
        return key
    if isinstance(key, str):
        return operator.itemgetter(key)
    columns = tuple(key)
    if not columns or not all(isinstance(c, str) for c in columns):
        raise UsageError(f"key= must name columns as strings, got {key!r}")
    # One column routes by its value, as ``key="id"`` does (and as the node's bucket column is
    # computed); several by the tuple of their values.
    return operator.itemgetter(*columns)


class StreamRun:
    """One call of ``stream_data``: the pump from source to sender, and the accounting."""

    def __init__(
        self,
        client: Client,
        *,
        receiver: str,
        receiver_args: Any,
        key: KeyFn,
        key_columns: Sequence[str] | None = None,
        on_result: OnResult | None,
        on_ack: Callable[[Sequence[Any]], Any] | None,
        on_commit: Callable[[CommitPosition], Any] | None,
        options: StreamerOptions,
        stream_id: str | None = None,
    ) -> None:
        self.client = client
        # A caller-chosen id (validated by the facade) makes a replay hit the same lane marks.
        self.sid = stream_id or uuid.uuid4().hex
        self.options = options
        self.key = key
        self.key_columns = list(key_columns) if key_columns is not None else None
        self.columnar: bool | None = None  # Arrow pages or row items; the first item decides
        self.on_ack = on_ack
        self.on_commit = on_commit
        self.partitions = client._partition_count()
        self.results = (
            ResultDispatcher(on_result, buffer=options.result_buffer, on_error=self._stop)
            if on_result is not None
            else None
        )
        self.ledger = Ledger()
        self.errors: list[BaseException] = []
        self.pulled = 0
        self.dead_lettered = 0
        self.watermark = Watermark()
        self.sender = Sender(
            client,
            sid=self.sid,
            receiver=(receiver, receiver_args),
            options=options,
            on_acked=self._acked,
            on_failed=self._failed,
            results=self.results.put if self.results is not None else None,
        )
        self.accumulator = Accumulator(
            batch_creator=options.batch_creator
            or SizeBatchCreator(
                page_size=options.page_size, max_batch_bytes=options.max_batch_bytes
            ),
            flush_interval=options.auto_flush_interval,
            on_cut=self.sender.submit,
            call_later=asyncio.get_running_loop().call_later,
            stagger=self.partitions if options.stagger_pages else 0,
        )
        self._dead_letters: Sender | None = None
        # Unique per run: a replay under the same stream id must not have its dead letters
        # skipped as already applied (their batches differ from the first run's).
        self._dead_letter_sid = f"{self.sid}-dl-{uuid.uuid4().hex[:12]}"
        self._task: asyncio.Task[Any] | None = None
        self._awaiting_source = False
        self._interrupted = False
        self._closing: asyncio.Future[None] | None = None
        self._dead_letter_seq: dict[int, int] = {}

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<StreamRun {self.sid} pulled={s.pulled} buffered={s.buffered} "
            f"in_flight={s.in_flight} acked={s.acked} failed={s.failed} retried={s.retried}>"
        )

    def statistics(self) -> StreamStatistics:
        c = self.sender.counters
        return StreamStatistics(
            stream_id=self.sid,
            pulled=self.pulled,
            buffered=len(self.accumulator),
            in_flight=c.in_flight,
            acked=c.acked_items,
            failed=c.failed_items,
            dead_lettered=self.dead_lettered,
            retried=c.retried_batches,
            commit_position=self.watermark.count,
            per_node=dict(c.per_node),
            ack_latency=c.ack_latency.summary(),
        )

    # -- outcomes of batches (synchronous, on the loop) ------------------------------------

    def _stop(self, exc: BaseException) -> None:
        """Fail the stream with ``exc``: send nothing new, stop waiting for the source."""
        first = not self.errors
        if first:
            self.errors.append(exc)
            # Nodes answer batches still queued behind a stuck one, so none is awaited until
            # its ack timeout.
            self._closing = asyncio.ensure_future(
                self.client._close_stream(self.sid, keep_results=True)
            )
        self.sender.stop()
        if self._awaiting_source and self._task is not None and not self._interrupted:
            # The pump is parked on an idle source; wake it (see the CancelledError in run()).
            self._interrupted = True
            self._task.cancel()

    def _acked(self, batch: Batch) -> None:
        rejected = batch.failures
        applied = batch
        if rejected:
            applied = batch.subset(i for i in range(len(batch.items)) if i not in rejected)
        if self.on_ack is not None and applied.items:
            try:
                self.on_ack(applied.items)
            except Exception as exc:  # noqa: BLE001 - the user's hook fails the stream
                self._stop(exc)
        self._settle(applied)
        if rejected:
            self._items_rejected(batch, rejected)

    def _items_rejected(self, batch: Batch, rejected: dict[int, str]) -> None:
        """Items the receiver marked failed (``ctx.fail``) follow ``on_failure`` on their own."""
        indexes = sorted(rejected)
        first = indexes[0]
        err = ItemFailedError(
            f"receiver rejected {len(indexes)} item(s) of partition {batch.partition} batch "
            f"{batch.seq}; first: source item #{batch.positions[first]} "
            f"(key {self._key_of(batch.items[first])!r}): {rejected[first]}",
            node=batch.node,
            details={"items": [[batch.positions[i], rejected[i]] for i in indexes]},
        )
        self._failed(batch.subset(indexes), err, reasons=[rejected[i] for i in indexes])

    def _settle(self, batch: Batch) -> None:
        # Tracked only when asked for: while one batch is slow, the positions settled after it
        # are held until it settles (bounded by what the window lets through meanwhile).
        if self.on_commit is None:
            return
        position = self.watermark.settle(batch.positions, batch.items)
        if position is not None:
            try:
                self.on_commit(position)
            except Exception as exc:  # noqa: BLE001 - the user's hook fails the stream
                self._stop(exc)

    def _failed(self, batch: Batch, exc: BaseException, reasons: list[str] | None = None) -> None:
        policy = self.options.on_failure
        stopping = isinstance(exc, (asyncio.CancelledError, StreamStoppedError))
        if not stopping and reasons is None:
            exc, reasons = locate(
                exc, batch.items, batch.positions, partition=batch.partition, key_of=self._key_of
            )
        if stopping or policy == "fail":
            if batch.attempts and stopping:
                self.ledger.doubt(batch.positions, batch.items)
            else:
                self.ledger.fail(batch.positions, batch.items, reasons)
            if not stopping:
                self._stop(exc)
            return
        if policy == "drop":
            log.warning(
                "stream %s dropped %d item(s) of partition %d: %s",
                self.sid,
                len(batch.items),
                batch.partition,
                exc,
            )
            self._settle(batch)
            return
        self._dead_letter(batch, exc, reasons)

    def _dead_letter(
        self, batch: Batch, exc: BaseException, reasons: list[str] | None = None
    ) -> None:
        """Send a failed batch's items, with its error, to the dead-letter table."""
        if self._dead_letters is None:
            self._dead_letters = Sender(
                self.client,
                sid=self._dead_letter_sid,
                receiver=(
                    DEAD_LETTER_RECEIVER,
                    {"table": self.options.dead_letter_table, "stream": self.sid},
                ),
                options=dataclasses.replace(self.options, on_failure="fail"),
                on_acked=self._dead_lettered,
                on_failed=self._dead_letter_failed,
                results=None,
            )
        code = getattr(exc, "code", type(exc).__name__)
        rows = [
            {
                "position": pos,
                "partition": batch.partition,
                "seq": batch.seq,
                "error_code": str(code),
                "error": (reasons[i] if reasons is not None else str(exc))[:2000],
                "node": getattr(exc, "node", None),
                "payload": packed,
                "deleted": i in batch.deletes,
            }
            for i, (pos, packed) in enumerate(
                zip(batch.positions, batch.packed_items(), strict=True)
            )
        ]
        seq = self._dead_letter_seq.get(batch.partition, 0)
        self._dead_letter_seq[batch.partition] = seq + 1
        dead = Batch(
            batch.partition,
            seq,
            items=batch.items,
            positions=batch.positions,
            packed=[pack_item(r) for r in rows],
        )
        dead.nbytes = sum(len(x) for x in dead.packed)
        self._dead_letters.submit(dead)

    def _dead_lettered(self, batch: Batch) -> None:
        self.dead_lettered += len(batch.items)
        self._settle(batch)

    def _dead_letter_failed(self, batch: Batch, exc: BaseException) -> None:
        stopping = isinstance(exc, (asyncio.CancelledError, StreamStoppedError))
        reason = None if stopping else f"its write to the dead-letter table failed: {exc}"
        self.ledger.fail(batch.positions, batch.items, [reason] * len(batch.items))
        if not stopping:
            self._stop(exc)

    def _key_of(self, item: Any) -> Any:
        """The routing key of a batch item, for messages (None if it has none)."""
        try:
            return self.key(item.item if isinstance(item, Delete) else item)
        except Exception:  # noqa: BLE001 - a message must not fail on a keyless item
            return None

    # -- the pump -----------------------------------------------------------------------

    def _admit(self, taken: list[Any], chunked: _ChunkedIterator | None) -> None:
        """Key, partition, pack and buffer items just taken from the source (synchronous).

        Raises:
            UsageError: an item cannot be sent; it is reported failed, the items before it are
                buffered, and those after it go back to the source's leftovers.
            FrameTooLargeError: an item alone is larger than ``max_batch_bytes``.
        """
        position = self.pulled
        values, deletes = taken, frozenset[int]()
        kinds = set(map(type, taken))
        if self.columnar is None and taken:
            self.columnar = is_arrow(type(taken[0]))
        if self.columnar:
            self._admit_arrow(taken, chunked)
            return
        # The item types are few: no Python-level pass over the chunk unless it holds a Delete.
        if any(issubclass(t, Delete) for t in kinds):
            values = [x.item if isinstance(x, Delete) else x for x in taken]
            deletes = frozenset(j for j, x in enumerate(taken) if isinstance(x, Delete))
        key, partitions = self.key, self.partitions
        try:
            parts = partition_many(map(key, values), partitions)
            packed = pack_items(values)
            bad, cause = None, None
        except Exception:  # noqa: BLE001 - find which item, below
            parts, packed, bad, cause = [], [], None, None
            for j, v in enumerate(values):
                try:
                    parts.append(partition_of(key(v), partitions))
                    packed.append(pack_item(v))
                except Exception as exc:  # noqa: BLE001 - reported below with the item
                    bad, cause = j, exc
                    break
        max_item = self.options.max_batch_bytes
        if max(map(len, packed), default=0) > max_item:
            big = next(j for j, data in enumerate(packed) if len(data) > max_item)
            if bad is None or big < bad:
                bad, cause = big, None
        good = len(taken) if bad is None else bad
        self.accumulator.add_many(
            position, taken[:good] if bad is not None else taken, parts, packed, deletes
        )
        self.pulled += good
        if bad is None:
            return
        if chunked is not None:
            chunked.put_back(taken[bad + 1 :])  # never sent: accounted as leftovers
        if cause is None:
            error: Exception = FrameTooLargeError(
                f"source item #{position + bad} packs to {len(packed[bad])} bytes, more than "
                f"StreamerOptions.max_batch_bytes={max_item}; split it or raise the limit"
            )
        else:
            error = UsageError(
                f"source item #{position + bad} cannot be sent ({cause!r}); items must be "
                "msgpack values (dict, list, str, int, float, bool, None, bytes, datetime, "
                "date, Decimal) and carry the key; a stream of row items cannot also carry "
                "Arrow batches"
            )
        self.ledger.fail([self.pulled], [taken[bad]], [str(error)])
        self.pulled += 1
        raise error from cause

    def _admit_arrow(self, taken: list[Any], chunked: _ChunkedIterator | None) -> None:
        """Route the rows of Arrow items taken from the source by their key columns and buffer
        them as pages (synchronous).

        Raises:
            UsageError: an item that is not Arrow in an Arrow stream (or the other way round),
                a key that is not column names, or a missing or bad column; the item is
                reported failed and the items after it go back to the source's leftovers.
        """
        import pyarrow as pa
        import pyarrow.compute as pc

        for j, item in enumerate(taken):
            try:
                if not is_arrow(type(item)):
                    raise UsageError(  # noqa: TRY301 - reported below with the item
                        "a stream carries row items or Arrow batches, not both; this one "
                        f"began with Arrow batches and then gave a {type(item).__name__}"
                    )
                if self.key_columns is None:
                    raise UsageError(  # noqa: TRY301
                        "Arrow batches are routed by key columns: pass key= as column names"
                    )
                rows = ArrowRows.of(item)
                missing = [k for k in self.key_columns if k not in rows.table.column_names]
                if missing:
                    raise UsageError(f"it lacks the key column(s) {missing}")  # noqa: TRY301
                parts = partition_table(rows.table, self.key_columns, self.partitions)
            except Exception as exc:
                error = UsageError(f"source item #{self.pulled} cannot be sent: {exc}")
                self.ledger.fail([self.pulled], [item], [str(error)])
                self.pulled += 1
                if chunked is not None:
                    chunked.put_back(taken[j + 1 :])
                raise error from exc
            if not len(rows):
                continue
            # One stable sort by partition, then a zero-copy slice per partition.
            order = pc.sort_indices(parts)
            runs = pc.run_end_encode(parts.take(order))
            rows = rows.take(order)
            positions = pc.add(order.cast(pa.int64()), self.pulled)
            offsets = byte_offsets(rows.table)
            start = 0
            for end, partition in zip(
                runs.run_ends.to_pylist(), runs.values.to_pylist(), strict=True
            ):
                length = end - start
                self.accumulator.add_rows(
                    partition,
                    rows.part(start, length),
                    positions.slice(start, length),
                    offsets[start : end + 1],
                )
                start = end
            self.pulled += len(rows)

    async def _linger(self, seconds: float) -> None:
        """Send the partly filled buffers once the source stayed idle for ``seconds``: checked
        every ``seconds``, so nothing is paid per item."""
        seen = -1
        while True:
            await asyncio.sleep(seconds)
            if (
                self._awaiting_source
                and self.pulled == seen
                and not self.errors
                and self.sender.has_room
            ):
                for batch in self.accumulator.drain():
                    self.sender.submit(batch)
            seen = self.pulled

    async def run(self, source: Any) -> StreamSummary:
        started = time.monotonic()
        options = self.options
        sender, acc = self.sender, self.accumulator
        items = aiter_source(source, buffer=options.source_buffer)
        chunked = items if isinstance(items, _ChunkedIterator) else None
        self._task = asyncio.current_task()
        lingering = (
            asyncio.create_task(self._linger(options.linger), name="deltaflow-linger")
            if options.linger > 0
            else None
        )
        try:
            while not self.errors:
                if not sender.has_room:
                    await sender.wait_for_room()
                    if self.errors:
                        break
                if self.results is not None and self.results.error is not None:
                    self.errors.append(self.results.error)
                    break
                self._awaiting_source = True
                try:
                    first = await anext(items)
                except StopAsyncIteration:
                    break
                finally:
                    self._awaiting_source = False
                # A blocking iterable is read on a worker: admit all it has read so far at
                # once (the window is checked per chunk; memory stays bounded by the chunk).
                taken = [first] if chunked is None else [first, *chunked.take_buffered()]
                self._admit(taken, chunked)
            if not self.errors:
                for batch in acc.drain():
                    sender.submit(batch)
            await sender.join()
            if self._dead_letters is not None:
                await self._dead_letters.join()
        except BaseException as exc:  # noqa: BLE001 - recorded in `errors`, re-raised below
            # Our own failure (bad item, subscriber error, cancellation): stop everything and
            # account for every item that did not make it.
            sender.stop()
            woken = (
                isinstance(exc, asyncio.CancelledError)
                and self._interrupted
                and self._task is not None
                and self._task.uncancel() == 0
            )  # our own wake-up from an idle source, not a cancellation of stream_data
            if not woken and not isinstance(exc, DataStreamerError):
                self.errors.insert(0, exc)
            dead = self._dead_letters
            if isinstance(exc, asyncio.CancelledError) and not woken:
                await sender.cancel()
                if dead is not None:
                    await dead.cancel()
            else:
                await sender.join()
                if dead is not None:
                    await dead.join()
        finally:
            if lingering is not None:
                lingering.cancel()
            # Each step runs whatever the one before raised: the items are accounted for, the
            # source closed and the nodes told, always.
            async with self._cleanup_step():
                for positions, buffered in acc.discard():
                    self.ledger.fail(positions, buffered)
            async with self._cleanup_step():
                if isinstance(items, _ChunkedIterator):
                    leftovers = await items.leftovers()  # taken from the source, never sent
                    self.ledger.fail(range(self.pulled, self.pulled + len(leftovers)), leftovers)
                    self.pulled += len(leftovers)
                elif hasattr(items, "aclose"):
                    await items.aclose()
            async with self._cleanup_step():
                if self._closing is not None:
                    await self._closing
            async with self._cleanup_step():
                await self.client._close_stream(self.sid)
                if self._dead_letters is not None:
                    await self.client._close_stream(self._dead_letter_sid)
        if self.results is not None:
            async with self._cleanup_step():
                await self.results.finish(self.errors[0] if self.errors else None)
            if self.results.error is not None and self.results.error not in self.errors:
                self.errors.insert(0, self.results.error)
        return self._outcome(time.monotonic() - started)

    @contextlib.asynccontextmanager
    async def _cleanup_step(self) -> AsyncIterator[None]:
        """Run one step of the stream's cleanup; what it raises becomes the stream's error
        (if it has none yet), never an escape past the steps after it."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - reported as the stream's cause, below
            log.warning("stream %s: cleanup failed: %r", self.sid, exc)
            if not self.errors:
                self.errors.append(exc)

    def _outcome(self, duration: float) -> StreamSummary:
        counters = self.sender.counters
        if self.errors:
            self.ledger.raise_outcome(self.errors[0], sid=self.sid, applied=counters.acked_items)
        return StreamSummary(
            stream_id=self.sid,
            items_sent=counters.sent_items,
            items_acked=counters.acked_items,
            items_failed=counters.failed_items - self.dead_lettered,
            items_dead_lettered=self.dead_lettered,
            batches_retried=counters.retried_batches,
            results=self.results.delivered if self.results is not None else 0,
            duration=duration,
            per_node=counters.per_node,
            ack_latency=counters.ack_latency.summary(),
        )


async def run_stream(client: Client, source: Any, **kwargs: Any) -> StreamSummary:
    """Stream ``source`` to the cluster; see :meth:`deltaflow.client.Client.stream_data`."""
    run = StreamRun(client, **kwargs)
    client._active[run.sid] = run
    try:
        return await run.run(source)
    finally:
        del client._active[run.sid]
