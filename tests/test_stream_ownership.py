"""Streams belong to whoever opened them: another client holding the token can neither feed,
base-jump nor close a stream it did not open, also after a node restart (issue 36, finding 5).

Stream ids are public (they name the lanes in every Delta commit's metadata, and show in logs
and dead-letter rows), so the intruder here learns the victim's id and speaks the protocol
frame by frame over a WebSocket of its own. Nodes run the delta-rs engine: the table engine
does not matter to who owns a stream.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import deltaflow
from deltaflow import StreamerOptions
from deltaflow.client.stream_types import TABLE_RECEIVER
from deltaflow.errors import ProtocolError, UsageError
from deltaflow.partitioning import partition_of
from deltaflow.protocol import WS_PATH, decode_frame, decode_frames, encode_frame, pack_item
from deltaflow.server import Node
from deltaflow.testing import Gated

from .support import Eventually, StartCluster, Within, read_all, read_delta

TOKEN = "ownership-token"
PARTITIONS = 8
#: Where the intruder moves every lane it can reach.
FAR = 10**6


async def one_node(start_cluster: StartCluster, warehouse: Path) -> Node:
    (node,) = await start_cluster(
        warehouse, count=1, engine="delta-rs", token=TOKEN, partitions=PARTITIONS
    )
    return node


class Intruder:
    """A second client that holds the token and writes frames by hand."""

    def __init__(self, session: aiohttp.ClientSession, ws: Any) -> None:
        self._session = session
        self._ws = ws

    @classmethod
    async def connect(cls, address: str) -> Intruder:
        session = aiohttp.ClientSession()
        ws = await session.ws_connect(f"http://{address}{WS_PATH}")
        hello = {"t": "hello", "v": [1], "caps": [], "client": "intruder", "token": TOKEN}
        await ws.send_bytes(encode_frame(hello))
        welcome = decode_frame((await ws.receive()).data)
        assert welcome["t"] == "welcome", welcome
        return cls(session, ws)

    async def close(self) -> None:
        await self._ws.close()
        await self._session.close()

    async def send(self, *frames: dict[str, Any]) -> None:
        for frame in frames:
            await self._ws.send_bytes(encode_frame(frame))

    async def answers(self, count: int) -> list[dict[str, Any]]:
        """The node's next ``count`` frames (a closed socket fails the test)."""
        out: list[dict[str, Any]] = []
        while len(out) < count:
            msg = await self._ws.receive()
            assert msg.type == aiohttp.WSMsgType.BINARY, f"the node closed: {msg!r} after {out}"
            out.extend(decode_frames(msg.data))
        return out

    async def open(self, sid: str, receiver: str, args: Any) -> dict[str, Any]:
        """Open ``sid`` under a key of the intruder's own; the node's answer."""
        frame = {"t": "open", "sid": sid, "receiver": receiver, "args": args, "key": os.urandom(32)}
        try:
            decode_frame(encode_frame(frame))
        except ProtocolError:  # a protocol without stream keys: the open needs none
            del frame["key"]
        await self.send(frame)
        (answer,) = await self.answers(1)
        return answer


def batch(sid: str, p: int, seq: int, rows: list[Any], base: int) -> dict[str, Any]:
    return {
        "t": "batch",
        "sid": sid,
        "p": p,
        "seq": seq,
        "n": len(rows),
        "items": b"".join(pack_item(r) for r in rows),
        "base": base,
        "att": 1,
    }


def key_in(p: int, start: int) -> int:
    """The first id from ``start`` on whose row routes to partition ``p``."""
    return next(i for i in range(start, start + 10_000) if partition_of(i, PARTITIONS) == p)


@pytest.fixture
def gate() -> Iterator[asyncio.Event]:
    Gated.gate = asyncio.Event()
    yield Gated.gate
    Gated.gate = None


