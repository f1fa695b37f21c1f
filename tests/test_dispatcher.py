"""Lane semantics of the node's dispatcher, driven frame by frame (no network, no tables), and
the logs a stalled lane leaves, read through a real node and client connection."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from deltaflow.client.connection import Connection
from deltaflow.errors import (
    CommitConflictError,
    ConnectionLostError,
    LaneFailedError,
    OverloadedError,
    ProtocolError,
    SchemaError,
    ServerError,
    UsageError,
)
from deltaflow.protocol import decode_frame, encode_frame, join_items, pack_item
from deltaflow.receivers import Receiver, ReceiverContext, ReceiverRegistry
from deltaflow.server import dispatcher as dispatcher_module
from deltaflow.server import lanes as lanes_module
from deltaflow.server.dispatcher import LANE_WINDOW, Dispatcher, error_frame
from deltaflow.server.streams import stream_owner
from deltaflow.testing import at_fault_point

from .support import StartCluster

#: The key every stream of these tests is opened with, and so their owner.
KEY = b"k" * 32
OWNER = stream_owner(KEY)


class Recorder(Receiver):
    """Records the order batches are applied in; can be told to block or fail."""

    applied: ClassVar[list[int]] = []
    gate: ClassVar[asyncio.Event | None] = None
    entered: ClassVar[asyncio.Event]
    fail: ClassVar[dict[int, Exception]] = {}

    async def receive(self, items: list[Any], ctx: ReceiverContext) -> list[Any]:
        Recorder.entered.set()
        if Recorder.gate is not None:
            await Recorder.gate.wait()
        if ctx.seq in Recorder.fail:
            raise Recorder.fail.pop(ctx.seq)
        Recorder.applied.append(ctx.seq)
        return items


#: How long a test waits for the node's answer to a batch: far above what a lane needs here
#: (milliseconds), so a missing answer fails the test quickly instead of hanging it.
ANSWER_WAIT = 2.0


async def eventually(condition: Callable[[], bool]) -> None:
    """Let the event loop run (turns only: no time passes) until ``condition`` holds."""
    async with asyncio.timeout(ANSWER_WAIT):
        while not condition():  # noqa: ASYNC110 -- a task's state, with nothing to wait on
            await asyncio.sleep(0)


class Peer:
    """A client connection: records the frames the node sends it, each checked against the wire
    protocol (a client refuses a frame that breaks it). ``backed_up``: ``send_nowait`` refuses
    every frame, as a connection above its high-water mark does. ``log``, shared by several
    peers, records the order of everything they were sent."""

    def __init__(
        self, log: list[tuple[Peer, dict[str, Any]]] | None = None, *, backed_up: bool = False
    ) -> None:
        self.frames: list[dict[str, Any]] = []
        self.invalid: list[tuple[dict[str, Any], Exception]] = []
        self.changed = asyncio.Event()
        self.log = log
        self.backed_up = backed_up

    async def send(self, frame: dict[str, Any]) -> None:
        self._record(frame)

    def send_nowait(self, frame: dict[str, Any]) -> bool:
        if self.backed_up:
            return False
        self._record(frame)
        return True

    def _record(self, frame: dict[str, Any]) -> None:
        try:
            decode_frame(encode_frame(frame))
        except ProtocolError as exc:
            self.invalid.append((frame, exc))
        self.frames.append(frame)
        if self.log is not None:
            self.log.append((self, frame))
        self.changed.set()

    async def wait_for(self, kind: str, seq: int) -> dict[str, Any]:
        try:
            async with asyncio.timeout(ANSWER_WAIT):
                while True:
                    assert not self.invalid, (
                        f"the node sent frames a client refuses: {self.invalid}"
                    )
                    for f in self.frames:
                        if f["t"] == kind and f.get("seq") == seq:
                            return f
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            pytest.fail(f"no {kind!r} frame for batch {seq} within {ANSWER_WAIT}s: {self.frames}")

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition`` holds of what the node sent."""
        async with asyncio.timeout(ANSWER_WAIT):
            while not condition():
                self.changed.clear()
                await self.changed.wait()

    def answers(self, seq: int) -> list[str]:
        return [f["t"] for f in self.frames if f.get("seq") == seq and f["t"] != "result"]

    def results(self, seq: int) -> list[list[Any]]:
        return [f["values"] for f in self.frames if f["t"] == "result" and f["seq"] == seq]


def make_dispatcher(receiver: type[Receiver], writer: Any = None, **options: Any) -> Dispatcher:
    """A dispatcher (node "n1", 4 partitions, owning every one unless ``options`` say otherwise)
    with stream "s" open on ``receiver``, registered as "r"."""
    registry = ReceiverRegistry()
    registry.register(receiver, "r")
    settings: dict[str, Any] = {"owns": lambda p: True, "map_wire": dict, "partitions": 4}
    settings.update(options)
    d = Dispatcher(node_id="n1", registry=registry, writer=writer, **settings)
    d.open("s", "r", None, KEY)
    return d


@pytest.fixture(autouse=True)
def fresh_receivers() -> None:
    """The test receivers keep their script and record in class attributes: every test starts
    from none (whatever order the tests run in)."""
    Recorder.applied, Recorder.gate, Recorder.fail = [], None, {}
    Recorder.entered = asyncio.Event()
    Scripted.calls, Scripted.results, Scripted.fail_items = [], {}, {}
    Scripted.errors, Scripted.gate, Scripted.writes = {}, None, {}


@pytest.fixture
def dispatcher() -> Dispatcher:
    return make_dispatcher(Recorder)


def batch(seq: int, *, base: int = 0, p: int = 0) -> dict[str, Any]:
    return {
        "t": "batch",
        "sid": "s",
        "p": p,
        "seq": seq,
        "n": 1,
        "items": join_items([pack_item(seq)]),
        "base": base,
    }


async def test_batches_arriving_out_of_order_are_applied_in_sequence(dispatcher: Dispatcher):
    peer = Peer()
    for seq in (2, 0, 1):
        dispatcher.submit(peer, batch(seq), OWNER)
    for seq in (0, 1, 2):
        assert (await peer.wait_for("ack", seq))["n"] == 1
    assert Recorder.applied == [0, 1, 2]


async def test_a_resend_during_apply_is_answered_once_the_original_lands(dispatcher: Dispatcher):
    Recorder.gate = asyncio.Event()
    first, second = Peer(), Peer()
    dispatcher.submit(first, batch(0), OWNER)
    await Recorder.entered.wait()  # the lane is applying seq 0
    dispatcher.submit(second, batch(0), OWNER)  # the client resent over a new connection
    Recorder.gate.set()
    assert (await second.wait_for("ack", 0)).get("dup") is True
    await first.wait_for("ack", 0)
    assert Recorder.applied == [0]


async def test_base_lets_a_new_owner_start_mid_stream(dispatcher: Dispatcher):
    peer = Peer()
    dispatcher.submit(peer, batch(7, base=7), OWNER)
    await peer.wait_for("ack", 7)
    # A late resend of an older, already acknowledged batch is not applied again.
    dispatcher.submit(peer, batch(3, base=3), OWNER)
    assert (await peer.wait_for("ack", 3)).get("dup") is True
    assert Recorder.applied == [7]


