"""The sender: delivers cut batches to partition owners inside a bounded window, with retries.

A batch's first send needs no task of its own (see :class:`Sender`). ``wait_for_room`` is
what the stream awaits before pulling the next source item, so the source is not pulled while
``max_in_flight`` batches are outstanding.
Retries use tenacity (exponential backoff with jitter) and resend the *same* sequence number,
so the owner applies each batch once and in order. The decision to retry is
:func:`deltaflow.errors.is_retriable`, nothing else. Partitions are routed to connections by
a :class:`~deltaflow.client.router.Routes`.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from ..columnar import ArrowRows, encode_page
from ..errors import (
    LaneFailedError,
    NotOwnerError,
    ProtocolError,
    TransportError,
    is_retriable,
)
from ..protocol import LANE_WINDOW, Frame, join_items
from .accumulator import Batch
from .handoff import Handoff
from .latency import LatencyHistogram
from .options import StreamerOptions

if TYPE_CHECKING:
    from .connection import Connection, ResultSink
    from .router import Routes

__all__ = ["NodeStatistics", "Sender", "StreamStoppedError"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeStatistics:
    """Per-node counters of one stream (``StreamSummary.per_node``).

    Attributes:
        batches_acked: batches the node acknowledged.
        items_acked: their items.
        errors: errors naming this node after which a batch was resent.
    """

    batches_acked: int = 0
    items_acked: int = 0
    errors: int = 0


@dataclass(slots=True)
class _Counters:
    sent_items: int = 0
    acked_items: int = 0
    failed_items: int = 0
    retried_batches: int = 0
    in_flight: int = 0
    per_node: dict[str, NodeStatistics] = field(default_factory=dict)
    ack_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


class Sender:
    """Sends the batches of one stream.

    A batch is sent as soon as the window (``max_in_flight``) and its partition's lane
    (``per_partition_in_flight``) have room, in cut order, and from the code that makes the
    room: :meth:`submit`, or the settling of an earlier batch. That first send needs no task:
    the frame goes into the connection's outbox at once and a callback takes the answer (a
    task per batch would cost more than the send). A batch whose first send cannot start that
    way (no connection yet, the stream not open on it yet, a full outbox, its partition's
    sends still at a previous owner) or failed goes on a task of its own, which retries with
    tenacity.

    A batch is also held back while it is ``LANE_WINDOW`` or more past its partition's lowest
    unsettled batch (its ``base``), which nodes would refuse: after a lost ack, say.

    Args:
        routes: routes partitions to connections and keeps the partition map fresh.
        sid: the stream id.
        key: the stream's secret key, sent when the stream opens on a connection.
        receiver: receiver name and arguments declared when the stream opens on a connection.
        options: window, retry and timeout settings.
        on_acked: called with each acknowledged batch.
        on_failed: called with a batch whose retries are exhausted and the error.
        results: where result frames of this stream go, or None.
    """

    def __init__(
        self,
        routes: Routes,
        *,
        sid: str,
        key: bytes,
        receiver: tuple[str, Any],
        options: StreamerOptions,
        on_acked: Callable[[Batch], None],
        on_failed: Callable[[Batch, BaseException], None],
        results: ResultSink | None,
        random: bool = False,
    ) -> None:
        self._routes = routes
        self._sid = sid
        self._key = key
        self._random = random  # the id was made up here: see ``open_stream``
        self._receiver = receiver
        self._options = options
        self._on_acked = on_acked
        self._on_failed = on_failed
        self._results = results
        # The window and the lanes are counters, not semaphores: they are taken and given back
        # synchronously. Batches waiting for the window, in cut order:
        self._waiting: collections.deque[Batch] = collections.deque()
        self._window_used = 0
        self._lane_used: dict[int, int] = {}
        # Batches holding a window slot while their partition's lane is full or they are past
        # its window (FIFO per lane), and batches just handed a lane slot, sent by ``_start``.
        self._lane_waiting: dict[int, collections.deque[Batch]] = {}
        self._ready: collections.deque[Batch] = collections.deque()
        self._starting = False
        # Sequence numbers of each partition not yet settled: the smallest is the ``base`` a
        # batch frame carries, so a new owner knows every lower batch is already acknowledged.
        self._unacked: dict[int, set[int]] = {}
        # Which node each partition's sends are under way to: two nodes never hold batches
        # of one lane at once.
        self._handoff = Handoff()
        self._unsettled = 0
        self._answers: set[asyncio.Future[Frame]] = set()  # first sends awaiting their answer
        self._tasks: set[asyncio.Task[None]] = set()  # sends that have to wait, and resends
        self._room = asyncio.Event()
        self._room.set()
        self._all_settled = asyncio.Event()
        self._all_settled.set()
        self._stopped = False
        self._cancelled = False
        self.counters = _Counters()

    def submit(self, batch: Batch) -> None:
        """Take a cut batch (synchronous): it is sent now if the window and its lane have
        room, else as soon as they do."""
        self._unacked.setdefault(batch.partition, set()).add(batch.seq)
        self._unsettled += 1
        if self._unsettled >= self._options.max_in_flight:
            self._room.clear()
        self._all_settled.clear()
        self._waiting.append(batch)
        self._start()

    @property
    def has_room(self) -> bool:
        return self._room.is_set()

    async def wait_for_room(self) -> None:
        await self._room.wait()

    def stop(self) -> None:
        """Send nothing new: batches not yet on the wire fail with the stream's error."""
        self._stopped = True

    async def join(self) -> None:
        """Wait until every submitted batch is acked or failed."""
        while self._unsettled:
            await self._all_settled.wait()

    async def cancel(self) -> None:
        """Settle every batch as cancelled: those not sent yet are not applied, those sent are
        in doubt (the node may still apply them)."""
        # Also answers already in and not yet handled: a failed one is not resent (_spawn).
        self._stopped = self._cancelled = True
        unsent = [*self._waiting, *self._ready, *itertools.chain(*self._lane_waiting.values())]
        # Their window and lane slots are not handed on: nothing is sent any more.
        self._window_used -= len(unsent) - len(self._waiting)
        for batch in self._ready:
            self._lane_used[batch.partition] -= 1
        self._waiting.clear()
        self._ready.clear()
        self._lane_waiting.clear()
        for batch in unsent:
            self._report(batch, asyncio.CancelledError("stream cancelled"))
            self._forget(batch)
        for fut in list(self._answers):
            fut.cancel()
        for task in list(self._tasks):
            task.cancel()
        await self.join()

    # -- the window (synchronous) ---------------------------------------------------------

    def _start(self) -> None:
        """Send the batches the window and their lanes have room for, in cut order."""
        if self._starting:
            return  # called back from a send below; that loop goes on with the room made
        self._starting = True
        try:
            opts, waiting, ready = self._options, self._waiting, self._ready
            while True:
                if ready:
                    self._launch(ready.popleft())
                elif waiting and self._window_used < opts.max_in_flight:
                    batch = waiting.popleft()
                    self._window_used += 1
                    self._lane_waiting.setdefault(batch.partition, collections.deque()).append(
                        batch
                    )
                    self._admit(batch.partition)  # into ``ready`` if its lane takes it now
                else:
                    return
        finally:
            self._starting = False

    def _lane_takes(self, partition: int, seq: int) -> bool:
        """Batch ``seq`` may be sent now: its lane has a free slot, and ``seq`` is inside the
        lane's window above the partition's lowest unsettled batch (the ``base`` it carries)."""
        return (
            self._lane_used.get(partition, 0) < self._options.per_partition_in_flight
            and seq < min(self._unacked[partition]) + LANE_WINDOW
        )

    def _admit(self, partition: int) -> None:
        """Hand the lane's free slots to its waiting batches, in order, while they fit."""
        lane_waiting = self._lane_waiting.get(partition)
        while lane_waiting and self._lane_takes(partition, lane_waiting[0].seq):
            self._lane_used[partition] = self._lane_used.get(partition, 0) + 1
            self._ready.append(lane_waiting.popleft())

    def _launch(self, batch: Batch) -> None:
        """The first send of a batch that holds its window and lane slots."""
        if self._stopped:
            self._settle(batch, StreamStoppedError("not sent: the stream stopped"))
            return
        self.counters.in_flight += 1
        try:
            frame = self._frame(batch)
        except Exception as exc:  # noqa: BLE001 - settled as failed, never left holding its slots
            self._done(batch, exc)
            return
        p = batch.partition
        try:
            conn = self._routes.connection_now(p)
            ready = conn is not None and conn.stream_open(self._sid) and conn.has_room
        except Exception as exc:  # noqa: BLE001 - e.g. a map without this partition
            self._spawn(batch, frame, exc)  # reported (or retried) by the task's path
            return
        if conn is None or not ready or not self._handoff.try_claim(p, batch.seq, conn.node_id):
            self._spawn(batch, frame, None)
            return
        self._stamp(batch, frame)
        try:
            frame["base"] = min(self._unacked[p])
            fut = conn.start_batch(frame, timeout=self._options.ack_timeout)
        except Exception as exc:  # noqa: BLE001 - the send failed: retried or reported there
            self._spawn(batch, frame, exc)
            return
        self._answers.add(fut)
        fut.add_done_callback(functools.partial(self._answered, batch, frame, conn))

    def _answered(
        self, batch: Batch, frame: Frame, conn: Connection, fut: asyncio.Future[Frame]
    ) -> None:
        """The answer to a batch's first send (a callback of its future)."""
        self._answers.discard(fut)
        if fut.cancelled():
            conn.abandon_batch(frame, fut)
            self._done(batch, asyncio.CancelledError("stream cancelled"))
            return
        error = fut.exception()
        if error is None:
            try:
                self._record_ack(batch, conn, fut.result())
            except Exception as exc:  # noqa: BLE001 - a malformed ack: retried like any failure
                error = exc
            else:
                self._done(batch, None)
                return
        self._spawn(batch, frame, error)

    def _done(self, batch: Batch, error: BaseException | None) -> None:
        """A batch's sends are over: settle it and give its slots on."""
        self.counters.in_flight -= 1
        self._settle(batch, error)

    def _settle(self, batch: Batch, error: BaseException | None) -> None:
        """Report a batch that held window and lane slots, and hand the slots on."""
        try:
            self._report(batch, error)
        finally:  # whatever a callback raised, the window must not shrink for good
            p = batch.partition
            self._lane_used[p] -= 1
            self._window_used -= 1
            self._forget(batch)  # may move the lane's base, and so its window
            # Only now may a send wait for this batch's claim go on: its base is past it.
            self._handoff.release(p, batch.seq)
            self._admit(p)  # its waiting batches hold window slots already
            self._start()

    def _report(self, batch: Batch, error: BaseException | None) -> None:
        if error is None:
            rejected = len(batch.failures or ())
            self.counters.acked_items += len(batch.items) - rejected
            self.counters.failed_items += rejected
            self._on_acked(batch)
        elif isinstance(error, (asyncio.CancelledError, StreamStoppedError)):
            self._on_failed(batch, error)
        else:  # any failure of the send settles the batch, so the stream never waits on it
            self.counters.failed_items += len(batch.items)
            self._on_failed(batch, error)

    def _forget(self, batch: Batch) -> None:
        self._unacked[batch.partition].discard(batch.seq)
        self._unsettled -= 1
        if self._unsettled < self._options.max_in_flight:
            self._room.set()
        if not self._unsettled:
            self._all_settled.set()

    # -- sends ----------------------------------------------------------------------------

    def _frame(self, batch: Batch) -> Frame:
        frame: Frame = {
            "t": "batch",
            "sid": self._sid,
            "p": batch.partition,
            "seq": batch.seq,
            "n": len(batch.items),
        }
        if isinstance(batch.items, ArrowRows):  # its deletes are a column of the page
            if batch.wire is None:
                batch.wire = encode_page(batch.items)
            frame["arrow"] = batch.wire
        else:
            frame["items"] = join_items(batch.packed)
            if batch.deletes:
                frame["del"] = batch.deletes
        self.counters.sent_items += len(batch.items)
        return frame

    @staticmethod
    def _stamp(batch: Batch, frame: Frame) -> None:
        batch.attempts += 1
        if batch.attempts == 1:
            batch.first_sent = time.monotonic()
        frame["att"] = batch.attempts

    def _spawn(self, batch: Batch, frame: Frame, failed: BaseException | None) -> None:
        """Send ``batch`` on a task of its own (its first send, unless ``failed`` is how that
        ended). The task's end settles the batch, also if it is cancelled before it ran."""
        if self._cancelled:  # an answer that came in as the stream was cancelled
            self._done(batch, asyncio.CancelledError("stream cancelled"))
            return
        task = asyncio.create_task(
            self._send_with_retries(batch, frame, failed),
            name=f"deltaflow-batch-{batch.partition}",
        )
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._sent_on_task, batch))

    def _sent_on_task(self, batch: Batch, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            self._done(batch, asyncio.CancelledError("stream cancelled"))
        else:
            self._done(batch, task.exception())

    async def _send_with_retries(
        self, batch: Batch, frame: Frame, failed: BaseException | None
    ) -> None:
        opts = self._options
        if failed is None:
            try:
                await self._attempt(batch, frame)
            except Exception as exc:  # noqa: BLE001 - decided below
                failed = exc
            else:
                return
        # The send that just failed is tenacity's first attempt (a first send that succeeds,
        # the common case, builds no AsyncRetrying). Waits are ``initial * 2**(k-1)`` plus
        # jitter after the k-th failed send, capped at the maximum.
        retrying = AsyncRetrying(
            stop=stop_after_attempt(opts.retry_limit + 1),
            wait=wait_exponential(multiplier=opts.retry_initial_backoff, max=opts.retry_max_backoff)
            + wait_random(0, opts.retry_initial_backoff),
            retry=retry_if_exception(self._can_retry),
            before_sleep=functools.partial(self._before_retry, batch),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                if failed is not None:
                    first, failed = failed, None
                    raise first
                await self._attempt(batch, frame)

    async def _attempt(self, batch: Batch, frame: Frame) -> None:
        """One send of ``batch`` to its partition's owner, through to its ack. Its claim is
        held until the batch settles or its resend is decided (see :class:`Handoff`)."""
        self._stamp(batch, frame)
        p = batch.partition
        while True:  # until the send may go: the target is chosen again after every wait
            conn = await self._routes.connection_for(p)
            there = self._handoff.waits_for(p, batch.seq)
            if there is not None and there != conn.node_id:
                # Later batches are out at ``there``, which may wait for this one.
                conn = self._routes.connection_to(there) or conn
            await conn.open_stream(
                self._sid, *self._receiver, self._results, key=self._key, random=self._random
            )
            if self._handoff.try_claim(p, batch.seq, conn.node_id):
                break
            if self._handoff.waits_for(p, batch.seq) in (None, there):  # else: follow them now
                await self._handoff.changed(p)
        frame["base"] = min(self._unacked[p])
        ack = await conn.send_batch(frame, timeout=self._options.ack_timeout)
        self._record_ack(batch, conn, ack)

    def _record_ack(self, batch: Batch, conn: Connection, ack: Frame) -> None:
        self.counters.ack_latency.observe(time.monotonic() - batch.first_sent)
        batch.node = conn.node_id
        batch.failures = item_failures(ack, len(batch.items), conn.node_id)
        stats = self.counters.per_node.setdefault(conn.node_id, NodeStatistics())
        stats.batches_acked += 1
        stats.items_acked += len(batch.items)

    def _can_retry(self, exc: BaseException) -> bool:
        if self._stopped:
            return False
        if isinstance(exc, LaneFailedError) and self._options.on_failure != "fail":
            # An earlier batch of the partition failed; once it is dead-lettered or dropped the
            # next send's ``base`` moves past it and the node reopens the lane.
            return True
        return is_retriable(exc)

    def _before_retry(self, batch: Batch, state: RetryCallState) -> None:
        self._handoff.release(batch.partition, batch.seq)  # it waits; others may go first
        exc = state.outcome.exception() if state.outcome else None
        self._note_retry(exc, state.attempt_number)

    def _note_retry(self, exc: BaseException | None, attempt: int) -> None:
        """Book-keeping after send number ``attempt`` failed and before it is resent."""
        self.counters.retried_batches += 1
        if isinstance(exc, NotOwnerError):
            self._routes.adopt_map(exc.details.get("map"))
        elif isinstance(exc, TransportError):
            self._routes.mark_stale()
        node = getattr(exc, "node", None)
        if node:
            self.counters.per_node.setdefault(node, NodeStatistics()).errors += 1
        log.info("retrying stream %s batch after %r (attempt %d)", self._sid, exc, attempt)


def item_failures(ack: dict[str, Any], size: int, node: str) -> dict[int, str] | None:
    """The ``failed`` field of an ack: the items the receiver marked failed (index -> reason)."""
    entries = ack.get("failed")
    if not entries:
        return None
    failures: dict[int, str] = {}
    for entry in entries:
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not isinstance(entry[0], int)
            or not 0 <= entry[0] < size
            or not isinstance(entry[1], str)
        ):
            raise ProtocolError(f"node {node} sent a malformed 'failed' entry {entry!r} in an ack")
        failures[entry[0]] = entry[1]
    return failures


class StreamStoppedError(Exception):
    """A batch was not sent because its stream stopped (failed or was cancelled)."""