async def test_a_second_connection_cannot_skip_a_running_streams_batches(
    start_cluster: StartCluster, warehouse: Path, within: Within[Any]
) -> None:
    """The victim streams 6,000 rows; after 2,000 are acknowledged, an intruder opens the
    victim's stream id and sends batch 1,000,000 with base 1,000,000 on every partition. Before
    streams had owners, the victim's last 4,000 rows were acknowledged as duplicates and never
    written. Now the intruder's open is a stream of its own, and every victim row lands."""
    node = await one_node(start_cluster, warehouse)
    half, hijacked = asyncio.Event(), asyncio.Event()
    acked = 0

    def count(items: Any) -> None:
        nonlocal acked
        acked += len(items)
        if acked >= 2000:
            half.set()

    async def rows() -> AsyncIterator[dict[str, Any]]:
        for i in range(6000):
            if i == 2000:
                await hijacked.wait()
            yield {"id": i, "v": f"row-{i}"}

    async with deltaflow.connect([node.address], token=TOKEN) as client:
        victim = asyncio.create_task(
            client.stream_data(
                rows(),
                table="orders",
                key="id",
                on_ack=count,
                options=StreamerOptions(page_size=100, linger=0.05, ack_timeout=10.0),
            )
        )
        await within(half.wait(), 30, "the victim's first 2,000 rows acknowledged")
        (stream,) = client.statistics().streams
        intruder = await Intruder.connect(node.address)
        try:
            args = {"table": "orders", "key": ["id"]}
            opened = await intruder.open(stream.stream_id, TABLE_RECEIVER, args)
            assert opened["t"] == "opened", opened
            await intruder.send(
                *(
                    batch(stream.stream_id, p, FAR, [{"id": key_in(p, 10**9), "v": "x"}], FAR)
                    for p in range(PARTITIONS)
                )
            )
            answers = await within(intruder.answers(PARTITIONS), 30, "answers to the intruder")
        finally:
            await intruder.close()
        hijacked.set()
        summary = await within(victim, 60, "the victim's stream")
    assert summary.items_acked == 6000
    table = read_delta(warehouse / "orders")
    mine = {i: row["v"] for i, row in table.items() if i < 6000}
    assert mine == {i: f"row-{i}" for i in range(6000)}, (
        f"{6000 - len(mine)} of the victim's acknowledged rows are not in the table"
    )
    # The intruder wrote to a stream of its own (it holds the token: it may write rows), and
    # moved none of the victim's lanes.
    assert {a["t"] for a in answers} == {"ack"}
    assert len(table) == 6000 + PARTITIONS


async def test_a_replay_after_a_node_restart_is_not_skipped_for_an_intruders_marks(
    start_cluster: StartCluster, warehouse: Path, eventually: Eventually, within: Within[Any]
) -> None:
    """A client streaming 6,000 appends under its own stream id and key stops after 3,000
    (a crash). The node restarts, which forgets every stream; an intruder opens the id first
    and writes batch 1,000,000 of every lane. The owner's replay of all 6,000 rows, under the
    same id and key, writes what the first run did not and nothing twice: the intruder's lane
    marks are under its own key, so they skip none of the owner's batches."""
    node = await one_node(start_cluster, warehouse)
    sid, key = "nightly-2024-06-01", "a secret of the owner's, 32 chars"
    options = StreamerOptions(page_size=100, auto_flush_interval=0.0)
    append = {"receiver": "deltaflow.testing.AppendRows", "receiver_args": {"table": "log"}}

    parked = asyncio.Event()

    async def crashing() -> AsyncIterator[dict[str, Any]]:
        for i in range(3000):
            yield {"id": i}
        parked.set()
        await asyncio.Future()  # the client crashes here (its stream is cancelled)

    async with deltaflow.connect([node.address], token=TOKEN) as client:
        run = asyncio.create_task(
            client.stream_data(
                crashing(), key="id", options=options, stream_id=sid, stream_key=key, **append
            )
        )
        await within(parked.wait(), 30, "the first run's 3,000 rows pulled")
        await eventually(
            lambda: client.statistics().streams[0].in_flight == 0, "the first run's batches in"
        )
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    first = len(read_all(warehouse / "log"))
    assert 0 < first < 6000
    await node.stop()
    node = await one_node(start_cluster, warehouse)

    intruder = await Intruder.connect(node.address)
    try:
        opened = await intruder.open(sid, "deltaflow.testing.AppendRows", {"table": "log"})
        assert opened["t"] == "opened", opened
        await intruder.send(*(batch(sid, p, FAR, [{"id": -1 - p}], FAR) for p in range(PARTITIONS)))
        await within(intruder.answers(PARTITIONS), 30, "answers to the intruder")
    finally:
        await intruder.close()

    async with deltaflow.connect([node.address], token=TOKEN) as client:
        summary = await client.stream_data(
            [{"id": i} for i in range(6000)],
            key="id",
            options=options,
            stream_id=sid,
            stream_key=key,
            **append,
        )
    assert summary.items_acked == 6000
    ids = Counter(r["id"] for r in read_all(warehouse / "log") if r["id"] >= 0)
    assert ids == Counter(range(6000)), (
        f"{6000 - len(ids)} rows lost, {sum(ids.values()) - len(ids)} written twice"
    )