@pytest.mark.parametrize("error", [ValueError("boom"), UsageError("bad args")])
async def test_a_failed_batch_closes_its_lane_for_good(dispatcher: Dispatcher, error: Exception):
    Recorder.fail = {1: error}
    peer = Peer()
    for seq in (0, 1, 2):
        dispatcher.submit(peer, batch(seq), OWNER)
    await peer.wait_for("ack", 0)
    failed = await peer.wait_for("error", 1)
    assert failed["retriable"] is False
    assert str(error) in failed["msg"]
    behind = await peer.wait_for("error", 2)
    assert behind["code"] == "LANE_FAILED" and "batch 1 of partition 0 failed" in behind["msg"]
    peer.frames.clear()
    dispatcher.submit(peer, batch(1), OWNER)  # a resend cannot succeed either
    assert (await peer.wait_for("error", 1))["retriable"] is False
    assert Recorder.applied == [0]
    # Other partitions are unaffected.
    dispatcher.submit(peer, batch(0, p=1), OWNER)
    await peer.wait_for("ack", 0)


async def test_a_retriable_failure_keeps_the_lane_for_the_resend(dispatcher: Dispatcher):
    Recorder.fail = {0: OverloadedError("busy")}
    peer = Peer()
    dispatcher.submit(peer, batch(0), OWNER)
    dispatcher.submit(peer, batch(1), OWNER)
    err = await peer.wait_for("error", 0)
    assert err["retriable"] is True
    peer.frames.clear()
    dispatcher.submit(peer, batch(0), OWNER)
    await peer.wait_for("ack", 0)
    await peer.wait_for("ack", 1)
    assert Recorder.applied == [0, 1]


