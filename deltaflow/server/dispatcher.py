"""Streams, lanes and receiver dispatch on a node.

A *lane* is one (stream, partition); its state and rules are in :mod:`.lanes`. Batches of a
lane are applied strictly in sequence order: a batch that arrives early (pipelining, or a
resend overtaking) waits in the lane until its predecessors ran. A lane runs one receiver call
at a time, but does not wait for the previous batch's commit: table writes are staged in order
into the engine, whose group commits preserve staging order, so the next batch can be staged
while the previous one commits.

A batch is acknowledged only when its receiver returned *and* every table write it staged is
durable. A resend of a batch already applied is acknowledged as a duplicate (``dup``) without
running it again; one still committing is acknowledged when its commit lands. Either way its
results (and the items its receiver marked failed) are sent again first, so a lost ack never
loses them; results may therefore repeat. They are kept until the client's ``base`` passes the
batch (it has the ack), at most ``RESULT_REPLAY_BATCHES`` batches per lane.

When a batch fails for good, its lane is failed: later batches of the lane are refused with
``LANE_FAILED`` (and those already staged behind it are abandoned before they commit), so a
later write can never overtake an earlier one that was not applied.

A stream is its id and its owner, the hash of the key it was opened with (see :mod:`.streams`):
the connection hands every frame of a stream in with the owner it opened the stream as, so a
client can only feed or close streams it opened itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from .._faults import fault_point
from ..errors import (
    BadFrameError,
    LaneFailedError,
    NotOwnerError,
    ProtocolError,
    ServerError,
    UnknownStreamError,
    is_retriable,
)
from ..protocol import MAX_SEQ, Frame
from ..receivers.base import ReceiverContext, SideInputReader, TableWriter, lane_name
from ..receivers.registry import ReceiverRegistry
from .frames import RECEIVED_AT, ack_frame, batch_items, error_frame, result_frames, stamp_received
from .lanes import LANE_WINDOW, RESULT_REPLAY_BATCHES, Lane, Peer, in_window
from .receiving import call_receiver, receiver_error, unexpected_error
from .statistics import DispatcherStatistics, ReceiverStatistics
from .streams import Stream, StreamTable

# Also imported from here: error_frame (tests), the lane bounds (tests) and the statistics.
__all__ = [
    "LANE_WINDOW",
    "RESULT_REPLAY_BATCHES",
    "Dispatcher",
    "DispatcherStatistics",
    "Peer",
    "error_frame",
]

log = logging.getLogger(__name__)

#: Seconds a lane's batches wait for a predecessor that has not arrived before it is logged.
LANE_WAIT_LOG_SECONDS: Final = 5.0


def _unblocks(lane: Lane | None, seq: int) -> bool:
    """Whether batch ``seq`` is one that batches this node took for the lane (while it owned
    the partition, so still its to apply: ``docs/cluster.md``) wait for: refusing it would
    leave both waiting until the client's ack timeout."""
    return lane is not None and bool(lane.pending) and lane.next_seq <= seq < min(lane.pending)


