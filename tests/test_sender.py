"""The sender's window, lanes, retries and ownership handoff, against scripted connections.

No network: each fake connection records the frames it was given and the test answers them, so
every step (what is sent when, with which ``base``) is checked exactly.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from deltaflow import StreamerOptions
from deltaflow.client.accumulator import Batch
from deltaflow.client.router import Routes
from deltaflow.client.sender import Sender, StreamStoppedError
from deltaflow.errors import ConnectionLostError, NotOwnerError, ServerError
from deltaflow.protocol import LANE_WINDOW

FAST_RETRY = {"retry_initial_backoff": 0.001, "retry_max_backoff": 0.001}


class FakeConnection:
    """Takes batch frames and keeps their answers open until the test gives them."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.sent: list[dict[str, Any]] = []
        self.answers: dict[tuple[int, int], asyncio.Future[dict[str, Any]]] = {}
        self._sent_more = asyncio.Event()

    def stream_open(self, sid: str) -> bool:
        return True

    @property
    def has_room(self) -> bool:
        return True

    async def open_stream(
        self, sid: str, receiver: str, args: Any, results: Any, *, key: bytes, random: bool = False
    ) -> None:
        return None

    def start_batch(self, frame: dict[str, Any], *, timeout: float) -> asyncio.Future[Any]:
        answer = asyncio.get_running_loop().create_future()
        self.sent.append(dict(frame))
        self.answers[frame["p"], frame["seq"]] = answer
        self._sent_more.set()
        return answer

    async def until_sent(self, count: int) -> None:
        """Wait until ``count`` batch frames were given to this connection."""
        while len(self.sent) < count:
            self._sent_more.clear()
            await self._sent_more.wait()

    async def send_batch(self, frame: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        return await self.start_batch(frame, timeout=timeout)  # type: ignore[no-any-return]

    def abandon_batch(self, frame: dict[str, Any], answer: asyncio.Future[Any]) -> None:
        answer.cancel()

    def ack(self, p: int, seq: int) -> None:
        self.answers.pop((p, seq)).set_result({"t": "ack", "p": p, "seq": seq})

    def fail(self, p: int, seq: int, exc: BaseException) -> None:
        self.answers.pop((p, seq)).set_exception(exc)

    def sent_keys(self) -> list[tuple[int, int]]:
        return [(f["p"], f["seq"]) for f in self.sent]


class FakeRouter:
    """Routes each partition to the connection the test says owns it (a :class:`Routes`)."""

    def __init__(self, owners: dict[int, FakeConnection]) -> None:
        self.owners = owners
        self.known = {c.node_id: c for c in owners.values()}  # connections opened so far

    def connection_now(self, partition: int) -> FakeConnection:
        return self.owners[partition]

    async def connection_for(self, partition: int) -> FakeConnection:
        return self.owners[partition]

    def connection_to(self, node_id: str) -> FakeConnection | None:
        return self.known.get(node_id)

    def adopt_map(self, wire: Any) -> None:
        return None

    def mark_stale(self) -> None:
        return None


class Outcomes:
    def __init__(self) -> None:
        self.acked: list[tuple[int, int]] = []
        self.failed: list[tuple[int, int, BaseException, int]] = []

    def on_acked(self, batch: Batch) -> None:
        self.acked.append((batch.partition, batch.seq))

    def on_failed(self, batch: Batch, exc: BaseException) -> None:
        self.failed.append((batch.partition, batch.seq, exc, batch.attempts))


def make_sender(router: FakeRouter, outcomes: Outcomes, **options: Any) -> Sender:
    return Sender(
        cast("Routes", router),
        sid="s",
        key=b"k" * 32,
        receiver=("r", None),
        options=StreamerOptions(**options),
        on_acked=outcomes.on_acked,
        on_failed=outcomes.on_failed,
        results=None,
    )


def batch(p: int, seq: int) -> Batch:
    return Batch(p, seq, items=[seq], positions=[seq], packed=[b"\x01"])


async def turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_batches_go_out_when_submitted_within_the_window_and_lanes_in_cut_order() -> None:
    conn, outcomes = FakeConnection("a"), Outcomes()
    sender = make_sender(
        FakeRouter({0: conn, 1: conn}), outcomes, max_in_flight=3, per_partition_in_flight=2
    )
    for b in [batch(0, 0), batch(0, 1), batch(0, 2), batch(1, 0), batch(1, 1)]:
        sender.submit(b)
    # Sent by submit itself. Partition 0's lane is full, and its third batch holds the window's
    # last slot while it waits, so partition 1 waits for the window.
    assert conn.sent_keys() == [(0, 0), (0, 1)]
    assert [f["base"] for f in conn.sent] == [0, 0]
    assert not sender.has_room
    assert sender.counters.in_flight == 2

    conn.ack(0, 0)
    await turns()
    # The ack gave partition 0's lane slot to its next batch and a window slot to partition 1.
    assert conn.sent_keys() == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert conn.sent[2]["base"] == 1  # batch 0 is settled
    assert outcomes.acked == [(0, 0)]

    for p, seq in [(0, 2), (0, 1), (1, 0)]:
        conn.ack(p, seq)
    await turns()
    conn.ack(1, 1)
    await asyncio.wait_for(sender.join(), 5)
    assert conn.sent_keys() == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert sorted(outcomes.acked) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert sender.has_room
    assert sender.counters.in_flight == 0
    assert sender.counters.acked_items == 5


async def test_a_failed_first_send_is_resent_with_the_same_seq() -> None:
    conn, outcomes = FakeConnection("a"), Outcomes()
    sender = make_sender(FakeRouter({0: conn}), outcomes, per_partition_in_flight=2, **FAST_RETRY)
    sender.submit(batch(0, 0))
    sender.submit(batch(0, 1))
    conn.fail(0, 0, ConnectionLostError("gone"))
    for _ in range(100):
        await asyncio.sleep(0.002)
        if len(conn.sent) == 3:
            break
    resent = conn.sent[2]
    assert (resent["seq"], resent["att"], resent["base"]) == (0, 2, 0)
    conn.ack(0, 0)
    conn.ack(0, 1)
    await asyncio.wait_for(sender.join(), 5)
    assert sorted(outcomes.acked) == [(0, 0), (0, 1)]
    assert sender.counters.retried_batches == 1


async def test_sends_to_a_new_owner_wait_until_those_to_the_old_one_ended() -> None:
    old, new, outcomes = FakeConnection("a"), FakeConnection("b"), Outcomes()
    router = FakeRouter({0: old})
    sender = make_sender(router, outcomes, per_partition_in_flight=4)
    sender.submit(batch(0, 0))
    router.owners[0] = new  # the partition moved while batch 0 is at the old owner
    sender.submit(batch(0, 1))
    await turns(10)
    assert new.sent == []  # the new owner would wait for batch 0, which it never gets

    old.ack(0, 0)
    await turns(10)
    assert new.sent_keys() == [(0, 1)]
    assert new.sent[0]["base"] == 1
    new.ack(0, 1)
    await asyncio.wait_for(sender.join(), 5)
    assert outcomes.acked == [(0, 0), (0, 1)]


async def test_a_batch_that_later_ones_wait_for_goes_where_they_are() -> None:
    """The old owner refused batch 0 (its map had just changed) but took batch 1, which now
    waits there for batch 0. The client's map says the new owner: sending batch 0 there would
    wait for batch 1's send to end, and batch 1 waits for batch 0, until an ack timeout. So
    batch 0 goes to where batch 1 is."""
    old, new, outcomes = FakeConnection("a"), FakeConnection("b"), Outcomes()
    router = FakeRouter({0: old})
    sender = make_sender(router, outcomes, per_partition_in_flight=4, **FAST_RETRY)
    sender.submit(batch(0, 0))
    sender.submit(batch(0, 1))
    await turns(10)
    assert old.sent_keys() == [(0, 0), (0, 1)]
    router.owners[0] = new
    old.fail(0, 0, NotOwnerError("partition 0 is not owned by this node", node="a"))
    await asyncio.wait_for(old.until_sent(3), 5)  # the resend, after its (1 ms) backoff
    assert old.sent_keys() == [(0, 0), (0, 1), (0, 0)] and new.sent == []
    old.ack(0, 0)
    old.ack(0, 1)
    await asyncio.wait_for(sender.join(), 5)
    assert sorted(outcomes.acked) == [(0, 0), (0, 1)]


async def test_a_batch_sent_to_a_new_owner_after_the_old_one_acked_the_last_has_base_past_it() -> (
    None
):
    """Batch 0 was resent (on a task) to the old owner; batch 1 waits to go to the new one.
    When the old owner acks batch 0, batch 1 goes with ``base`` 1: with ``base`` 0 the new
    owner would wait for batch 0, which nobody sends again, until the ack timeout. (Seen in a
    failover loop: a partition moved between the two survivors, and the batch waited 20 s.)"""
    old, new, outcomes = FakeConnection("a"), FakeConnection("b"), Outcomes()
    router = FakeRouter({0: old})
    router.known["b"] = new
    sender = make_sender(router, outcomes, per_partition_in_flight=4, **FAST_RETRY)
    sender.submit(batch(0, 0))
    old.fail(0, 0, ConnectionLostError("gone"))
    await asyncio.wait_for(old.until_sent(2), 5)  # the resend, on a task of its own
    router.owners[0] = new
    sender.submit(batch(0, 1))
    await turns(10)
    assert new.sent == []  # batch 0 is still out at the old owner
    old.ack(0, 0)
    await asyncio.wait_for(new.until_sent(1), 5)
    assert (new.sent[0]["seq"], new.sent[0]["base"]) == (1, 1)
    new.ack(0, 1)
    await asyncio.wait_for(sender.join(), 5)
    assert outcomes.acked == [(0, 0), (0, 1)]


async def test_a_batch_that_a_later_one_waits_for_goes_there_while_an_earlier_one_is_out() -> None:
    """The old owner answered batch 1 with a retriable error: its lane keeps batch 2 waiting
    for batch 1's resend, and batch 0 is still committing there. The partition has moved, but
    batch 1 goes back to the old owner: the new one would have to wait until batch 2's send
    ended, and batch 2 waits for batch 1, until an ack timeout."""
    old, new, outcomes = FakeConnection("a"), FakeConnection("b"), Outcomes()
    router = FakeRouter({0: old})
    router.known["b"] = new
    sender = make_sender(router, outcomes, per_partition_in_flight=4, **FAST_RETRY)
    for seq in range(3):
        sender.submit(batch(0, seq))
    await turns(10)
    assert old.sent_keys() == [(0, 0), (0, 1), (0, 2)]
    router.owners[0] = new
    old.fail(0, 1, ServerError("receiver busy, try again", node="a", retriable=True))
    await asyncio.wait_for(old.until_sent(4), 5)  # the resend, after its (1 ms) backoff
    assert old.sent_keys()[3] == (0, 1) and new.sent == []
    for seq in range(3):
        old.ack(0, seq)
    await asyncio.wait_for(sender.join(), 5)
    assert sorted(outcomes.acked) == [(0, 0), (0, 1), (0, 2)]


async def test_cancel_reports_sent_batches_in_doubt_and_the_rest_not_sent() -> None:
    conn, outcomes = FakeConnection("a"), Outcomes()
    sender = make_sender(
        FakeRouter({0: conn}), outcomes, max_in_flight=2, per_partition_in_flight=1
    )
    for seq in range(4):
        sender.submit(batch(0, seq))
    assert conn.sent_keys() == [(0, 0)]  # batch 1 holds a window slot, waiting for the lane
    await asyncio.wait_for(sender.cancel(), 5)
    reported = {(p, seq): (type(exc), attempts) for p, seq, exc, attempts in outcomes.failed}
    assert reported == {
        (0, 0): (asyncio.CancelledError, 1),  # on the wire: in doubt
        (0, 1): (asyncio.CancelledError, 0),
        (0, 2): (asyncio.CancelledError, 0),
        (0, 3): (asyncio.CancelledError, 0),
    }
    assert sender.has_room
    assert sender.counters.in_flight == 0


async def test_after_stop_waiting_batches_fail_unsent_and_sent_ones_finish() -> None:
    conn, outcomes = FakeConnection("a"), Outcomes()
    sender = make_sender(FakeRouter({0: conn}), outcomes, max_in_flight=1)
    sender.submit(batch(0, 0))
    sender.submit(batch(0, 1))
    sender.stop()
    conn.ack(0, 0)
    await asyncio.wait_for(sender.join(), 5)
    assert conn.sent_keys() == [(0, 0)]
    assert outcomes.acked == [(0, 0)]
    assert [(p, seq, type(exc)) for p, seq, exc, _ in outcomes.failed] == [
        (0, 1, StreamStoppedError)
    ]


async def test_a_failed_answer_that_comes_in_as_the_stream_is_cancelled_is_not_resent() -> None:
    """The dead-letter sender is cancelled without being stopped first: an answer already in
    (not yet handled) must settle its batch as cancelled, in doubt, not start a resend."""
    conn, outcomes = FakeConnection("a"), Outcomes()
    sender = make_sender(FakeRouter({0: conn}), outcomes, **FAST_RETRY)
    sender.submit(batch(0, 0))
    conn.fail(0, 0, ConnectionLostError("lost"))  # its callback is queued, not yet run
    async with asyncio.timeout(5):
        await sender.cancel()  # not wrapped in a task: runs before the queued callback
    await turns()
    assert conn.sent_keys() == [(0, 0)]  # never resent
    [(p, seq, exc, attempts)] = outcomes.failed
    assert (p, seq, attempts) == (0, 0, 1) and isinstance(exc, asyncio.CancelledError)


async def test_a_batch_whose_route_cannot_be_looked_up_fails_instead_of_hanging() -> None:
    class NoRoute(FakeRouter):
        def connection_now(self, partition: int) -> FakeConnection:
            raise IndexError("partition 0 not in the map")

        async def connection_for(self, partition: int) -> FakeConnection:
            raise IndexError("partition 0 not in the map")

    outcomes = Outcomes()
    sender = make_sender(NoRoute({}), outcomes)
    sender.submit(batch(0, 0))
    await asyncio.wait_for(sender.join(), 5)
    [(p, seq, exc, _)] = outcomes.failed
    assert (p, seq) == (0, 0) and isinstance(exc, IndexError)
    assert sender.has_room and sender.counters.in_flight == 0


async def test_no_batch_goes_a_lane_window_or_more_past_its_partitions_lowest_unsettled() -> None:
    """Batch 0's answer is slow (its ack was lost: it waits for its timeout) while the later
    batches of its partition are acknowledged. The lane slots they free go on to later
    batches, but to none ``LANE_WINDOW`` or more past batch 0, which a node would refuse;
    batch 0's ack lets the rest go."""
    conn, outcomes = FakeConnection("a"), Outcomes()
    sender = make_sender(FakeRouter({0: conn}), outcomes, per_partition_in_flight=4)
    total = LANE_WINDOW + 10
    for seq in range(total):
        sender.submit(batch(0, seq))

    async def ack_all_but_zero() -> None:
        while later := [key for key in conn.answers if key != (0, 0)]:
            for key in later:
                conn.ack(*key)
            await turns()

    await ack_all_but_zero()
    assert max(seq for _, seq in conn.sent_keys()) == LANE_WINDOW - 1
    conn.ack(0, 0)
    await turns()
    await ack_all_but_zero()
    await asyncio.wait_for(sender.join(), 5)
    assert sorted(outcomes.acked) == [(0, seq) for seq in range(total)]
    assert all(0 <= f["base"] <= f["seq"] < f["base"] + LANE_WINDOW for f in conn.sent)
    assert conn.sent_keys() == [(0, seq) for seq in range(total)]
