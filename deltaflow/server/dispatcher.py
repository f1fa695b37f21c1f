"""Streams, lanes and receiver dispatch on a node.

A *lane* is one (stream, partition). Batches of a lane are applied strictly in sequence
order: a batch that arrives early (pipelining, or a resend overtaking) waits in the lane until
its predecessors ran. A lane runs one receiver call at a time, but does not wait for the
previous batch's commit: table writes are staged in order into the engine, whose group commits
preserve staging order, so the next batch can be staged while the previous one commits.

A batch is acknowledged only when its receiver returned *and* every table write it staged is
durable. A resend of a batch already applied is acknowledged as a duplicate (``dup``) without
running it again; one still committing is acknowledged when its commit lands. Either way its
results (and the items its receiver marked failed) are sent again first, so a lost ack never
loses them; results may therefore repeat. They are kept until the client's ``base`` passes the
batch (it has the ack), at most ``RESULT_REPLAY_BATCHES`` batches per lane.

When a batch fails for good, its lane is failed: later batches of the lane are refused with
``LANE_FAILED`` (and those already staged behind it are abandoned before they commit), so a
later write can never overtake an earlier one that was not applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, cast

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from ..columnar import decode_page
from ..errors import (
    DeltaflowError,
    LaneFailedError,
    NotOwnerError,
    OverloadedError,
    ProtocolError,
    ReceiverError,
    ServerError,
    _BadFrameError,
    _UnknownStreamError,
    is_retriable,
)
from ..protocol import STREAM_ID, Frame, unpack_items
from ..receivers.base import Receiver, ReceiverContext, SideInputReader, TableWriter
from ..receivers.registry import ReceiverRegistry

__all__ = ["Dispatcher", "DispatcherStatistics", "Peer", "error_frame"]

log = logging.getLogger(__name__)

MAX_LANE_PENDING: Final = 64
#: Most batches per lane whose results are kept for replay to a resend. Results are dropped as
#: soon as the client's ``base`` passes their batch, so this bound only matters for a client
#: that falls this far behind (a batch then resent gets its ack without its results).
RESULT_REPLAY_BATCHES: Final = 1024
_RESULT_CHUNK: Final = 1000


class Peer(Protocol):
    """A client connection as the dispatcher sees it."""

    async def send(self, frame: Frame) -> None: ...

    def send_nowait(self, frame: Frame) -> bool:
        """Queue ``frame`` without waiting; False if the peer is backed up (then ``send``)."""
        ...


def error_frame(err: ServerError, **where: Any) -> Frame:
    frame: Frame = {
        "t": "error",
        "code": err.code,
        "msg": str(err.args[0]) if err.args else err.code,
        "node": err.node,
        "retriable": err.retriable,
    }
    details = {k: v for k, v in err.details.items() if k != "retriable"}
    if "retriable" in err.details:
        frame["retriable"] = bool(err.details["retriable"])
    if details:
        frame["details"] = details
    frame.update({k: v for k, v in where.items() if v is not None})
    return frame


@dataclass(slots=True)
class DispatcherStatistics:
    streams: int = 0
    batches_received: int = 0
    batches_acked: int = 0
    batches_failed: int = 0
    duplicates: int = 0
    items_applied: int = 0
    items_failed: int = 0
    node_retries: int = 0


@dataclass(slots=True)
class _Lane:
    next_seq: int = 0
    pending: dict[int, tuple[Peer, Frame]] = field(default_factory=dict)
    committing: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    # Table writes each applied batch staged, until they are durable: a failed one makes the
    # writes of later batches of the lane abandoned at once, before any of them commits.
    staged: dict[int, list[asyncio.Future[None]]] = field(default_factory=dict)
    # Results of the latest batches, replayed when a batch is resent after a lost ack.
    # Each: (results produced, items the receiver marked failed by index).
    results: OrderedDict[int, tuple[list[Any], dict[int, str]]] = field(default_factory=OrderedDict)
    failed_at: int | None = None
    failure: ServerError | None = None
    task: asyncio.Task[None] | None = None


@dataclass(slots=True)
class _Stream:
    sid: str
    receiver_name: str
    receiver: Receiver
    args: Any
    limit: asyncio.Semaphore | contextlib.nullcontext[None]
    lanes: dict[int, _Lane] = field(default_factory=dict)


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
        self._registry = registry
        self._writer = writer
        self._owns = owns
        self._map_wire = map_wire
        self._partitions = partitions
        self._side_inputs = side_inputs
        self._concurrency = dict(concurrency or {})
        self._limits: dict[str, asyncio.Semaphore] = {}
        self._streams: dict[str, _Stream] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.stats = DispatcherStatistics()

    # -- stream lifecycle (synchronous) ---------------------------------------------------

    def open(self, sid: str, receiver: str, args: Any) -> None:
        """Declare a stream (idempotent: reopening on another connection keeps its lanes).

        Raises:
            UnknownReceiverError: ``receiver`` is not on the allow-list.
        """
        if not STREAM_ID.fullmatch(sid):
            raise _BadFrameError(
                f"stream id {sid[:64]!r} is not allowed: use 1 to 160 characters of "
                "A-Z a-z 0-9 . _ : -",
                node=self.node_id,
            )
        stream = self._streams.get(sid)
        if stream is not None:
            if stream.receiver_name != receiver:
                raise _BadFrameError(
                    f"stream {sid} was opened with receiver {stream.receiver_name!r}, not "
                    f"{receiver!r}",
                    node=self.node_id,
                )
            return
        cls = self._registry.get(receiver, node=self.node_id)
        try:
            instance = cls()
        except Exception as exc:
            raise ReceiverError(
                f"receiver {receiver} could not be created: {type(exc).__name__}: {exc}",
                node=self.node_id,
            ) from exc
        self._streams[sid] = _Stream(sid, receiver, instance, args, self._limit(receiver, cls))
        self.stats.streams = len(self._streams)

    def _limit(
        self, name: str, cls: type[Receiver]
    ) -> asyncio.Semaphore | contextlib.nullcontext[None]:
        """The bound on concurrent ``receive`` calls of one receiver class on this node."""
        bound = self._concurrency.get(name, cls.max_concurrency)
        if bound is None:
            return contextlib.nullcontext()
        if name not in self._limits:
            self._limits[name] = asyncio.Semaphore(bound)
        return self._limits[name]

    def close(self, sid: str) -> None:
        stream = self._streams.get(sid)
        if stream is None:
            return
        # Batches still waiting for their turn will not get it: tell their senders they were not
        # applied (a stopping client waits for an answer to every batch it sent).
        for p, lane in stream.lanes.items():
            for seq in sorted(lane.pending):
                peer, frame = lane.pending.pop(seq)
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
            self._spawn(self._forget_after(sid, committing))
        else:
            self._forget(sid)

    async def _forget_after(self, sid: str, committing: list[asyncio.Future[None]]) -> None:
        await asyncio.gather(*(asyncio.shield(f) for f in committing), return_exceptions=True)
        self._forget(sid)

    def _forget(self, sid: str) -> None:
        # Batches still waiting for a predecessor the client gave up on are dropped unanswered:
        # the client that closed the stream no longer waits for them.
        self._streams.pop(sid, None)
        self.stats.streams = len(self._streams)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- batches --------------------------------------------------------------------------

    def submit(self, peer: Peer, frame: Frame) -> None:
        """Take a batch frame (synchronous); its ack or error is sent to ``peer`` later."""
        sid, p, seq = frame["sid"], frame["p"], frame["seq"]
        self.stats.batches_received += 1
        stream = self._streams.get(sid)
        if stream is None:
            return self._reply_error(
                peer,
                _UnknownStreamError(
                    f"stream {sid} is not open on this node; send 'open' first", node=self.node_id
                ),
                frame,
            )
        if not 0 <= p < self._partitions or seq < 0:
            return self._reply_error(
                peer,
                _BadFrameError(
                    f"partition {p} / sequence {seq} out of range (partitions: {self._partitions})",
                    node=self.node_id,
                ),
                frame,
            )
        if not self._owns(p):
            return self._reply_error(
                peer,
                NotOwnerError(
                    f"partition {p} is not owned by this node; refresh the partition map",
                    node=self.node_id,
                    details={"map": self._map_wire()},
                ),
                frame,
            )
        lane = stream.lanes.setdefault(p, _Lane())
        base = frame.get("base", 0)
        if lane.failed_at is not None and base > lane.failed_at:
            # The client settled the failed batch another way (dead-letter table, or dropped):
            # nothing before ``base`` is pending any more, so the lane may go on from there.
            lane.failed_at = lane.failure = None
        if lane.failed_at is not None and seq >= lane.failed_at:
            err = lane.failure if seq == lane.failed_at else None
            return self._reply_error(peer, err or _lane_failed(self.node_id, p, lane), frame)
        results = lane.results
        while results and next(iter(results)) < base:  # the client has their acks
            results.popitem(last=False)
        if base > lane.next_seq:
            # The client has every batch below ``base`` acknowledged (by this node before, or by
            # a previous owner): start the lane there instead of waiting for them.
            lane.next_seq = base
            for stale in [s for s in lane.pending if s < base]:
                del lane.pending[stale]
        if seq < lane.next_seq or seq in lane.committing:
            self.stats.duplicates += 1
            self._spawn(self._ack_duplicate(peer, frame, lane))
            return None
        # The bound never refuses the batch the waiting ones need (the lane could not move),
        # and a lane that ``base`` moved onto a waiting batch runs even if this one is refused.
        if (
            seq not in lane.pending
            and seq != lane.next_seq
            and len(lane.pending) >= MAX_LANE_PENDING
        ):
            if lane.task is None and lane.next_seq in lane.pending:
                lane.task = self._spawn(self._run_lane(stream, p, lane))
            return self._reply_error(
                peer,
                OverloadedError(
                    f"more than {MAX_LANE_PENDING} batches of partition {p} waiting; lower "
                    "per_partition_in_flight",
                    node=self.node_id,
                ),
                frame,
            )
        lane.pending[seq] = (peer, frame)  # a resend of a waiting batch replaces its peer
        if lane.task is None:
            lane.task = self._spawn(self._run_lane(stream, p, lane))
        return None

    async def _run_lane(self, stream: _Stream, p: int, lane: _Lane) -> None:
        try:
            while lane.failure is None and lane.next_seq in lane.pending:
                seq = lane.next_seq
                peer, frame = lane.pending.pop(seq)
                durable: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                lane.committing[seq] = durable
                try:
                    ctx = await self._apply(stream, p, seq, peer, frame, lane)
                except ServerError as err:
                    del lane.committing[seq]
                    durable.set_exception(err)  # a resend waiting on it gets the same answer
                    durable.exception()
                    if is_retriable(err):  # the client resends this very batch; keep the lane
                        self._reply_error(peer, err, frame)
                        return
                    self._fail_lane(stream, p, lane, seq, err, peer, frame)
                    return
                if lane.failed_at is None:  # else the lane restarts from its failed batch
                    lane.next_seq = max(lane.next_seq, seq + 1)
                if ctx._durable:
                    lane.staged[seq] = list(ctx._durable)
                    # On a task of its own: the lane goes on while the writes commit.
                    self._spawn(self._finish(stream, p, lane, seq, ctx, durable, peer, frame))
                else:  # nothing to wait for (no table writes): acknowledged now, no task
                    self._acknowledge(lane, ctx, durable, peer, frame)
        finally:
            lane.task = None

    async def _apply(
        self, stream: _Stream, p: int, seq: int, peer: Peer, frame: Frame, lane: _Lane
    ) -> ReceiverContext:
        try:
            if ("items" in frame) == ("arrow" in frame):
                raise ProtocolError("a batch carries exactly one of 'items' and 'arrow'")  # noqa: TRY301
            if "arrow" in frame:
                if "del" in frame:
                    raise ProtocolError("an Arrow page carries its deletes as a column")  # noqa: TRY301
                page = decode_page(frame["arrow"], frame["n"])
                items: Sequence[Any] = page
                deletes = page.deletes
            else:
                items = unpack_items(frame["items"], frame["n"])
                deletes = frozenset(frame.get("del") or ())
            if any(not isinstance(i, int) or not 0 <= i < len(items) for i in deletes):
                # Translated below like a frame that fails to unpack.
                raise ProtocolError("'del' holds indexes outside the batch")  # noqa: TRY301
        except ProtocolError as exc:
            raise _BadFrameError(str(exc), node=self.node_id) from exc
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
        stream: _Stream,
        p: int,
        seq: int,
        peer: Peer,
        frame: Frame,
        lane: _Lane,
        items: Sequence[Any],
        deletes: frozenset[int],
        attempt: int,
    ) -> ReceiverContext:
        batch_failed = asyncio.Event()

        def abandoned() -> bool:
            # Read at commit time: writes of a batch that failed, or of batches behind a failed
            # one in the lane, must not land.
            if batch_failed.is_set() or (lane.failed_at is not None and seq > lane.failed_at):
                return True
            return any(
                earlier < seq and any(f.done() and f.exception() is not None for f in futures)
                for earlier, futures in lane.staged.items()
            )

        ctx = ReceiverContext(
            stream_id=stream.sid,
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
        lane.results[seq] = (produced, ctx._failed)
        while len(lane.results) > RESULT_REPLAY_BATCHES:
            lane.results.popitem(last=False)
        try:
            async with stream.limit:
                await self._call_receiver(stream.receiver, items, ctx, produced, peer, frame)
        except ServerError as err:
            batch_failed.set()
            err.node = err.node or self.node_id
            raise
        except Exception as exc:
            batch_failed.set()
            raise self._as_server_error(exc, stream, p, seq, frame["n"]) from exc
        except BaseException:
            batch_failed.set()
            raise
        finally:
            # Its staged writes may be committed now (or, if it failed, dropped).
            ctx._running = False
            if ctx._durable and self._writer is not None:
                self._writer.release()
        return ctx

    @staticmethod
    async def _call_receiver(
        receiver: Receiver,
        items: Sequence[Any],
        ctx: ReceiverContext,
        produced: list[Any],
        peer: Peer,
        frame: Frame,
    ) -> None:
        out = receiver.receive(items, ctx)
        if inspect.isasyncgen(out):
            async for value in out:
                produced.append(value)
                await peer.send(_result(frame, [value]))
            return
        values = await out if inspect.isawaitable(out) else out
        if values is not None:
            # Async generators went the other way; anything else must be a plain iterable
            # (else list() raises TypeError: the batch fails as a ReceiverError).
            values = list(cast("Iterable[Any]", values))
            produced.extend(values)
            for i in range(0, len(values), _RESULT_CHUNK):
                await peer.send(_result(frame, values[i : i + _RESULT_CHUNK]))

    def _as_server_error(
        self, exc: Exception, stream: _Stream, p: int, seq: int, n: int
    ) -> ServerError:
        """What the client is told when a receiver raised ``exc``."""
        if isinstance(exc, DeltaflowError):  # keeps the error's own retry decision
            return ServerError(str(exc), node=self.node_id, details={"retriable": exc.retriable})
        log.warning(
            "receiver %s failed on stream %s partition %d batch %d: %r",
            stream.receiver_name,
            stream.sid,
            p,
            seq,
            exc,
        )
        return ReceiverError(
            f"receiver {stream.receiver_name} raised {type(exc).__name__}: {exc} "
            f"(partition {p}, batch {seq}, {n} items)",
            node=self.node_id,
        )

    async def _finish(
        self,
        stream: _Stream,
        p: int,
        lane: _Lane,
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
            err = (
                exc
                if isinstance(exc, ServerError)
                else ServerError(f"commit failed: {exc!r}", node=self.node_id)
            )
            durable.set_exception(err)
            durable.exception()
            lane.committing.pop(seq, None)
            self._fail_lane(stream, p, lane, seq, err, peer, frame)
            lane.staged.pop(seq, None)
            return
        lane.staged.pop(seq, None)
        self._acknowledge(lane, ctx, durable, peer, frame)

    def _acknowledge(
        self,
        lane: _Lane,
        ctx: ReceiverContext,
        durable: asyncio.Future[None],
        peer: Peer,
        frame: Frame,
    ) -> None:
        """The batch is applied and durable: count it and queue its ack."""
        durable.set_result(None)
        lane.committing.pop(frame["seq"], None)
        self.stats.batches_acked += 1
        self.stats.items_applied += frame["n"] - len(ctx._failed)
        self.stats.items_failed += len(ctx._failed)
        self._send_soon(peer, _ack(frame, failed=ctx._failed))

    async def _ack_duplicate(self, peer: Peer, frame: Frame, lane: _Lane) -> None:
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
        for i in range(0, len(values), _RESULT_CHUNK):
            await peer.send(_result(frame, values[i : i + _RESULT_CHUNK]))
        await peer.send(_ack(frame, dup=True, failed=failed))

    def _fail_lane(
        self,
        stream: _Stream,
        p: int,
        lane: _Lane,
        seq: int,
        err: ServerError,
        peer: Peer,
        frame: Frame,
    ) -> None:
        # The lane is closed: resending its batches cannot succeed until the client settles the
        # failed one (a later ``base`` past it reopens the lane). Nothing from ``seq`` on counts
        # as applied: later batches' staged writes are abandoned before they commit.
        err.details["retriable"] = False
        if lane.failed_at is None or seq < lane.failed_at:
            lane.failed_at, lane.failure = seq, err
            lane.next_seq = min(lane.next_seq, seq)
            for later in [s for s in lane.results if s >= seq]:
                del lane.results[later]
        self.stats.batches_failed += 1
        self._reply_error(peer, err, frame)
        for later in sorted(lane.pending):
            later_peer, later_frame = lane.pending.pop(later)
            self._reply_error(later_peer, _lane_failed(self.node_id, p, lane), later_frame)

    def _reply_error(self, peer: Peer, err: ServerError, frame: Frame) -> None:
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
        task.add_done_callback(self._tasks.discard)
        return task


def _lane_failed(node: str, p: int, lane: _Lane) -> LaneFailedError:
    return LaneFailedError(
        f"not applied: batch {lane.failed_at} of partition {p} failed earlier "
        f"({lane.failure}), so later batches of the partition are refused to keep per-key order",
        node=node,
    )


def _ack(frame: Frame, *, dup: bool = False, failed: dict[int, str] | None = None) -> Frame:
    ack: Frame = {
        "t": "ack",
        "sid": frame["sid"],
        "p": frame["p"],
        "seq": frame["seq"],
        "n": frame["n"],
    }
    if dup:
        ack["dup"] = True
    if failed:
        ack["failed"] = [[i, failed[i]] for i in sorted(failed)]
    return ack


def _result(frame: Frame, values: list[Any]) -> Frame:
    return {
        "t": "result",
        "sid": frame["sid"],
        "p": frame["p"],
        "seq": frame["seq"],
        "values": values,
    }