async def test_a_bug_outside_the_receiver_answers_its_batch_and_the_lane_goes_on(
    dispatcher: Dispatcher, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception nothing expects, raised in the lane before the receiver runs, is the
    batch's answer (a retriable internal error naming the node and the batch, its traceback in
    the node's log): the client is not left waiting, and the resend is applied."""
    raised = []

    def bug() -> None:
        if not raised:
            raised.append(1)
            raise KeyError("a bug")

    peer = Peer()
    with caplog.at_level(logging.ERROR), at_fault_point("applying", bug):
        dispatcher.submit(peer, batch(0), OWNER)
        dispatcher.submit(peer, batch(1), OWNER)
        err = await peer.wait_for("error", 0)
        assert (err["code"], err["retriable"], err["node"]) == ("INTERNAL", True, "n1")
        assert "stream s partition 0 batch 0 with KeyError" in err["msg"]
        assert any(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records)
        dispatcher.submit(peer, batch(0), OWNER)
        await peer.wait_for("ack", 0)
        await peer.wait_for("ack", 1)
    assert Recorder.applied == [0, 1]


class FakeEngine:
    """Stages writes and commits them one by one like the engine's isolation path: each entry
    checks ``abandoned`` right before its commit, with no pause after the previous one."""

    def __init__(self, fail_seq: int) -> None:
        self.fail_seq = fail_seq
        self.entries: list[tuple[int, Any, asyncio.Future[None]]] = []
        self.committed: list[int] = []
        self.three_staged = asyncio.Event()

    async def stage(
        self,
        table: str,
        key: Any,
        rows: Any,
        deletes: Any,
        *,
        abandoned: Any,
        mark: Any = None,
        held: Any = None,
        sequence: Any = None,
    ) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.entries.append((mark[1][0], abandoned, fut))
        if len(self.entries) == 3:
            self.three_staged.set()
        return fut

    def release(self) -> None:
        pass

    def forget_lanes(self, tables: Any, lanes: Any) -> None:
        pass

    def commit_all(self) -> None:
        for seq, abandoned, fut in self.entries:
            if abandoned():
                fut.set_exception(OverloadedError("abandoned"))
            elif seq == self.fail_seq:
                fut.set_exception(ValueError("commit failed"))
            else:
                self.committed.append(seq)
                fut.set_result(None)


class TableWriterReceiver(Receiver):
    async def receive(self, items: list[Any], ctx: ReceiverContext) -> None:
        await ctx.table("t", key="id").upsert([{"id": i} for i in items])


async def test_a_failed_commit_abandons_later_batches_of_its_lane_before_they_commit() -> None:
    engine = FakeEngine(fail_seq=0)
    d = make_dispatcher(TableWriterReceiver, engine)
    peer = Peer()
    for seq in (0, 1, 2):
        d.submit(peer, batch(seq), OWNER)
    await engine.three_staged.wait()  # all staged: the lane does not wait for commits
    engine.commit_all()
    assert engine.committed == []
    for seq in (0, 1, 2):
        assert (await peer.wait_for("error", seq))["retriable"] is False


# -- what the node answers, frame by frame ----------------------------------------------------


@pytest.fixture(autouse=True)
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """Fails a test that left an error for the event loop to report (a task of the dispatcher
    that died with an exception no one retrieved): on a node that is an error in the log and
    an answer that never comes."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    yield errors
    gc.collect()
    loop.set_exception_handler(None)
    assert errors == [], f"errors left for the event loop: {errors}"


class Scripted(Receiver):
    """Does what the test scripted for each batch (by seq): returns ``results``, marks
    ``fail_items`` failed, raises the next of ``errors`` (one per attempt), waits at ``gate``.
    Records every call's items and context."""

    calls: ClassVar[list[tuple[list[Any], ReceiverContext]]] = []
    results: ClassVar[dict[int, list[Any]]] = {}
    fail_items: ClassVar[dict[int, dict[int, str]]] = {}
    errors: ClassVar[dict[int, list[BaseException]]] = {}
    gate: ClassVar[asyncio.Event | None] = None
    writes: ClassVar[dict[int, list[str]]] = {}  # seq -> tables written (before the gate)

    async def receive(self, items: list[Any], ctx: ReceiverContext) -> list[Any] | None:
        Scripted.calls.append((list(items), ctx))
        for table in Scripted.writes.get(ctx.seq, []):
            await ctx.table(table, key="id").upsert([{"id": i} for i in items])
        if Scripted.gate is not None:
            await Scripted.gate.wait()
        for index, reason in Scripted.fail_items.get(ctx.seq, {}).items():
            ctx.fail(index, reason)
        if Scripted.errors.get(ctx.seq):
            raise Scripted.errors[ctx.seq].pop(0)
        return Scripted.results.get(ctx.seq)


class IdempotentScripted(Scripted):
    idempotent = True


class SideInputs:
    """The node's side-input store, holding one version of "prices"."""

    def get(self, name: str, parse: Callable[[bytes], Any] | None = None) -> Any:
        return f"{name}@1"


@pytest.fixture
def scripted() -> type[Scripted]:
    return Scripted


def frame(seq: int, items: list[Any] | None = None, *, p: int = 0, **extra: Any) -> dict[str, Any]:
    """A batch frame of stream "s" (items: ``[seq]`` unless given)."""
    items = [seq] if items is None else items
    return {
        "t": "batch",
        "sid": "s",
        "p": p,
        "seq": seq,
        "n": len(items),
        "items": join_items(pack_item(i) for i in items),
        **extra,
    }


def test_an_error_frame_carries_the_code_message_node_and_the_retry_decision() -> None:
    err = SchemaError("column 'v' is long", node="n2", details={"item": 3, "column": "v"})
    assert error_frame(err, sid="s", p=1, seq=7, ignored=None) == {
        "t": "error",
        "code": "SCHEMA_MISMATCH",
        "msg": "column 'v' is long",
        "node": "n2",
        "retriable": False,
        "details": {"item": 3, "column": "v"},
        "sid": "s",
        "p": 1,
        "seq": 7,
    }
    # A decision taken for this one error (a receiver's own) overrides its class's; an error
    # without a message says its code.
    overridden = OverloadedError("busy", retriable=False)
    assert error_frame(overridden) == {
        "t": "error",
        "code": "OVERLOADED",
        "msg": "busy",
        "node": None,
        "retriable": False,
    }
    bare = ServerError("")
    bare.args = ()
    assert error_frame(bare)["msg"] == "INTERNAL"


async def test_a_batch_of_an_unknown_stream_is_refused_with_what_to_do(
    dispatcher: Dispatcher,
) -> None:
    peer = Peer()
    dispatcher.submit(peer, {**batch(0), "sid": "other"}, OWNER)
    err = await peer.wait_for("error", 0)
    assert err == {
        "t": "error",
        "code": "UNKNOWN_STREAM",
        "msg": "stream 'other' is not open on this connection; send 'open' first",
        "node": "n1",
        "retriable": True,
        "sid": "other",
        "p": 0,
        "seq": 0,
    }
    assert dispatcher.stats.batches_received == 1


@pytest.mark.parametrize(("p", "seq"), [(4, 0), (-1, 0), (0, -1), (4, -1), (0, 2**43)])
async def test_a_batch_outside_the_partitions_or_sequence_is_a_bad_frame(
    dispatcher: Dispatcher, p: int, seq: int
) -> None:
    peer = Peer()
    dispatcher.submit(peer, batch(seq, p=p), OWNER)
    err = await peer.wait_for("error", seq)
    assert (err["code"], err["retriable"], err["node"], err["p"]) == ("BAD_FRAME", False, "n1", p)
    assert err["msg"] == (
        f"partition {p} / sequence {seq} out of range (partitions: 4, sequences below 2**43)"
    )
    assert Recorder.applied == []
    dispatcher.submit(peer, batch(0, p=3), OWNER)  # the last partition is in range
    await peer.wait_for("ack", 0)


async def test_a_partition_this_node_does_not_own_is_refused_with_the_current_map() -> None:
    d = make_dispatcher(Recorder, owns=lambda p: p != 2, map_wire=lambda: {"version": 9})
    peer = Peer()
    d.submit(peer, batch(0, p=2), OWNER)
    err = await peer.wait_for("error", 0)
    assert err["code"] == "NOT_OWNER" and err["retriable"] is True and err["node"] == "n1"
    assert err["msg"] == "partition 2 is not owned by this node; refresh the partition map"
    assert err["details"] == {"map": {"version": 9}}
    d.submit(peer, batch(0, p=1), OWNER)
    await peer.wait_for("ack", 0)


async def test_a_batch_that_taken_ones_wait_for_is_taken_after_the_partition_moved() -> None:
    """Batch 1 was taken while this node owned the partition, and waits for batch 0. The
    partition then moved: batch 0 is still taken (or both would wait for the client's ack
    timeout), and applied before batch 1; a later batch is refused."""
    owned = {0: True}
    d = make_dispatcher(Recorder, owns=lambda p: owned[p], map_wire=lambda: {"version": 9})
    peer = Peer()
    d.submit(peer, batch(1), OWNER)
    owned[0] = False
    d.submit(peer, batch(2), OWNER)
    assert (await peer.wait_for("error", 2))["code"] == "NOT_OWNER"
    d.submit(peer, batch(0), OWNER)
    await peer.wait_for("ack", 0)
    await peer.wait_for("ack", 1)
    assert Recorder.applied == [0, 1]


async def test_a_batch_waiting_for_a_predecessor_that_never_comes_is_logged_on_both_sides(
    warehouse: Path,
    start_cluster: StartCluster,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What an operator reads when a lane stalls: the node logs the batches waiting for one
    that has not reached it, once, and the client logs the answer that did not come within
    its ack timeout, naming the stream, partition, batch, attempt, base and node."""
    monkeypatch.setattr(dispatcher_module, "LANE_WAIT_LOG_SECONDS", 0.2)
    (node,) = await start_cluster(warehouse, count=1, engine="delta-rs")
    conn = await Connection.open(node.address, token=None, client_id="c1")
    try:
        await conn.open_stream("stalled", "deltaflow.testing.Echo", None, None, key=KEY)
        with caplog.at_level(logging.INFO, logger="deltaflow"):
            with pytest.raises(ConnectionLostError, match="no ack from node node-1"):
                await conn.send_batch({**batch(2, base=1), "sid": "stalled", "att": 3}, timeout=1.0)
            await conn.send_batch({**batch(1, base=1), "sid": "stalled"}, timeout=5.0)
    finally:
        await conn.close()
    waits = [r.getMessage() for r in caplog.records if "have waited" in r.getMessage()]
    assert len(waits) == 1, waits  # one line per wait, not one per check
    assert "stream stalled partition 0: batches 2 to 2 have waited 0." in waits[0]
    assert "for batch 1, which has not reached this node (it owns the partition)" in waits[0]
    [lost] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert lost.getMessage().startswith(
        f"no answer from node node-1 at {node.address} to stream stalled partition 0 batch 2 "
        "(attempt 3, base 1) in 1.0s"
    )


async def test_a_lane_takes_only_batches_inside_its_window_above_base(
    scripted: type[Scripted],
) -> None:
    d = make_dispatcher(scripted)
    first, again = Peer(), Peer()
    for seq in range(1, LANE_WINDOW):  # all wait for batch 0
        d.submit(first, frame(seq, base=0), OWNER)
    d.submit(first, frame(LANE_WINDOW, base=0), OWNER)
    err = await first.wait_for("error", LANE_WINDOW)
    assert (err["code"], err["retriable"], err["node"]) == ("BAD_FRAME", False, "n1")
    assert err["msg"] == (
        f"batch {LANE_WINDOW} of stream 's' partition 0 has base 0: a node takes a batch only "
        f"when 0 <= base <= seq < base + {LANE_WINDOW} (the lane's window)"
    )
    d.submit(first, frame(3, base=4), OWNER)  # base above seq: refused, moves nothing
    assert (await first.wait_for("error", 3))["code"] == "BAD_FRAME"
    assert scripted.calls == []
    # A resend of a waiting batch is taken (its answer goes to the resend's connection); this
    # one says the client has batch 0 acknowledged, so the lane goes on from batch 1.
    d.submit(again, frame(5, base=1), OWNER)
    await first.wait_for("ack", LANE_WINDOW - 1)
    assert (await again.wait_for("ack", 5))["n"] == 1
    assert first.answers(5) == []
    d.submit(first, frame(LANE_WINDOW, base=1), OWNER)
    await first.wait_for("ack", LANE_WINDOW)
    assert [ctx.seq for _, ctx in scripted.calls] == list(range(1, LANE_WINDOW + 1))


async def test_the_batch_a_full_window_waits_for_is_taken(scripted: type[Scripted]) -> None:
    d = make_dispatcher(scripted)
    peer = Peer()
    for seq in range(1, LANE_WINDOW):
        d.submit(peer, frame(seq, base=0), OWNER)
    d.submit(peer, frame(0, base=0), OWNER)
    await peer.wait_for("ack", LANE_WINDOW - 1)
    assert [peer.answers(seq) for seq in range(LANE_WINDOW)] == [["ack"]] * LANE_WINDOW


async def test_a_batch_outside_the_window_leaves_an_idle_lane_where_it_was(
    scripted: type[Scripted],
) -> None:
    d = make_dispatcher(scripted)
    peer = Peer()
    for seq in range(2, LANE_WINDOW):  # they wait for 0 and 1
        d.submit(peer, frame(seq, base=0), OWNER)
    await eventually(lambda: d.streams.get("s", OWNER).lanes[0].task is None)  # the lane is idle
    # A base far ahead with a seq past its window: refused, and the lane does not move there
    # (it would skip batches 0 and 1 as duplicates, and drop the waiting ones).
    d.submit(peer, frame(LANE_WINDOW + 10, base=10), OWNER)
    assert (await peer.wait_for("error", LANE_WINDOW + 10))["code"] == "BAD_FRAME"
    for seq in (0, 1):
        d.submit(peer, frame(seq, base=0), OWNER)
    await peer.wait_for("ack", LANE_WINDOW - 1)
    assert [ctx.seq for _, ctx in scripted.calls] == list(range(LANE_WINDOW))
    assert [peer.answers(seq) for seq in range(LANE_WINDOW)] == [["ack"]] * LANE_WINDOW


async def test_a_lane_that_base_moves_past_its_running_batch_still_runs_one_at_a_time(
    scripted: type[Scripted],
) -> None:
    d = make_dispatcher(scripted)
    scripted.gate = asyncio.Event()
    peer = Peer()
    d.submit(peer, frame(0), OWNER)
    await eventually(lambda: len(scripted.calls) == 1)  # batch 0 is in receive()
    for seq in range(1, LANE_WINDOW):
        d.submit(peer, frame(seq), OWNER)
    # The client has batch 0 acknowledged elsewhere (a failover): base moves the lane onto
    # batch 1 while batch 0 still runs here.
    d.submit(peer, frame(LANE_WINDOW, base=1), OWNER)
    for _ in range(10):
        await asyncio.sleep(0)
    assert [ctx.seq for _, ctx in scripted.calls] == [0], "a second receive() of the lane ran"
    scripted.gate.set()
    await peer.wait_for("ack", LANE_WINDOW)
    assert [ctx.seq for _, ctx in scripted.calls] == list(range(LANE_WINDOW + 1))
    assert [peer.answers(seq) for seq in range(LANE_WINDOW + 1)] == [["ack"]] * (LANE_WINDOW + 1)


def test_a_stream_id_outside_the_allowed_characters_is_refused(dispatcher: Dispatcher) -> None:
    with pytest.raises(ServerError) as info:
        dispatcher.open("a b", "r", None, KEY)
    assert info.value.code == "BAD_FRAME" and info.value.node == "n1"
    assert info.value.args[0] == (
        "stream id 'a b' is not allowed: use 1 to 160 characters of A-Z a-z 0-9 . _ : -"
    )
    with pytest.raises(ServerError, match=r"stream id '(x){64}' is not allowed"):
        dispatcher.open("x" * 200, "r", None, KEY)  # named by its first 64 characters


def test_a_stream_key_outside_16_to_64_bytes_is_refused(dispatcher: Dispatcher) -> None:
    for key in (b"k" * 15, b"k" * 65):
        with pytest.raises(ServerError) as info:
            dispatcher.open("s2", "r", None, key)
        assert info.value.code == "BAD_FRAME" and info.value.node == "n1"
        assert info.value.args[0] == (
            f"stream 's2' was opened with a key of {len(key)} bytes; a stream key has 16 to 64 "
            "bytes (the deltaflow client sends 32)"
        )
    assert dispatcher.open("s2", "r", None, b"k" * 16) == stream_owner(b"k" * 16)
    assert dispatcher.stats.streams == 2


def test_a_node_holds_at_most_max_streams_open(
    dispatcher: Dispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client holding the token cannot make a node keep streams without bound, nor lock
    others out by opening streams and going away: at the bound the oldest stream that no
    connection holds is forgotten."""
    from deltaflow.server import streams

    monkeypatch.setattr(streams, "MAX_STREAMS", 3)
    for i in range(2):  # "s" is open already
        dispatcher.open(f"more{i}", "r", None, KEY)
    for sid in ("s", "more0", "more1"):
        dispatcher.streams.hold(sid, OWNER)
    with pytest.raises(ServerError) as info:
        dispatcher.open("one-too-many", "r", None, KEY)
    assert info.value.code == "OVERLOADED" and info.value.retriable
    assert "this node has 3 streams open, its most" in info.value.args[0]
    dispatcher.open("s", "r", None, KEY)  # an open stream opens again
    dispatcher.close("more0", OWNER)
    dispatcher.open("one-too-many", "r", None, KEY)
    dispatcher.streams.release("more1", OWNER)  # its connection went away
    dispatcher.open("another", "r", None, KEY)
    assert dispatcher.streams.get("more1", OWNER) is None
    assert dispatcher.streams.get("s", OWNER) is not None


async def test_the_same_id_under_another_key_is_a_stream_of_its_own(
    scripted: type[Scripted],
) -> None:
    """An intruder who opens the owner's id under its own key, even with a different
    receiver, gets lanes of its own: its base jump moves none of the owner's, its batches
    carry its own owner (and so lane marks), and closing its stream leaves the owner's."""
    d = make_dispatcher(scripted)
    d.streams.registry.register(scripted, "r2")
    intruder = d.open("s", "r2", None, b"i" * 32)
    assert intruder != OWNER and d.stats.streams == 2
    peer, bad = Peer(), Peer()
    d.submit(bad, frame(10**6, base=10**6), intruder)
    await bad.wait_for("ack", 10**6)
    d.submit(peer, frame(0), OWNER)
    assert (await peer.wait_for("ack", 0)).get("dup") is None
    d.close("s", intruder)
    d.submit(peer, frame(1), OWNER)
    await peer.wait_for("ack", 1)
    assert [(ctx.seq, ctx.stream_id, ctx.stream_owner) for _, ctx in scripted.calls] == [
        (10**6, "s", intruder),
        (0, "s", OWNER),
        (1, "s", OWNER),
    ]
    marks = [ctx._next_mark("t")[0] for _, ctx in scripted.calls]
    assert marks == [f"s/{intruder}/0", f"s/{OWNER}/0", f"s/{OWNER}/0"]
    # A frame of the stream from a connection that did not open it names no owner.
    d.submit(bad, frame(2), None)
    assert (await bad.wait_for("error", 2))["code"] == "UNKNOWN_STREAM"


async def test_reopening_a_stream_keeps_its_lanes_but_not_with_another_receiver(
    dispatcher: Dispatcher,
) -> None:
    peer = Peer()
    dispatcher.submit(peer, batch(0), OWNER)
    await peer.wait_for("ack", 0)
    dispatcher.open("s", "r", {"other": "args"}, KEY)  # a new connection of the same stream
    assert dispatcher.stats.streams == 1
    result = {"t": "result", "sid": "s", "p": 0, "seq": 0, "values": [0]}
    assert peer.frames == [result, {"t": "ack", "sid": "s", "p": 0, "seq": 0, "n": 1}]
    resent = Peer()
    dispatcher.submit(resent, batch(0), OWNER)
    await resent.wait_for("ack", 0)
    dup = {"t": "ack", "sid": "s", "p": 0, "seq": 0, "n": 1, "dup": True}
    assert resent.frames == [result, dup], "a resend gets the results again, then a dup ack"
    assert Recorder.applied == [0]
    assert dispatcher.stats.duplicates == 1
    with pytest.raises(ServerError) as info:
        dispatcher.open("s", "other", None, KEY)
    assert info.value.code == "BAD_FRAME" and info.value.node == "n1"
    assert info.value.args[0] == "stream 's' was opened with receiver 'r', not 'other'"


def test_a_receiver_that_cannot_be_created_fails_the_open(dispatcher: Dispatcher) -> None:
    class Broken(Receiver):
        def __init__(self) -> None:
            raise RuntimeError("no config")

    dispatcher.streams.registry.register(Broken, "broken")
    with pytest.raises(ServerError) as info:
        dispatcher.open("t", "broken", None, KEY)
    assert info.value.code == "RECEIVER_FAILED" and info.value.node == "n1"
    assert info.value.args[0] == "receiver broken could not be created: RuntimeError: no config"
    with pytest.raises(ServerError) as unknown:
        dispatcher.open("t", "nope", None, KEY)
    assert unknown.value.code == "UNKNOWN_RECEIVER" and unknown.value.node == "n1"
    assert dispatcher.stats.streams == 1


async def test_the_receiver_sees_the_batch_its_stream_and_its_deletes(
    scripted: type[Scripted],
) -> None:
    side_inputs = SideInputs()
    d = make_dispatcher(scripted, side_inputs=side_inputs)
    d.open("t", "r", {"limit": 3}, KEY)
    peer = Peer()
    d.submit(
        peer,
        {**frame(4, ["a", "b", "c"], p=2), "sid": "t", "del": [0, 2], "att": 3, "base": 4},
        OWNER,
    )
    await peer.wait_for("ack", 4)
    [(items, ctx)] = scripted.calls
    assert items == ["a", "b", "c"]
    assert (ctx.stream_id, ctx.partition, ctx.seq, ctx.node_id) == ("t", 2, 4, "n1")
    assert ctx.args == {"limit": 3}
    assert ctx.deletes == frozenset({0, 2}) and ctx.is_delete(2) and not ctx.is_delete(1)
    assert ctx.attempt == 3 and ctx.redelivered
    assert ctx.side_input("prices") == "prices@1"
    with pytest.raises(IndexError, match="outside the batch of 3 items"):
        ctx.fail(3, "no such item")
    d.submit(peer, frame(0), OWNER)  # no att: a first delivery
    await peer.wait_for("ack", 0)
    assert scripted.calls[1][1].attempt == 1 and scripted.calls[1][1].deletes == frozenset()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"arrow": b""}, "a batch carries exactly one of 'items' and 'arrow'"),
        ({"items": None}, "a batch carries exactly one of 'items' and 'arrow'"),
        ({"del": [3]}, "'del' holds indexes outside the batch"),
        ({"del": [-1]}, "'del' holds indexes outside the batch"),
        ({"del": ["0"]}, "'del' holds indexes outside the batch"),
        ({"del": [[0]]}, "'del' holds indexes outside the batch"),  # found by test_fuzz.py
        ({"del": [{}]}, "'del' holds indexes outside the batch"),
        ({"items": b"\xc1"}, "batch items are not valid msgpack"),
    ],
)
async def test_a_batch_frame_that_makes_no_sense_is_refused_as_a_bad_frame(
    scripted: type[Scripted], extra: dict[str, Any], message: str
) -> None:
    d = make_dispatcher(scripted)
    bad = {**frame(0, [10, 11, 12]), **extra}
    if bad["items"] is None:
        del bad["items"]
    peer = Peer()
    d.submit(peer, bad, OWNER)
    err = await peer.wait_for("error", 0)
    assert (err["code"], err["retriable"], err["node"]) == ("BAD_FRAME", False, "n1")
    assert err["msg"].startswith(message)
    assert scripted.calls == []


