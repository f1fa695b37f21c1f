"""Lane semantics of the node's dispatcher, driven frame by frame (no network, no tables)."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest

from deltaflow.errors import OverloadedError, UsageError
from deltaflow.protocol import join_items, pack_item
from deltaflow.receivers import Receiver, ReceiverContext, ReceiverRegistry
from deltaflow.server.dispatcher import Dispatcher


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


class Peer:
    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self.changed = asyncio.Event()

    async def send(self, frame: dict[str, Any]) -> None:
        self.send_nowait(frame)

    def send_nowait(self, frame: dict[str, Any]) -> bool:
        self.frames.append(frame)
        self.changed.set()
        return True

    async def wait_for(self, kind: str, seq: int) -> dict[str, Any]:
        while True:
            for f in self.frames:
                if f["t"] == kind and f.get("seq") == seq:
                    return f
            self.changed.clear()
            await self.changed.wait()

    def answers(self, seq: int) -> list[str]:
        return [f["t"] for f in self.frames if f.get("seq") == seq and f["t"] != "result"]


def make_dispatcher(receiver: type[Receiver], writer: Any = None) -> Dispatcher:
    """A dispatcher owning every partition, with stream "s" open on ``receiver``."""
    registry = ReceiverRegistry()
    registry.register(receiver, "r")
    d = Dispatcher(
        node_id="n1",
        registry=registry,
        writer=writer,
        owns=lambda p: True,
        map_wire=dict,
        partitions=4,
    )
    d.open("s", "r", None)
    return d


@pytest.fixture
def dispatcher() -> Dispatcher:
    Recorder.applied, Recorder.gate, Recorder.fail = [], None, {}
    Recorder.entered = asyncio.Event()
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
        dispatcher.submit(peer, batch(seq))
    for seq in (0, 1, 2):
        assert (await peer.wait_for("ack", seq))["n"] == 1
    assert Recorder.applied == [0, 1, 2]


async def test_a_resend_during_apply_is_answered_once_the_original_lands(dispatcher: Dispatcher):
    Recorder.gate = asyncio.Event()
    first, second = Peer(), Peer()
    dispatcher.submit(first, batch(0))
    await Recorder.entered.wait()  # the lane is applying seq 0
    dispatcher.submit(second, batch(0))  # the client resent over a new connection
    Recorder.gate.set()
    assert (await second.wait_for("ack", 0)).get("dup") is True
    await first.wait_for("ack", 0)
    assert Recorder.applied == [0]


async def test_base_lets_a_new_owner_start_mid_stream(dispatcher: Dispatcher):
    peer = Peer()
    dispatcher.submit(peer, batch(7, base=7))
    await peer.wait_for("ack", 7)
    # A late resend of an older, already acknowledged batch is not applied again.
    dispatcher.submit(peer, batch(3, base=7))
    assert (await peer.wait_for("ack", 3)).get("dup") is True
    assert Recorder.applied == [7]


@pytest.mark.parametrize("error", [ValueError("boom"), UsageError("bad args")])
async def test_a_failed_batch_closes_its_lane_for_good(dispatcher: Dispatcher, error: Exception):
    Recorder.fail = {1: error}
    peer = Peer()
    for seq in (0, 1, 2):
        dispatcher.submit(peer, batch(seq))
    await peer.wait_for("ack", 0)
    failed = await peer.wait_for("error", 1)
    assert failed["retriable"] is False
    assert str(error) in failed["msg"]
    behind = await peer.wait_for("error", 2)
    assert behind["code"] == "LANE_FAILED" and "batch 1 of partition 0 failed" in behind["msg"]
    peer.frames.clear()
    dispatcher.submit(peer, batch(1))  # a resend cannot succeed either
    assert (await peer.wait_for("error", 1))["retriable"] is False
    assert Recorder.applied == [0]
    # Other partitions are unaffected.
    dispatcher.submit(peer, batch(0, p=1))
    await peer.wait_for("ack", 0)


async def test_a_retriable_failure_keeps_the_lane_for_the_resend(dispatcher: Dispatcher):
    Recorder.fail = {0: OverloadedError("busy")}
    peer = Peer()
    dispatcher.submit(peer, batch(0))
    dispatcher.submit(peer, batch(1))
    err = await peer.wait_for("error", 0)
    assert err["retriable"] is True
    peer.frames.clear()
    dispatcher.submit(peer, batch(0))
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
    ) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.entries.append((mark[1][0], abandoned, fut))
        if len(self.entries) == 3:
            self.three_staged.set()
        return fut

    def release(self) -> None:
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
        d.submit(peer, batch(seq))
    await engine.three_staged.wait()  # all staged: the lane does not wait for commits
    engine.commit_all()
    assert engine.committed == []
    for seq in (0, 1, 2):
        assert (await peer.wait_for("error", seq))["retriable"] is False