class Dispatcher:
    """Routes batch frames into lanes and runs receivers.

    Args:
        node_id: this node's id (in every error it reports).
        registry: the receiver allow-list.
        writer: the table engine receivers write through.
        owns: whether this node currently owns a partition.
        map_wire: the current partition map (sent with ``NOT_OWNER``).
        partitions: the partition count.
        side_inputs: the node's side-input store, read by receivers through the context.
        concurrency: receiver name -> the most ``receive`` calls of it running at once,
            overriding the class's ``max_concurrency``.
    """

    def __init__(
        self,
        *,
        node_id: str,
        registry: ReceiverRegistry,
        writer: TableWriter | None,
        owns: Callable[[int], bool],
        map_wire: Callable[[], dict[str, Any]],
        partitions: int,
        side_inputs: SideInputReader | None = None,
        concurrency: Mapping[str, int] | None = None,
    ) -> None:
        self.node_id = node_id
        self._writer = writer
        self._owns = owns
        self._map_wire = map_wire
        self._partitions = partitions
        self._side_inputs = side_inputs
        self.streams = StreamTable(
            node_id=node_id, registry=registry, concurrency=concurrency or {}
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self.stats = DispatcherStatistics()

    # -- stream lifecycle (synchronous) ---------------------------------------------------

    def open(self, sid: str, receiver: str, args: Any, key: bytes, random: bool = False) -> str:
        """Declare stream ``sid`` opened with ``key``, and return its owner (``random``: the
        client made its id up).

        The same id and key again, on any connection (a client that reconnected, or a replay
        after a restart of either side), is the same stream: it keeps its lanes. The same id
        under another key is another stream, which can neither see nor move this one's lanes:
        an intruder who opens an id first does not lock its owner out.

        Raises:
            BadFrameError: the id or the key is not allowed, or this stream is open with
                another receiver.
            UnknownReceiverError: ``receiver`` is not on the allow-list.
            ReceiverError: the receiver could not be created.
        """
        owner = self.streams.open(sid, receiver, args, key, random).owner
        self.stats.streams = len(self.streams)
        return owner

    def not_open(self, sid: str) -> UnknownStreamError:
        """What a frame of stream ``sid`` gets on a connection that did not open it."""
        return UnknownStreamError(
            f"stream {sid[:64]!r} is not open on this connection; send 'open' first",
            node=self.node_id,
        )

    def close(self, sid: str, owner: str) -> None:
        """The owner ends stream ``sid``; a no-op if the node forgot it already."""
        stream = self.streams.get(sid, owner)
        if stream is None:
            return
        # Batches still waiting for their turn will not get it: tell their senders they were not
        # applied (a stopping client waits for an answer to every batch it sent).
        for p, lane in stream.lanes.items():
            for seq, peer, frame in lane.take_pending():
                self._reply_error(
                    peer,
                    LaneFailedError(
                        f"not applied: stream closed by the client before batch {seq} of "
                        f"partition {p} could run",
                        node=self.node_id,
                    ),
                    frame,
                )
        committing = [f for lane in stream.lanes.values() for f in lane.committing.values()]
        if committing:  # let running commits finish (and ack) before forgetting the stream
            self._spawn(self._forget_after(stream, committing))
        else:
            self._forget(stream)

    async def _forget_after(self, stream: Stream, committing: list[asyncio.Future[None]]) -> None:
        await asyncio.gather(*(asyncio.shield(f) for f in committing), return_exceptions=True)
        self._forget(stream)

    def _forget(self, stream: Stream) -> None:
        """Forget a stream its client closed (batches waiting for a predecessor it gave up on
        go unanswered), and a random id's marks: only that client could resend them."""
        self.streams.forget(stream)
        self.stats.streams = len(self.streams)
        if stream.random and stream.tables and self._writer is not None:
            self._writer.forget_lanes(
                stream.tables,
                [lane_name(stream.sid, stream.owner, p, random=True) for p in stream.lanes],
            )

    async def settled(self) -> None:
        """Wait until no batch this node accepted is running or committing: every one is
        applied and answered, or waits for a predecessor that never came (a node that drains
        stops taking batches first, so the wait ends)."""
        while True:
            busy: list[asyncio.Future[Any]] = [
                f
                for stream in self.streams
                for lane in stream.lanes.values()
                for f in (lane.task, *lane.committing.values())
                if f is not None and not f.done()
            ]
            if not busy:
                return
            await asyncio.wait(busy)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- batches --------------------------------------------------------------------------

    def submit(self, peer: Peer, frame: Frame, owner: str | None) -> None:
        """Take a batch frame (synchronous); its ack or error is sent to ``peer`` later.
        ``owner`` is who ``peer`` opened the frame's stream as (None: it did not open it)."""
        sid, p, seq = frame["sid"], frame["p"], frame["seq"]
        self.stats.batches_received += 1
        stamp_received(frame)
        stream = self.streams.get(sid, owner)
        if stream is None:  # the id comes back in the answer: no longer than a valid one
            return self._reply_error(peer, self.not_open(sid), {**frame, "sid": sid[:160]})
        if not 0 <= p < self._partitions or not 0 <= seq < MAX_SEQ:
            return self._reply_error(
                peer,
                BadFrameError(
                    f"partition {p} / sequence {seq} out of range (partitions: "
                    f"{self._partitions}, sequences below 2**{MAX_SEQ.bit_length() - 1})",
                    node=self.node_id,
                ),
                frame,
            )
        base = frame.get("base", 0)
        if not in_window(seq, base):
            return self._reply_error(
                peer,
                BadFrameError(
                    f"batch {seq} of stream {sid!r} partition {p} has base {base}: a node takes "
                    f"a batch only when 0 <= base <= seq < base + {LANE_WINDOW} (the lane's "
                    "window)",
                    node=self.node_id,
                ),
                frame,
            )
        if not self._owns(p) and not _unblocks(stream.lanes.get(p), seq):
            return self._reply_error(
                peer,
                NotOwnerError(
                    f"partition {p} is not owned by this node; refresh the partition map",
                    node=self.node_id,
                    details={"map": self._map_wire()},
                ),
                frame,
            )
        lane = stream.lanes.setdefault(p, Lane(receiver_name=stream.receiver_name))
        lane.reopen_past(base)
        refusal = lane.refusal(seq, self.node_id, p)
        if refusal is not None:
            return self._reply_error(peer, refusal, frame)
        lane.start_at(base)
        if lane.is_duplicate(seq):
            self.stats.duplicates += 1
            self._spawn(self._ack_duplicate(peer, frame, lane))
            return None
        # The window bounds what waits: each batch is below base + LANE_WINDOW; base <= next_seq.
        lane.pending[seq] = (peer, frame)  # a resend of a waiting batch replaces its peer
        if lane.task is None:
            lane.task = self._spawn(self._run_lane(stream, p, lane))
        return None

    async def _run_lane(self, stream: Stream, p: int, lane: Lane) -> None:
        try:
            while lane.failure is None and lane.next_seq in lane.pending:
                seq = lane.next_seq
                peer, frame = lane.pending.pop(seq)
                durable: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                lane.committing[seq] = durable
                counted = self.stats.receiver(stream.receiver_name)
                counted.running += 1
                try:
                    ctx = await self._apply(stream, p, seq, peer, frame, lane)
                except Exception as exc:  # noqa: BLE001 - every batch gets an answer
                    err = unexpected_error(
                        exc, f"stream {stream.sid} partition {p} batch {seq}", self.node_id
                    )
                    del lane.committing[seq]
                    durable.set_exception(err)  # a resend waiting on it gets the same answer
                    durable.exception()
                    if is_retriable(err):  # the client resends this very batch; keep the lane
                        self._reply_error(peer, err, frame)
                        return
                    self._fail_lane(p, lane, seq, err, peer, frame)
                    return
                finally:
                    counted.running -= 1
                if lane.failed_at is None:  # else the lane restarts from its failed batch
                    lane.next_seq = max(lane.next_seq, seq + 1)
                if ctx._durable:
                    lane.staged[seq] = list(ctx._durable)
                    # On a task of its own: the lane goes on while the writes commit.
                    self._spawn(self._finish(p, lane, seq, ctx, durable, peer, frame))
                else:  # nothing to wait for (no table writes): acknowledged now, no task
                    self._acknowledge(lane, ctx, durable, peer, frame)
        finally:
            lane.task = None
            if lane.pending:  # they wait for a batch that has not come (yet)
                lane.watch(LANE_WAIT_LOG_SECONDS, functools.partial(self._log_wait, stream, p))

    def _log_wait(self, stream: Stream, p: int, lane: Lane, waited: float) -> None:
        if self.streams.get(stream.sid, stream.owner) is stream:  # else nobody waits
            log.info(
                "stream %s partition %d: batches %d to %d have waited %.1fs for batch %d, "
                "which has not reached this node (%s the partition)",
                stream.sid,
                p,
                min(lane.pending),
                max(lane.pending),
                waited,
                lane.next_seq,
                "it owns" if self._owns(p) else "it no longer owns",
            )

    async def _apply(
        self, stream: Stream, p: int, seq: int, peer: Peer, frame: Frame, lane: Lane
    ) -> ReceiverContext:
        try:
            items, deletes = await batch_items(frame)
        except ProtocolError as exc:
            raise BadFrameError(str(exc), node=self.node_id) from exc
        fault_point("applying")
        first = max(1, frame.get("att", 1))
        if not stream.receiver.idempotent:
            return await self._run_receiver(
                stream, p, seq, peer, frame, lane, items, deletes, first
            )
        # An idempotent receiver is re-run here on a retriable error: cheaper than a round trip
        # to the client, and safe by its own declaration (the failed run's writes are abandoned).
        retrying = AsyncRetrying(
            stop=stop_after_attempt(stream.receiver.node_retries + 1),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception(is_retriable),
            before_sleep=self._count_node_retry,
            reraise=True,
        )
        async for node_try in retrying:
            with node_try:
                attempt = first + node_try.retry_state.attempt_number - 1
                return await self._run_receiver(
                    stream, p, seq, peer, frame, lane, items, deletes, attempt
                )
        raise AssertionError("unreachable: tenacity reraises the last error")

    def _count_node_retry(self, state: RetryCallState) -> None:
        self.stats.node_retries += 1

    async def _run_receiver(
        self,
        stream: Stream,
        p: int,
        seq: int,
        peer: Peer,
        frame: Frame,
        lane: Lane,
        items: Sequence[Any],
        deletes: frozenset[int],
        attempt: int,
    ) -> ReceiverContext:
        batch_failed = asyncio.Event()

        def abandoned() -> bool:
            # Read at commit time: writes of a batch that failed, or of batches behind a failed
            # one in the lane, must not land.
            return batch_failed.is_set() or lane.abandons(seq)

        ctx = ReceiverContext(
            stream_id=stream.sid,
            stream_owner=stream.owner,
            random_id=stream.random,
            partition=p,
            seq=seq,
            node_id=self.node_id,
            args=stream.args,
            deletes=deletes,
            attempt=attempt,
            _size=len(items),
            _writer=self._writer,
            _side_inputs=self._side_inputs,
            _abandoned=abandoned,
        )
        produced: list[Any] = []
        lane.keep_results(seq, produced, ctx._failed)
        try:
            async with stream.limit:
                await call_receiver(stream.receiver, items, ctx, produced, peer, frame)
        except ServerError as err:
            batch_failed.set()
            err.node = err.node or self.node_id
            raise
        except Exception as exc:
            batch_failed.set()
            name, n = stream.receiver_name, frame["n"]
            raise receiver_error(exc, name, stream.sid, p, seq, n, self.node_id) from exc
        except BaseException:
            batch_failed.set()
            raise
        finally:
            # Its staged writes may be committed now (or, if it failed, dropped).
            ctx._running = False
            if stream.random:
                stream.tables.update(ctx._writes)
            if ctx._durable and self._writer is not None:
                self._writer.release()
        return ctx

    async def _finish(
        self,
        p: int,
        lane: Lane,
        seq: int,
        ctx: ReceiverContext,
        durable: asyncio.Future[None],
        peer: Peer,
        frame: Frame,
    ) -> None:
        try:
            if ctx._durable:
                await asyncio.gather(*ctx._durable)
        # Any commit failure must fail the batch's waiters and the lane, never leave them hanging.
        except Exception as exc:  # noqa: BLE001
            # Final whatever its class: the lane closes, and a resend gets the same answer.
            err = (
                exc
                if isinstance(exc, ServerError)
                else ServerError(f"commit failed: {exc!r}", node=self.node_id)
            ).as_final()
            durable.set_exception(err)
            durable.exception()
            lane.committing.pop(seq, None)
            self._fail_lane(p, lane, seq, err, peer, frame)
            lane.staged.pop(seq, None)
            return
        lane.staged.pop(seq, None)
        self._acknowledge(lane, ctx, durable, peer, frame)

    def _acknowledge(
        self,
        lane: Lane,
        ctx: ReceiverContext,
        durable: asyncio.Future[None],
        peer: Peer,
        frame: Frame,
    ) -> None:
        """The batch is applied and durable: count it and queue its ack."""
        durable.set_result(None)
        lane.committing.pop(frame["seq"], None)
        counters: list[DispatcherStatistics | ReceiverStatistics] = [self.stats]
        if lane.receiver_name is not None:
            counters.append(self.stats.receiver(lane.receiver_name))
        for counted in counters:
            counted.batches_acked += 1
            counted.items_applied += frame["n"] - len(ctx._failed)
            counted.items_failed += len(ctx._failed)
        self.stats.time_batch(frame[RECEIVED_AT])
        self._send_soon(peer, ack_frame(frame, failed=ctx._failed))

    async def _ack_duplicate(self, peer: Peer, frame: Frame, lane: Lane) -> None:
        """A resend of an applied batch: replay its results, ack once it is durable."""
        seq = frame["seq"]
        durable = lane.committing.get(seq)
        if durable is not None:
            try:
                await asyncio.shield(durable)
            except ServerError as err:
                self._reply_error(peer, err, frame)
                return
        values, failed = lane.results.get(seq, ([], {}))
        for result in result_frames(frame, values):
            await peer.send(result)
        await peer.send(ack_frame(frame, dup=True, failed=failed))

    def _fail_lane(
        self,
        p: int,
        lane: Lane,
        seq: int,
        err: ServerError,
        peer: Peer,
        frame: Frame,
    ) -> None:
        # ``err`` is not retriable. Later batches' staged writes are abandoned before they
        # commit, and those waiting are refused.
        lane.fail(seq, err)
        self.stats.batches_failed += 1
        if lane.receiver_name is not None:
            self.stats.receiver(lane.receiver_name).batches_failed += 1
        self._reply_error(peer, err, frame)
        for _, later_peer, later_frame in lane.take_pending():
            self._reply_error(later_peer, lane.failed_error(self.node_id, p), later_frame)

    def _reply_error(self, peer: Peer, err: ServerError, frame: Frame) -> None:
        self.stats.count_error(err.code, str(err))
        self._send_soon(peer, error_frame(err, sid=frame["sid"], p=frame["p"], seq=frame["seq"]))

    def _send_soon(self, peer: Peer, frame: Frame) -> None:
        """Queue an answer without waiting: acks and errors of one loop turn then share a
        message, and neither a lane nor the connection's reader waits for a slow client. Only
        a peer above its high-water mark gets it from a task that waits."""
        if not peer.send_nowait(frame):
            self._spawn(peer.send(frame))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # A bug, never a refusal (those are answered): said now, not when collected.
            log.error("node %s: a dispatcher task failed", self.node_id, exc_info=exc)