async def test_an_arrow_page_reaches_the_receiver_as_rows_with_its_deletes(
    scripted: type[Scripted],
) -> None:
    import pyarrow as pa

    from deltaflow.columnar import DELETE_COLUMN, ArrowRows, encode_page

    d = make_dispatcher(scripted)
    page = ArrowRows.of(pa.table({"id": [1, 2, 3], DELETE_COLUMN: [False, True, False]}))
    peer = Peer()
    arrow = {**frame(0, [None] * 3), "arrow": encode_page(page)}
    del arrow["items"]
    d.submit(peer, arrow, OWNER)
    await peer.wait_for("ack", 0)
    [(items, ctx)] = scripted.calls
    assert items == [{"id": 1}, {"id": 2}, {"id": 3}]
    assert ctx.deletes == frozenset({1})
    d.submit(peer, {**arrow, "seq": 1, "del": [0]}, OWNER)
    err = await peer.wait_for("error", 1)
    assert err["msg"] == "an Arrow page carries its deletes as a column"
    d.submit(peer, {**arrow, "p": 1, "n": 2}, OWNER)
    answer = await peer.wait_for("error", 0)
    assert answer["msg"] == "'arrow' holds more than 2 rows (the frame's n)"


async def test_results_come_back_in_chunks_before_an_ack_that_lists_failed_items(
    scripted: type[Scripted],
) -> None:
    d = make_dispatcher(scripted)
    scripted.results[0] = list(range(2500))
    scripted.fail_items[0] = {2: "negative", 0: "too large"}
    peer = Peer()
    d.submit(peer, frame(0, [5, 6, 7, 8]), OWNER)
    ack = await peer.wait_for("ack", 0)
    assert peer.results(0) == [list(range(1000)), list(range(1000, 2000)), list(range(2000, 2500))]
    assert peer.frames[-1] is ack, "the ack came before a result"
    assert ack == {
        "t": "ack",
        "sid": "s",
        "p": 0,
        "seq": 0,
        "n": 4,
        "failed": [[0, "too large"], [2, "negative"]],
    }
    d.submit(peer, frame(1, [9]), OWNER)
    assert await peer.wait_for("ack", 1) == {"t": "ack", "sid": "s", "p": 0, "seq": 1, "n": 1}
    assert peer.results(1) == []
    stats = d.stats
    assert (stats.batches_received, stats.batches_acked) == (2, 2)
    assert (stats.items_applied, stats.items_failed, stats.batches_failed) == (3, 2, 0)