async def test_another_connection_can_neither_close_nor_feed_a_stream(
    start_cluster: StartCluster,
    warehouse: Path,
    gate: asyncio.Event,
    eventually: Eventually,
    within: Within[Any],
) -> None:
    """While the owner's batch 0 runs and batches 1 to 3 wait behind it, an intruder sends
    ``close`` for the owner's stream and a batch of it without opening it. Before, the close
    answered the waiting batches ``LANE_FAILED`` and the owner's stream failed; now both frames
    are answered ``UNKNOWN_STREAM`` and every batch of the owner is applied in order."""
    node = await one_node(start_cluster, warehouse)
    items = [{"k": 0, "i": i} for i in range(8)]
    results: list[Any] = []
    async with deltaflow.connect([node.address], token=TOKEN) as client:
        owner = asyncio.create_task(
            client.stream_data(
                items,
                key="k",
                receiver="deltaflow.testing.Gated",
                on_result=results.append,
                options=StreamerOptions(page_size=2, per_partition_in_flight=4, ack_timeout=10.0),
            )
        )
        await eventually(
            lambda: node.dispatcher.stats.batches_received >= 4, "the owner's 4 batches in"
        )
        (stream,) = client.statistics().streams
        p = partition_of(0, PARTITIONS)
        intruder = await Intruder.connect(node.address)
        try:
            await intruder.send(
                {"t": "close", "sid": stream.stream_id},
                batch(stream.stream_id, p, FAR, [{"k": 0, "i": -1}], FAR),
            )
            answers = await within(intruder.answers(2), 30, "answers to the intruder")
        finally:
            await intruder.close()
        gate.set()
        summary = await within(owner, 30, "the owner's stream")
    assert [(a["t"], a.get("code"), a["sid"]) for a in answers] == [
        ("error", "UNKNOWN_STREAM", stream.stream_id)
    ] * 2
    assert "not open on this connection" in answers[0]["msg"]
    assert summary.items_acked == 8
    assert results == items


async def test_a_batch_outside_its_lanes_window_is_refused(
    start_cluster: StartCluster, warehouse: Path, within: Within[Any]
) -> None:
    """``base`` above ``seq``, or ``seq`` 64 or more past ``base``, is a ``BAD_FRAME`` naming
    the stream, the partition, the numbers and the rule; the connection and the lane go on."""
    node = await one_node(start_cluster, warehouse)
    intruder = await Intruder.connect(node.address)
    try:
        assert (await intruder.open("s-1", "deltaflow.testing.Echo", None))["t"] == "opened"
        await intruder.send(
            batch("s-1", 0, 5, ["a"], base=6),
            batch("s-1", 0, 64, ["b"], base=0),
            batch("s-1", 0, 0, ["c"], base=0),
        )
        answers = await within(intruder.answers(4), 30, "the node's answers")
    finally:
        await intruder.close()
    refused = [a for a in answers if a["t"] == "error"]
    assert [(a["code"], a["seq"], a["retriable"]) for a in refused] == [
        ("BAD_FRAME", 5, False),
        ("BAD_FRAME", 64, False),
    ]
    assert refused[0]["msg"] == (
        "batch 5 of stream 's-1' partition 0 has base 6: a node takes a batch only when "
        "0 <= base <= seq < base + 64 (the lane's window)"
    )
    assert "batch 64 of stream 's-1' partition 0 has base 0" in refused[1]["msg"]
    # The refused frames moved nothing: batch 0 is applied, not taken for a duplicate.
    assert [(a["t"], a["seq"], a.get("dup")) for a in answers if a["t"] != "error"] == [
        ("result", 0, None),
        ("ack", 0, None),
    ]


