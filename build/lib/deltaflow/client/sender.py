"""The sender: delivers cut batches to partition owners inside a bounded window, with retries.

Each batch gets its own task. ``wait_for_room`` is what the stream awaits before pulling the
next source item, so the source is not pulled while ``max_in_flight`` batches are outstanding.
Retries use tenacity (exponential backoff with jitter) and resend the *same* sequence number,
so the owner applies each batch once and in order. The decision to retry is
:func:`deltaflow.errors.is_retriable`, nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import random
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

from ..errors import (
    LaneFailedError,
    NotOwnerError,
    ProtocolError,
    TransportError,
    is_retriable,
)
from ..protocol import join_items
from .accumulator import Batch
from .options import StreamerOptions

if TYPE_CHECKING:
    from .client import Client
    from .connection import ResultSink

__all__ = ["NodeStatistics", "Sender", "StreamStoppedError"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeStatistics:
    """Per-node counters of one stream."""

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


class Sender:
    """Sends the batches of one stream.

    Args:
        client: routes partitions to connections and keeps the partition map fresh.
        sid: the stream id.
        receiver: receiver name and arguments declared when the stream opens on a connection.
        options: window, retry and timeout settings.
        on_acked: called with each acknowledged batch.
        on_failed: called with a batch whose retries are exhausted and the error.
        results: where result frames of this stream go, or None.
    """

    def __init__(
        self,
        client: Client,
        *,
        sid: str,
        receiver: tuple[str, Any],
        options: StreamerOptions,
        on_acked: Callable[[Batch], None],
        on_failed: Callable[[Batch, BaseException], None],
        results: ResultSink | None,
    ) -> None:
        self._client = client
        self._sid = sid
        self._receiver = receiver
        self._options = options
        self._on_acked = on_acked
        self._on_failed = on_failed
        self._results = results
        self._window = asyncio.Semaphore(options.max_in_flight)
        self._lanes: dict[int, asyncio.Semaphore] = {}
        # Sequence numbers of each partition not yet settled: the smallest is the ``base`` a
        # batch frame carries, so a new owner knows every lower batch is already acknowledged.
        self._unacked: dict[int, set[int]] = {}
        # Which node a partition's in-flight batches went to. Batches switch to a new owner
        # only once those settled, so two nodes never hold batches of one lane at once (the
        # new owner would otherwise wait for a batch the old one is still applying).
        self._owner: dict[int, tuple[str, int]] = {}
        self._owner_changed = asyncio.Condition()
        self._claim_waiters = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self._room.set()
        self._stopped = False
        self.counters = _Counters()

    def submit(self, batch: Batch) -> None:
        """Take a cut batch (synchronous; the send happens on a task)."""
        self._unacked.setdefault(batch.partition, set()).add(batch.seq)
        task = asyncio.create_task(self._deliver(batch), name=f"deltaflow-batch-{batch.partition}")
        self._tasks.add(task)
        task.add_done_callback(self._settled)
        if len(self._tasks) >= self._options.max_in_flight:
            self._room.clear()

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
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.join()

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if len(self._tasks) < self._options.max_in_flight:
            self._room.set()

    async def _deliver(self, batch: Batch) -> None:
        lane = self._lanes.setdefault(
            batch.partition, asyncio.Semaphore(self._options.per_partition_in_flight)
        )
        try:
            await self._deliver_in_window(batch, lane)
        finally:
            self._unacked[batch.partition].discard(batch.seq)
            # Settled now rather than in the done callback a loop turn later: the pump waiting
            # for room resumes one turn sooner (the callback then finds nothing left to do).
            task = asyncio.current_task()
            if task is not None:
                self._settled(task)

    async def _deliver_in_window(self, batch: Batch, lane: asyncio.Semaphore) -> None:
        try:
            async with self._window, lane:
                if self._stopped:
                    # Leave the window and lane, then report the batch as not sent below.
                    raise StreamStoppedError  # noqa: TRY301
                self.counters.in_flight += 1
                try:
                    await self._send_with_retries(batch)
                finally:
                    self.counters.in_flight -= 1
        except asyncio.CancelledError:
            self._on_failed(batch, asyncio.CancelledError("stream cancelled"))
            raise
        except StreamStoppedError:
            self._on_failed(batch, StreamStoppedError("not sent: the stream stopped"))
        # Any failure of the send settles the batch as failed, so the stream never waits on it.
        except Exception as exc:  # noqa: BLE001
            self.counters.failed_items += len(batch.items)
            self._on_failed(batch, exc)
        else:
            rejected = len(batch.failures or ())
            self.counters.acked_items += len(batch.items) - rejected
            self.counters.failed_items += rejected
            self._on_acked(batch)

    async def _send_with_retries(self, batch: Batch) -> None:
        opts = self._options
        frame = {
            "t": "batch",
            "sid": self._sid,
            "p": batch.partition,
            "seq": batch.seq,
            "n": len(batch.packed),
            "items": join_items(batch.packed),
        }
        if batch.deletes:
            frame["del"] = batch.deletes
        self.counters.sent_items += len(batch.items)
        # The first send goes without a retry loop: almost every batch is acked at once, and
        # tenacity's per-call machinery would cost more than the send itself at small pages.
        try:
            await self._attempt(batch, frame)
        except Exception as exc:
            if opts.retry_limit == 0 or not self._can_retry(exc):
                raise
            self._note_retry(exc, 1)
        else:
            return
        # Resends: tenacity, its attempt numbers counting from the second send. Waits are
        # ``initial * 2**(k-1)`` plus jitter after the k-th failed send, capped at the maximum.
        await asyncio.sleep(
            min(opts.retry_initial_backoff, opts.retry_max_backoff)
            + random.uniform(0, opts.retry_initial_backoff)
        )
        retrying = AsyncRetrying(
            stop=stop_after_attempt(opts.retry_limit),
            wait=wait_exponential(
                multiplier=2 * opts.retry_initial_backoff, max=opts.retry_max_backoff
            )
            + wait_random(0, opts.retry_initial_backoff),
            retry=retry_if_exception(self._can_retry),
            before_sleep=self._before_retry,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                await self._attempt(batch, frame)

    async def _attempt(self, batch: Batch, frame: dict[str, Any]) -> None:
        """One send of ``batch`` to its partition's owner, through to its ack."""
        batch.attempts += 1
        frame["att"] = batch.attempts
        conn = await self._client._connection_for(batch.partition)
        await conn.open_stream(self._sid, *self._receiver, self._results)
        await self._claim(batch.partition, conn.node_id)
        try:
            frame["base"] = min(self._unacked[batch.partition])
            ack = await conn.send_batch(frame, timeout=self._options.ack_timeout)
        finally:
            await self._release(batch.partition)
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

    async def _claim(self, partition: int, node: str) -> None:
        owner = self._owner.get(partition)
        if owner is None or owner[0] == node or owner[1] == 0:
            # Free for this node: take it without the condition (one event loop, no await).
            count = owner[1] if owner is not None and owner[0] == node else 0
            self._owner[partition] = (node, count + 1)
            return

        def free_for_node() -> bool:
            owner = self._owner.get(partition)
            return owner is None or owner[0] == node or owner[1] == 0

        async with self._owner_changed:
            self._claim_waiters += 1
            try:
                await self._owner_changed.wait_for(free_for_node)
            finally:
                self._claim_waiters -= 1
            owner = self._owner.get(partition)
            count = owner[1] if owner is not None and owner[0] == node else 0
            self._owner[partition] = (node, count + 1)

    async def _release(self, partition: int) -> None:
        node, count = self._owner[partition]
        self._owner[partition] = (node, count - 1)
        if self._claim_waiters:
            async with self._owner_changed:
                self._owner_changed.notify_all()

    def _before_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        # Tenacity counts from the second send (the first went without it).
        self._note_retry(exc, state.attempt_number + 1)

    def _note_retry(self, exc: BaseException | None, attempt: int) -> None:
        """Book-keeping after send number ``attempt`` failed and before it is resent."""
        self.counters.retried_batches += 1
        if isinstance(exc, NotOwnerError):
            self._client._adopt_map(exc.details.get("map"))
        elif isinstance(exc, TransportError):
            self._client._map_is_stale()
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