class Yielding(Receiver):
    """Streams a result per item while the batch runs."""

    async def receive(self, items: list[Any], ctx: ReceiverContext) -> AsyncIterator[Any]:
        for item in items:
            yield item * 10


class Plain(Receiver):
    """A receiver whose ``receive`` is a plain function returning an iterable."""

    def receive(self, items: list[Any], ctx: ReceiverContext) -> Any:  # type: ignore[override]
        return (item + 1 for item in items)


async def test_results_of_every_kind_of_receiver_reach_the_client_and_are_replayed() -> None:
    for receiver, expected in ((Yielding, [[10], [20], [30]]), (Plain, [[2, 3, 4]])):
        d = make_dispatcher(receiver)
        peer, resent = Peer(), Peer()
        d.submit(peer, frame(0, [1, 2, 3]), OWNER)
        await peer.wait_for("ack", 0)
        assert peer.results(0) == expected, receiver.__name__
        d.submit(
            resent, frame(0, [1, 2, 3]), OWNER
        )  # the ack was lost: results again, then the ack
        await resent.wait_for("ack", 0)
        replayed = [value for values in resent.results(0) for value in values]
        assert replayed == [value for values in expected for value in values], receiver.__name__


async def test_a_resend_after_a_lost_ack_gets_results_and_failed_items_again(
    scripted: type[Scripted],
) -> None:
    d = make_dispatcher(scripted)
    scripted.results[0] = list(range(1500))
    scripted.fail_items[0] = {1: "bad"}
    peer, resent, late = Peer(), Peer(), Peer()
    d.submit(peer, frame(0, [1, 2]), OWNER)
    await peer.wait_for("ack", 0)
    d.submit(resent, frame(0, [1, 2]), OWNER)
    dup = await resent.wait_for("ack", 0)
    assert resent.results(0) == [list(range(1000)), list(range(1000, 1500))]
    assert dup["dup"] is True and dup["failed"] == [[1, "bad"]]
    assert len(scripted.calls) == 1, "the batch ran again"
    # Once the client's base passed the batch it has the ack: a late resend gets no results.
    scripted.results[1] = ["r1"]
    d.submit(peer, frame(1, base=1), OWNER)
    await peer.wait_for("ack", 1)
    resent_1 = Peer()
    d.submit(resent_1, frame(1, base=1), OWNER)  # base 1: the client does not have batch 1's ack
    await resent_1.wait_for("ack", 1)
    assert resent_1.results(1) == [["r1"]]
    d.submit(late, frame(0, [1, 2], base=0), OWNER)
    assert (await late.wait_for("ack", 0)) == {
        "t": "ack",
        "sid": "s",
        "p": 0,
        "seq": 0,
        "n": 2,
        "dup": True,
    }
    assert late.results(0) == []
    assert d.stats.duplicates == 3


