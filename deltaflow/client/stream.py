"""One stream: the pump from source to sender, and the account of every item's outcome.

Admission (:mod:`.admission`) puts the items pulled into partition buffers, the sender
(:mod:`.sender`) delivers the batches cut from them, the ledger (:mod:`.ledger`) records what
did not land and :mod:`.dead_letters` takes failed batches under ``on_failure="fallback"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from ..errors import DataStreamerError, ItemFailedError, SchemaError, UnknownReceiverError
from .accumulator import Accumulator, Batch, SizeBatchCreator
from .admission import Admission
from .dead_letters import DeadLetters
from .ledger import CommitPosition, Ledger, Watermark, locate
from .options import StreamerOptions
from .results import OnResult, ResultDispatcher
from .sender import Sender, StreamStoppedError
from .sources import ChunkedIterator, aiter_source
from .stream_types import Delete, KeyFn, StreamStatistics, StreamSummary

if TYPE_CHECKING:
    from .router import StreamRoutes

log = logging.getLogger(__name__)

#: Receivers every node serves: no need to ask.
BUILT_IN_RECEIVERS: Final = ("deltaflow.receivers.",)

__all__ = ["StreamRun", "run_stream"]


class StreamRun:
    """One call of ``stream_data``: the pump from source to sender, and the accounting.

    Args:
        router: routes the stream's batches, gives the partition count, and closes the
            stream on the nodes at its end.
        stream_key: the secret key the stream opens with on every node (see
            :mod:`.stream_keys`).
    """

    def __init__(
        self,
        router: StreamRoutes,
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
        stream_key: bytes,
    ) -> None:
        self.router = router
        self.receiver = receiver
        # A caller-chosen id (validated by the facade) makes a replay hit the same lane marks,
        # when it comes with the same key (see stream_keys).
        self.sid = stream_id or uuid.uuid4().hex
        self.options = options
        self.key = key
        self.on_ack = on_ack
        self.on_commit = on_commit
        self.partitions = router.partitions
        self.results = (
            ResultDispatcher(on_result, buffer=options.result_buffer, on_error=self._stop)
            if on_result is not None
            else None
        )
        self.ledger = Ledger()
        self.errors: list[BaseException] = []
        self.watermark = Watermark()
        self.sender = Sender(
            router,
            sid=self.sid,
            key=stream_key,
            receiver=(receiver, receiver_args),
            options=options,
            on_acked=self._acked,
            on_failed=self._failed,
            results=self.results.put if self.results is not None else None,
            random=stream_id is None,
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
        self.admission = Admission(
            key=key,
            key_columns=key_columns,
            partitions=self.partitions,
            max_batch_bytes=options.max_batch_bytes,
            accumulator=self.accumulator,
            ledger=self.ledger,
            quarantine=self._quarantine if options.on_bad_row == "quarantine" else None,
        )
        self.dead_letters = DeadLetters(
            router,
            sid=self.sid,
            options=options,
            ledger=self.ledger,
            settle=self._settle,
            stop=self._stop,
        )
        self.quarantined = 0  # rows sent to the dead-letter table by on_bad_row="quarantine"
        self.dropped_items = 0  # items of batches dropped under on_failure="drop"
        self.dropped_batches = 0
        self._task: asyncio.Task[Any] | None = None
        self._awaiting_source = False
        self._interrupted = False
        self._closing: asyncio.Future[None] | None = None

    @property
    def pulled(self) -> int:
        """Items taken from the source so far."""
        return self.admission.pulled

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
            dead_lettered=self.dead_letters.count,
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
                self.router.close_stream(self.sid, keep_results=True)
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
        """Items the receiver marked failed (``ctx.fail``) follow ``on_failure`` on their own;
        a table stream's rows quarantined (``on_bad_row="quarantine"``) go to the dead-letter
        table."""
        indexes = sorted(rejected)
        first = indexes[0]
        if self.options.on_bad_row == "quarantine":  # rows that did not fit the table
            self.quarantined += len(indexes)
            quarantined = SchemaError(
                f"quarantined {len(indexes)} row(s) of partition {batch.partition} batch "
                f"{batch.seq}",
                node=batch.node,
            )
            reasons = [
                f"source item #{batch.positions[i]} (key {self._key_of(batch.items[i])!r}): "
                f"{rejected[i]}"
                for i in indexes
            ]
            self.dead_letters.send(batch.subset(indexes), quarantined, reasons)
            return
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
            # The first drop is told at once, the rest summed up when the stream ends.
            self.dropped_batches += 1
            self.dropped_items += len(batch.items)
            log.log(
                logging.WARNING if self.dropped_batches == 1 else logging.DEBUG,
                "stream %s dropped %d item(s) of partition %d: %s%s",
                self.sid,
                len(batch.items),
                batch.partition,
                exc,
                " (further drops are summed up when the stream ends)"
                if self.dropped_batches == 1
                else "",
            )
            self._settle(batch)
            return
        self.dead_letters.send(batch, exc, reasons)

    def _quarantine(
        self,
        positions: list[int],
        items: list[Any],
        packed: list[bytes],
        deleted: list[bool],
        reasons: list[str],
    ) -> None:
        """Rows the client cannot route (their key cannot be read) go to the dead-letter
        table with ``partition`` and ``seq`` -1, as ``on_bad_row="quarantine"`` asks: in
        batches of at most ``page_size`` rows and a quarter of ``max_batch_bytes`` (a dead
        letter carries its row, reason and context)."""
        self.quarantined += len(items)
        error = SchemaError(f"quarantined {len(items)} row(s) the client cannot route")
        limit, budget = max(1, self.options.page_size), self.options.max_batch_bytes // 4
        start = 0
        while start < len(items):
            end, size = start, 0
            while end < len(items) and end - start < limit:
                size += len(packed[end]) + len(reasons[end]) + 256
                if size > budget and end > start:
                    break
                end += 1
            unrouted = Batch(
                zlib.crc32(packed[start]) % self.partitions,  # any: the stream is random
                -1,
                items=items[start:end],
                positions=positions[start:end],
                packed=packed[start:end],
                deletes=[j - start for j in range(start, end) if deleted[j]],
            )
            self.dead_letters.send(unrouted, error, reasons[start:end], routed=False)
            start = end

    def _key_of(self, item: Any) -> Any:
        """The routing key of a batch item, for messages (None if it has none)."""
        try:
            return self.key(item.item if isinstance(item, Delete) else item)
        except Exception:  # noqa: BLE001 - a message must not fail on a keyless item
            return None

    # -- the pump -----------------------------------------------------------------------

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
        chunked = items if isinstance(items, ChunkedIterator) else None
        self._task = asyncio.current_task()
        lingering = (
            asyncio.create_task(self._linger(options.linger), name="deltaflow-linger")
            if options.linger > 0
            else None
        )
        if not self.receiver.startswith(BUILT_IN_RECEIVERS):
            # Every live node serves the receiver before anything is sent: a stream during a
            # rolling restart that adds it must not half apply, then fail on the others.
            try:
                await self.router.await_receiver(self.receiver, options.receiver_wait)
            except UnknownReceiverError as exc:
                self.errors.append(exc)
        try:
            while not self.errors:
                if not sender.has_room:
                    await sender.wait_for_room()
                    if self.errors:
                        break
                if not self.dead_letters.has_room:  # quarantined rows count against it too
                    await self.dead_letters.wait_for_room()
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
                self.admission.admit(taken, chunked)
            if not self.errors:
                for batch in acc.drain():
                    sender.submit(batch)
            await sender.join()
            await self.dead_letters.join()
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
            # The dead-letter sender after the main one: a batch failing while the main sender
            # winds down may start it only then.
            if isinstance(exc, asyncio.CancelledError) and not woken:
                await sender.cancel()
                await self.dead_letters.cancel()
            else:
                await sender.join()
                await self.dead_letters.join()
        finally:
            if lingering is not None:
                lingering.cancel()
            # Each step runs whatever the one before raised: the items are accounted for, the
            # source closed and the nodes told, always.
            async with self._cleanup_step():
                for positions, buffered in acc.discard():
                    self.ledger.fail(positions, buffered)
            async with self._cleanup_step():
                if isinstance(items, ChunkedIterator):
                    leftovers = await items.leftovers()  # taken from the source, never sent
                    self.admission.leftovers(leftovers)
                elif hasattr(items, "aclose"):
                    await items.aclose()
            async with self._cleanup_step():
                if self._closing is not None:
                    await self._closing
            async with self._cleanup_step():
                await self.router.close_stream(self.sid)
                if self.dead_letters.started:
                    await self.router.close_stream(self.dead_letters.sid)
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
        if self.dropped_batches > 1:
            log.warning(
                "stream %s dropped %d item(s) in %d batches in all (on_failure='drop')",
                self.sid,
                self.dropped_items,
                self.dropped_batches,
            )
        if self.errors:
            self.ledger.raise_outcome(self.errors[0], sid=self.sid, applied=counters.acked_items)
        return StreamSummary(
            stream_id=self.sid,
            items_sent=counters.sent_items,
            items_acked=counters.acked_items,
            # Rows quarantined before they were sent are not among the sender's failures.
            items_failed=(
                counters.failed_items - self.dead_letters.count + self.dead_letters.unrouted
            ),
            items_dead_lettered=self.dead_letters.count,
            items_quarantined=self.quarantined,
            batches_retried=counters.retried_batches,
            results=self.results.delivered if self.results is not None else 0,
            duration=duration,
            per_node=counters.per_node,
            ack_latency=counters.ack_latency.summary(),
        )


async def run_stream(
    router: StreamRoutes, active: MutableMapping[str, StreamRun], source: Any, **kwargs: Any
) -> StreamSummary:
    """Stream ``source`` to the cluster, registered in ``active`` (by stream id) while it runs;
    see :meth:`deltaflow.client.Client.stream_data`."""
    run = StreamRun(router, **kwargs)
    active[run.sid] = run
    try:
        return await run.run(source)
    finally:
        del active[run.sid]