async def test_a_replay_after_a_client_restart_needs_the_same_id_and_key(
    start_cluster: StartCluster, warehouse: Path
) -> None:
    """A new client replaying a stream under the same ``stream_id`` and ``stream_key`` appends
    nothing twice. The same id under another key is another stream (its rows are appended
    again), and an id without a key has one derived from the token: reproducible too."""
    node = await one_node(start_cluster, warehouse)
    rows = [{"id": i} for i in range(500)]
    options = StreamerOptions(page_size=50, auto_flush_interval=0.0)
    append = {"receiver": "deltaflow.testing.AppendRows", "receiver_args": {"table": "log"}}
    runs: list[dict[str, Any]] = [
        {"stream_key": b"k" * 32},
        {"stream_key": b"k" * 32},
        {"stream_key": "another key of 16+ chars"},
        {},
        {},
    ]
    for run in runs:
        async with deltaflow.connect([node.address], token=TOKEN) as client:
            await client.stream_data(
                rows, key="id", options=options, stream_id="load", **run, **append
            )
    assert Counter(r["id"] for r in read_all(warehouse / "log")) == Counter(
        {i: 3 for i in range(500)}
    )


async def test_stream_keys_and_the_lane_window_are_checked_before_anything_is_sent(
    start_cluster: StartCluster, warehouse: Path
) -> None:
    node = await one_node(start_cluster, warehouse)
    async with deltaflow.connect([node.address], token=TOKEN) as client:
        for kwargs, message in [
            ({"stream_key": "a key without an id"}, "stream_key= goes with stream_id="),
            ({"stream_id": "s", "stream_key": "short"}, "stream_key= has 5 bytes; use at least 16"),
            (
                {"stream_id": "s", "stream_key": 12345678901234567},
                "must be a str or bytes, not int",
            ),
        ]:
            with pytest.raises(UsageError, match=message):
                await client.stream_data([{"id": 1}], table="t", key="id", **kwargs)
    assert node.dispatcher.stats.streams == 0 and node.dispatcher.stats.batches_received == 0
    with pytest.raises(UsageError, match="per_partition_in_flight=65 is more than a node takes"):
        StreamerOptions(per_partition_in_flight=65)
    assert StreamerOptions(per_partition_in_flight=64).per_partition_in_flight == 64


async def test_streams_left_open_by_a_client_that_went_away_do_not_lock_others_out(
    start_cluster: StartCluster, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client holding the token opened streams up to the node's bound and disconnected;
    while it is connected, a new open is refused; once it is gone, its streams give way."""
    from deltaflow.server import streams

    monkeypatch.setattr(streams, "MAX_STREAMS", 8)
    node = await one_node(start_cluster, warehouse)
    intruder = await Intruder.connect(node.address)
    for i in range(8):
        assert (await intruder.open(f"hoard-{i}", TABLE_RECEIVER, None))["t"] == "opened"
    refused = await intruder.open("one-more", TABLE_RECEIVER, None)
    assert refused["t"] == "error" and refused["code"] == "OVERLOADED", refused
    await intruder.close()
    async with deltaflow.connect([node.address], token=TOKEN) as client:
        summary = await client.stream_data(({"id": i} for i in range(100)), table="t", key="id")
    assert summary.items_acked == 100