async def apply_three_with_results(d: Dispatcher, scripted: type[Scripted]) -> Peer:
    """Batches 0-2 each return one result; returns the peer once all three are acked."""
    peer = Peer()
    for seq in range(3):
        scripted.results[seq] = [f"r{seq}"]
        d.submit(peer, frame(seq), OWNER)
    await peer.wait_for("ack", 2)
    return peer


async def replay_three(d: Dispatcher, **extra: Any) -> dict[int, list[object]]:
    """Resends batches 0-2 on fresh connections; returns the results each ack carried."""
    replayed = {}
    for seq in range(3):
        resent = Peer()
        d.submit(resent, frame(seq, **extra), OWNER)
        await resent.wait_for("ack", seq)
        replayed[seq] = resent.results(seq)
    return replayed


async def test_results_are_dropped_only_for_batches_the_client_has_acks_for(
    scripted: type[Scripted],
) -> None:
    d = make_dispatcher(scripted)
    peer = await apply_three_with_results(d, scripted)
    d.submit(peer, frame(3, base=1), OWNER)  # the client has batch 0's ack, not 1's or 2's
    await peer.wait_for("ack", 3)
    assert await replay_three(d) == {0: [], 1: [["r1"]], 2: [["r2"]]}


async def test_results_are_kept_for_the_latest_batches_only(
    scripted: type[Scripted], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lanes_module, "RESULT_REPLAY_BATCHES", 2)
    d = make_dispatcher(scripted)
    await apply_three_with_results(d, scripted)
    assert await replay_three(d) == {0: [], 1: [["r1"]], 2: [["r2"]]}


async def test_a_receiver_that_raises_fails_its_batch_with_an_error_naming_it(
    scripted: type[Scripted], caplog: pytest.LogCaptureFixture
) -> None:
    d = make_dispatcher(scripted)
    scripted.errors[0] = [KeyError("price")]
    peer = Peer()
    with caplog.at_level(logging.WARNING, logger="deltaflow.server"):
        d.submit(peer, frame(0, [1, 2, 3]), OWNER)
        err = await peer.wait_for("error", 0)
    assert (err["code"], err["node"], err["retriable"]) == ("RECEIVER_FAILED", "n1", False)
    assert err["msg"] == "receiver r raised KeyError: 'price' (partition 0, batch 0, 3 items)"
    [record] = caplog.records
    assert record.getMessage() == (
        "receiver r failed on stream s partition 0 batch 0: KeyError('price')"
    )
    assert d.stats.batches_failed == 1 and d.stats.batches_acked == 0


@pytest.mark.parametrize(
    ("error", "code", "node", "retriable"),
    [
        (UsageError("bad receiver_args"), "INTERNAL", "n1", False),
        (ConnectionLostError("service gone"), "INTERNAL", "n1", True),
        (SchemaError("no column v"), "SCHEMA_MISMATCH", "n1", False),
        (SchemaError("no column v", node="n7"), "SCHEMA_MISMATCH", "n7", False),
    ],
)
async def test_a_deltaflow_error_from_a_receiver_keeps_its_own_retry_decision(
    scripted: type[Scripted], error: Exception, code: str, node: str, retriable: bool
) -> None:
    d = make_dispatcher(scripted)
    scripted.errors[0] = [error]
    peer = Peer()
    d.submit(peer, frame(0), OWNER)
    err = await peer.wait_for("error", 0)
    assert (err["code"], err["node"], err["retriable"]) == (code, node, retriable)
    assert err["msg"] == (str(error) if code == "INTERNAL" else error.args[0])


async def test_an_idempotent_receiver_is_retried_on_the_node_quickly_with_a_rising_attempt() -> (
    None
):
    d = make_dispatcher(IdempotentScripted)
    Scripted.calls, Scripted.errors = [], {0: [OverloadedError("busy")] * 2}
    Scripted.results = {0: ["done"]}
    peer = Peer()
    loop = asyncio.get_running_loop()
    started = loop.time()
    d.submit(peer, frame(0, [7, 8], p=1, att=2, **{"del": [1]}), OWNER)
    await peer.wait_for("ack", 0)
    # Backoff 0.05 s, then 0.1 s: cheaper than a round trip through the client.
    assert 0.15 <= loop.time() - started < 1.0
    assert [ctx.attempt for _, ctx in Scripted.calls] == [2, 3, 4]
    assert {(ctx.partition, ctx.seq, ctx.deletes) for _, ctx in Scripted.calls} == {
        (1, 0, frozenset({1}))
    }
    assert [items for items, _ in Scripted.calls] == [[7, 8]] * 3
    assert peer.results(0) == [["done"]]
    assert d.stats.node_retries == 2
    # Retries stop after node_retries; the client is then told, and may resend.
    Scripted.calls, Scripted.errors = [], {1: [OverloadedError("busy")] * 3}
    d.submit(peer, frame(1, p=1), OWNER)
    err = await peer.wait_for("error", 1)
    assert err["code"] == "OVERLOADED" and err["retriable"] is True
    assert [ctx.attempt for _, ctx in Scripted.calls] == [1, 2, 3]
    # An error that is not retriable is not retried.
    Scripted.calls, Scripted.errors = [], {0: [SchemaError("bad row")]}
    d.submit(peer, frame(0, p=2), OWNER)
    assert (await peer.wait_for("error", 0))["code"] == "SCHEMA_MISMATCH"
    assert len(Scripted.calls) == 1
    assert d.stats.node_retries == 4


class PatientIdempotent(IdempotentScripted):
    node_retries = 7


async def test_the_node_waits_at_most_a_second_between_retries_of_an_idempotent_receiver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = make_dispatcher(PatientIdempotent)
    Scripted.errors = {0: [OverloadedError("busy")] * 7}
    waits: list[float] = []
    sleep = asyncio.sleep

    async def no_wait(delay: float, result: Any = None) -> Any:
        if delay > 0:  # the backoff; the test's own waits are loop turns
            waits.append(delay)
        return await sleep(0, result)

    monkeypatch.setattr(asyncio, "sleep", no_wait)
    peer = Peer()
    d.submit(peer, frame(0), OWNER)
    await peer.wait_for("ack", 0)
    # Doubling from 0.05 s, capped at 1 s: a receiver with many node retries does not keep
    # its lane waiting for seconds between two of them.
    assert waits == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert len(Scripted.calls) == 8 and d.stats.node_retries == 7


async def test_a_receiver_that_is_not_idempotent_is_run_once_per_delivery(
    scripted: type[Scripted],
) -> None:
    d = make_dispatcher(scripted)
    scripted.errors[0] = [OverloadedError("busy")]
    peer = Peer()
    d.submit(peer, frame(0), OWNER)
    assert (await peer.wait_for("error", 0))["retriable"] is True
    assert len(scripted.calls) == 1 and d.stats.node_retries == 0


class Engine:
    """A table engine that commits a staged write only when the test says so, checking right
    before the commit whether it is abandoned, as the real engines do. Waits are bounded."""

    class Write:
        def __init__(self, table: str, seq: int, abandoned: Any, held: Any) -> None:
            self.table, self.seq, self.abandoned, self.held = table, seq, abandoned, held
            self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def __init__(self) -> None:
        self.writes: list[Engine.Write] = []
        self.releases = 0
        self.changed = asyncio.Event()

    async def stage(
        self,
        table: str,
        key: Any,
        rows: Any,
        deletes: Any,
        *,
        abandoned: Any,
        mark: Any,
        held: Any,
        sequence: Any = None,
    ) -> asyncio.Future[None]:
        write = Engine.Write(table, mark[1][0], abandoned, held)
        self.writes.append(write)
        self.changed.set()
        return write.done

    def release(self) -> None:
        self.releases += 1
        self.changed.set()

    def forget_lanes(self, tables: Any, lanes: Any) -> None:
        pass

    async def until(self, condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(ANSWER_WAIT):
            while not condition():
                self.changed.clear()
                await self.changed.wait()

    def commit(self, table: str, seq: int, error: Exception | None = None) -> str:
        """Commit batch ``seq``'s write to ``table``: "committed", "abandoned" or "failed"."""
        [write] = [w for w in self.writes if (w.table, w.seq) == (table, seq)]
        assert not write.held(), f"batch {seq}'s write committed while its receive() ran"
        if write.abandoned():
            write.done.set_exception(LaneFailedError("not applied: an earlier batch failed"))
            return "abandoned"
        if error is not None:
            write.done.set_exception(error)
            return "failed"
        write.done.set_result(None)
        return "committed"


@pytest.fixture
def engine(scripted: type[Scripted]) -> Engine:
    return Engine()


async def test_a_batch_is_acked_once_its_writes_are_committed_not_before(
    scripted: type[Scripted], engine: Engine
) -> None:
    d = make_dispatcher(scripted, engine)
    scripted.writes[0] = ["t", "u"]
    scripted.gate = asyncio.Event()
    peer = Peer()
    d.submit(peer, frame(0), OWNER)
    await engine.until(lambda: len(engine.writes) == 2)
    assert [w.held() for w in engine.writes] == [True, True], "committable while receive() runs"
    scripted.gate.set()
    await engine.until(lambda: engine.releases == 1)  # receive() returned: commit them now
    assert [w.held() for w in engine.writes] == [False, False]
    assert engine.commit("t", 0) == "committed"
    assert peer.answers(0) == [], "acked before every write was durable"
    assert engine.commit("u", 0) == "committed"
    assert (await peer.wait_for("ack", 0))["n"] == 1
    # The lane did not wait for the commit to run the next batch; a batch without writes does
    # not wake the engine.
    d.submit(peer, frame(1), OWNER)
    await peer.wait_for("ack", 1)
    assert engine.releases == 1
    assert d.stats.batches_acked == 2


async def test_a_batch_that_raises_after_writing_leaves_nothing_in_any_table(
    scripted: type[Scripted], engine: Engine
) -> None:
    d = make_dispatcher(scripted, engine)
    scripted.writes[0] = ["t"]
    scripted.errors[0] = [ValueError("half done")]
    peer = Peer()
    d.submit(peer, frame(0), OWNER)
    await peer.wait_for("error", 0)
    assert engine.commit("t", 0) == "abandoned"


async def test_an_earlier_batch_commits_whatever_later_batches_of_its_lane_do(
    scripted: type[Scripted], engine: Engine
) -> None:
    d = make_dispatcher(scripted, engine)
    scripted.writes = {0: ["a"], 1: ["b"]}
    peer = Peer()
    d.submit(peer, frame(0), OWNER)
    d.submit(peer, frame(1), OWNER)
    await engine.until(lambda: len(engine.writes) == 2)
    # Table b commits first (tables commit independently); batch 1's commit fails.
    assert engine.commit("b", 1, ValueError("disk full")) == "failed"
    err = await peer.wait_for("error", 1)
    assert err["msg"] == "commit failed: ValueError('disk full')" and err["retriable"] is False
    assert (err["code"], err["node"]) == ("INTERNAL", "n1")
    assert engine.commit("a", 0) == "committed"
    await peer.wait_for("ack", 0)


async def test_a_failed_commit_fails_its_batch_and_every_batch_behind_it(
    scripted: type[Scripted], engine: Engine
) -> None:
    d = make_dispatcher(scripted, engine)
    scripted.writes = {0: ["t"], 1: ["t"]}
    peer = Peer()
    for seq in (0, 1, 3):  # 3 waits for 2, which has not arrived
        d.submit(peer, frame(seq), OWNER)
    await engine.until(lambda: len(engine.writes) == 2)
    assert engine.commit("t", 0, CommitConflictError("lost the race", node="n1")) == "failed"
    err = await peer.wait_for("error", 0)
    assert (err["code"], err["retriable"]) == ("COMMIT_CONFLICT", False)
    assert engine.commit("t", 1) == "abandoned"
    assert (await peer.wait_for("error", 1))["code"] == "LANE_FAILED"
    behind = await peer.wait_for("error", 3)
    assert behind["code"] == "LANE_FAILED" and behind["node"] == "n1"
    assert behind["msg"] == (
        "not applied: batch 0 of partition 0 failed earlier ([COMMIT_CONFLICT] lost the race "
        "(node n1)), so later batches of the partition are refused to keep per-key order"
    )
    assert d.stats.batches_failed == 2 and d.stats.batches_acked == 0


async def test_a_lane_reopens_once_the_client_settled_its_failed_batch(
    scripted: type[Scripted], engine: Engine
) -> None:
    d = make_dispatcher(scripted, engine)
    scripted.writes = {0: ["t"], 1: ["t"], 2: ["t"]}
    peer = Peer()
    d.submit(peer, frame(0), OWNER)
    await engine.until(lambda: len(engine.writes) == 1)
    engine.commit("t", 0, ValueError("disk full"))
    await peer.wait_for("error", 0)
    # A resend of the failed batch gets its own error again; a later batch is refused, also
    # while the client's base has not passed the failed batch.
    resent, later = Peer(), Peer()
    d.submit(resent, frame(0), OWNER)
    assert (await resent.wait_for("error", 0))["msg"] == "commit failed: ValueError('disk full')"
    d.submit(later, frame(1, base=0), OWNER)
    refused = await later.wait_for("error", 1)
    assert (refused["code"], refused["node"]) == ("LANE_FAILED", "n1")
    assert refused["msg"] == (
        "not applied: batch 0 of partition 0 failed earlier ([INTERNAL] commit failed: "
        "ValueError('disk full') (node n1)), so later batches of the partition are refused to "
        "keep per-key order"
    )
    # The client dead-lettered batch 0 (base 1): the lane goes on, and its writes commit.
    d.submit(peer, frame(1, base=1), OWNER)
    await engine.until(lambda: len(engine.writes) == 2)
    assert engine.commit("t", 1) == "committed"
    await peer.wait_for("ack", 1)
    d.submit(peer, frame(2, base=1), OWNER)
    await engine.until(lambda: len(engine.writes) == 3)
    assert engine.commit("t", 2) == "committed"
    await peer.wait_for("ack", 2)
    lane = d.streams.get("s", OWNER).lanes[0]
    assert (lane.pending, lane.committing, lane.staged) == ({}, {}, {}), "a lane holds on"


async def test_a_resend_during_a_commit_is_answered_when_the_commit_lands_or_fails(
    scripted: type[Scripted], engine: Engine
) -> None:
    d = make_dispatcher(scripted, engine)
    scripted.writes = {0: ["t"], 1: ["t"]}
    scripted.results = {0: ["r0"]}
    log: list[tuple[Peer, dict[str, Any]]] = []
    first, resent = Peer(log), Peer(log)
    d.submit(first, frame(0), OWNER)
    await engine.until(lambda: engine.releases == 1)
    d.submit(resent, frame(0), OWNER)  # the ack is late: the client resent over another connection
    engine.commit("t", 0)
    await resent.wait_for("ack", 0)
    answers = [(peer is first, f["t"], f.get("dup", False)) for peer, f in log]
    assert answers == [
        (True, "result", False),
        (True, "ack", False),
        (False, "result", False),
        (False, "ack", True),
    ]
    assert len(scripted.calls) == 1
    d.submit(first, frame(1), OWNER)
    await engine.until(lambda: engine.releases == 2)
    d.submit(resent, frame(1), OWNER)
    engine.commit("t", 1, ValueError("disk full"))
    err = await resent.wait_for("error", 1)
    assert err["msg"] == "commit failed: ValueError('disk full')" and err["seq"] == 1
    assert resent.answers(1) == ["error"]


async def test_closing_a_stream_answers_its_waiting_batches_and_lets_commits_finish(
    scripted: type[Scripted], engine: Engine
) -> None:
    d = make_dispatcher(scripted, engine)
    scripted.writes = {0: ["t"]}
    peer = Peer()
    d.submit(peer, frame(0), OWNER)
    d.submit(peer, frame(2), OWNER)  # waits for 1
    await engine.until(lambda: engine.releases == 1)
    d.close("s", OWNER)
    err = await peer.wait_for("error", 2)
    assert (err["code"], err["node"], err["retriable"]) == ("LANE_FAILED", "n1", False)
    assert err["msg"] == (
        "not applied: stream closed by the client before batch 2 of partition 0 could run"
    )
    for _ in range(3):  # turns of the loop (no time passes): the commit has not landed
        await asyncio.sleep(0)
    assert d.stats.streams == 1, "forgotten while its commit runs"
    d.close("s", OWNER)  # the client closed it twice (once per connection): no harm
    engine.commit("t", 0)
    await peer.wait_for("ack", 0)
    await eventually(lambda: d.stats.streams == 0)
    d.submit(peer, frame(3), OWNER)
    assert (await peer.wait_for("error", 3))["code"] == "UNKNOWN_STREAM"
    d.close("s", OWNER)  # closing it again, or a stream never opened, does nothing
    d.close("never", OWNER)
    d.open("t", "r", None, KEY)
    d.close("t", OWNER)  # nothing running: forgotten at once
    assert d.stats.streams == 0


async def test_a_stream_closed_while_a_commit_fails_is_forgotten_too(
    scripted: type[Scripted], engine: Engine
) -> None:
    d = make_dispatcher(scripted, engine)
    scripted.writes = {0: ["t"]}
    peer = Peer()
    d.submit(peer, frame(0), OWNER)
    await engine.until(lambda: engine.releases == 1)
    d.close("s", OWNER)
    engine.commit("t", 0, ValueError("disk full"))
    await peer.wait_for("error", 0)
    await eventually(lambda: d.stats.streams == 0)


async def test_stopping_the_dispatcher_cancels_its_running_receivers() -> None:
    class Blocking(Receiver):
        entered = asyncio.Event()
        cancelled = False

        async def receive(self, items: list[Any], ctx: ReceiverContext) -> None:
            Blocking.entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                Blocking.cancelled = True
                raise

    d = make_dispatcher(Blocking)
    d.submit(Peer(), frame(0), OWNER)
    await asyncio.wait_for(Blocking.entered.wait(), ANSWER_WAIT)
    async with asyncio.timeout(ANSWER_WAIT):
        await d.stop()
    assert Blocking.cancelled, "stop() returned before the receiver was cancelled"


async def test_answers_reach_a_backed_up_client_once_and_others_at_once(
    dispatcher: Dispatcher,
) -> None:
    slow, fast = Peer(backed_up=True), Peer()
    dispatcher.submit(slow, batch(0), OWNER)
    dispatcher.submit(slow, batch(0, p=9), OWNER)
    await slow.wait_for("ack", 0)
    assert (await slow.wait_for("error", 0))["code"] == "BAD_FRAME"
    dispatcher.submit(fast, batch(0, p=1), OWNER)
    await fast.wait_for("ack", 0)
    assert fast.answers(0) == ["ack"] and sorted(slow.answers(0)) == ["ack", "error"]


class Counting(Receiver):
    """Counts the receive calls running at once; they wait at ``gate``."""

    max_concurrency = 1
    running = 0
    most = 0
    gate: asyncio.Event

    async def receive(self, items: list[Any], ctx: ReceiverContext) -> None:
        Counting.running += 1
        Counting.most = max(Counting.most, Counting.running)
        await Counting.gate.wait()
        Counting.running -= 1


@pytest.mark.parametrize(
    ("max_concurrency", "node_setting", "expected"),
    [(1, None, 1), (None, None, 3), (1, {"r": 2}, 2), (3, {"r": None}, 3), (1, {"x": 5}, 1)],
)
async def test_a_receiver_runs_at_most_its_concurrency_at_once_across_streams(
    max_concurrency: int | None,
    node_setting: dict[str, Any] | None,
    expected: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Counting, "max_concurrency", max_concurrency)
    Counting.running, Counting.most, Counting.gate = 0, 0, asyncio.Event()
    d = make_dispatcher(Counting, concurrency=node_setting)
    d.open("t", "r", None, KEY)
    peer = Peer()
    for sid, p in (("s", 0), ("s", 1), ("t", 0)):
        d.submit(peer, {**frame(0, p=p), "sid": sid}, OWNER)
    await eventually(lambda: Counting.running == expected)  # as many as may start have
    Counting.gate.set()
    await peer.until(lambda: len(peer.answers(0)) == 3)
    assert peer.answers(0) == ["ack"] * 3
    assert Counting.most == expected
