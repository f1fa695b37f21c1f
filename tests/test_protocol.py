"""The wire format and the partition function: stable, strict, and safe to decode."""

from __future__ import annotations

import asyncio
import datetime as dt
import decimal
from collections import Counter
from typing import Any

import msgpack
import pytest

from deltaflow.errors import FrameTooLargeError, ProtocolError
from deltaflow.partitioning import PartitionMap, assign_partitions, partition_of
from deltaflow.protocol import (
    COALESCE_BYTES,
    QUEUE_HIGH_WATER,
    Outbox,
    decode_frame,
    decode_frames,
    encode_frame,
    join_items,
    pack_item,
    unpack_items,
)


def test_batch_frame_round_trips_items_of_every_supported_type() -> None:
    items = [
        {"id": 1, "name": "é", "v": 1.5, "ok": True, "none": None, "raw": b"\x00\x01"},
        [1, 2, [3]],
        "plain",
        dt.datetime(2026, 11, 22, 1, 2, 3, tzinfo=dt.UTC),
    ]
    frame = {
        "t": "batch",
        "sid": "s",
        "p": 3,
        "seq": 7,
        "n": len(items),
        "items": join_items(pack_item(i) for i in items),
        "del": [1],
    }
    decoded = decode_frame(encode_frame(frame))
    assert decoded["p"] == 3 and decoded["seq"] == 7 and decoded["del"] == [1]
    assert unpack_items(decoded["items"], decoded["n"]) == items


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        ({"t": "batch", "sid": "s", "p": "0", "seq": 0, "n": 0, "items": b""}, "field 'p'"),
        ({"t": "batch", "sid": "s", "p": True, "seq": 0, "n": 0, "items": b""}, "field 'p'"),
        ({"t": "open", "sid": "s", "receiver": "r", "extra": 1}, "unexpected fields"),
        ({"t": "ack", "sid": "s", "p": 0, "seq": 0}, "lacks field 'n'"),
        ({"t": "__import__", "name": "os"}, "unknown frame type"),
    ],
)
def test_frames_that_break_the_field_table_are_rejected(frame: dict, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_frame(encode_frame(frame))


def test_extension_types_are_never_interpreted() -> None:
    data = msgpack.packb({"t": "opened", "sid": msgpack.ExtType(42, b"payload")})
    with pytest.raises(ProtocolError, match="extension type 42"):
        decode_frame(data)
    with pytest.raises(ProtocolError, match="extension type 7"):
        unpack_items(msgpack.packb(msgpack.ExtType(7, b"x")), 1)


def test_table_value_types_cross_the_wire_as_themselves() -> None:
    values = [
        decimal.Decimal("12.30"),
        decimal.Decimal("-1E+3"),
        decimal.Decimal("0.000000000000000001"),
        dt.date(1, 1, 1),
        dt.date(9999, 12, 31),
        dt.datetime(1969, 12, 31, 23, 59, 59, 999999),
        dt.datetime(9999, 12, 31, 23, 59, 59, 999999),
        dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone(dt.timedelta(hours=-5))),
        {"nested": [decimal.Decimal("1.5"), dt.date(2026, 1, 2)]},
    ]
    got = unpack_items(join_items(pack_item(v) for v in values), len(values))
    assert got == values
    # Each arrives as the same type (a date is not a datetime, a decimal not a float), and an
    # aware datetime as the same instant in UTC.
    assert [type(v) for v in got] == [type(v) for v in values]
    assert [str(v) for v in got[:2]] == ["12.30", "-1E+3"]
    assert got[7].tzinfo is not None and got[7].utcoffset() == dt.timedelta(0)
    for bad in (decimal.Decimal("NaN"), decimal.Decimal("-Infinity")):
        with pytest.raises(TypeError, match="finite"):
            pack_item(bad)


@pytest.mark.parametrize(
    ("code", "payload"),
    [
        (1, b"__import__('os')"),  # not a decimal literal: never evaluated
        (1, b"1E+99999"),  # exponent beyond 4 digits
        (1, b"NaN"),
        (1, b"\xff"),
        (2, b"\x00\x00\x01"),  # a date is 4 bytes
        (2, b"\x7f\xff\xff\xff"),  # beyond the calendar
        (3, b"\x00" * 7),  # a datetime is 8 bytes
        (3, b"\x7f" + b"\xff" * 7),
    ],
)
def test_value_extension_types_with_bad_payloads_are_refused(code: int, payload: bytes) -> None:
    with pytest.raises(ProtocolError, match=f"extension type {code} holds no valid"):
        unpack_items(msgpack.packb(msgpack.ExtType(code, payload)), 1)


def test_oversize_frames_and_lying_counts_are_rejected() -> None:
    frame = encode_frame({"t": "opened", "sid": "x" * 2000})
    with pytest.raises(FrameTooLargeError, match="exceeds the limit of 1000 bytes"):
        decode_frame(frame, max_bytes=1000)
    blob = join_items(pack_item(i) for i in range(3))
    with pytest.raises(ProtocolError, match="declares 2 items but carries 3"):
        unpack_items(blob, 2)
    with pytest.raises(ProtocolError, match="declares 5 items but carries 3"):
        unpack_items(blob, 5)


def test_partition_of_is_stable_across_processes_and_releases() -> None:
    # Pinned values: changing the hash would silently re-route every existing stream.
    assert partition_of((1, "a"), 64) == partition_of([1, "a"], 64)  # composite keys
    assert partition_of("abc", 64) == 39
    assert partition_of(12345, 64) == 58


@pytest.mark.parametrize(
    "keys",
    [range(64_000), [f"k{i}" for i in range(64_000)], [(i, "x") for i in range(64_000)]],
    ids=["ints", "strings", "composite"],
)
def test_keys_spread_over_partitions(keys: Any) -> None:
    counts = Counter(partition_of(k, 64) for k in keys)
    assert len(counts) == 64
    assert max(counts.values()) < 1.2 * 1000 and min(counts.values()) > 0.8 * 1000


@pytest.mark.parametrize(
    ("before_ids", "after_ids"),
    [
        (["a", "b", "c"], ["a", "b"]),
        (["node-1", "node-2", "node-3"], ["node-1", "node-2"]),
        (["a", "b", "c", "d"], ["a", "c", "d"]),
    ],
)
@pytest.mark.parametrize("partitions", [64, 256])
def test_a_leaving_node_moves_its_partitions_and_few_others(
    before_ids: list[str], after_ids: list[str], partitions: int
) -> None:
    before = assign_partitions(before_ids, partitions)
    after = assign_partitions(after_ids, partitions)
    (gone,) = set(before_ids) - set(after_ids)
    moved = {p for p in range(partitions) if before[p] != after[p]}
    held = {p for p in range(partitions) if before[p] == gone}
    assert held <= moved
    assert len(moved - held) <= partitions // 16  # plain rendezvous hashing moves none
    assert assign_partitions(before_ids, partitions) == before  # the same on every node


@pytest.mark.parametrize("ids", [["node-1", "node-2"], ["n1", "n2", "n3"], list("abcde")])
def test_nodes_own_equal_shares_of_the_partitions(ids: list[str]) -> None:
    # Plain rendezvous hashing gave node-1 and node-2 25 and 39 of 64 partitions: node-2 then
    # applied 56% more rows than node-1, and set the pace of every stream.
    owned = Counter(assign_partitions(ids, 64))
    assert set(owned) == set(ids)
    assert max(owned.values()) - min(owned.values()) <= len(ids) - 1
    assert max(owned.values()) == -(-64 // len(ids))


def test_partition_map_round_trips_and_rejects_owners_without_address() -> None:
    pmap = PartitionMap.build(5, {"n1": "127.0.0.1:1", "n2": "127.0.0.1:2"}, 16)
    assert PartitionMap.from_wire(pmap.to_wire()) == pmap
    wire = pmap.to_wire()
    wire["nodes"].pop("n1")
    with pytest.raises(ValueError, match="owner has no address"):
        PartitionMap.from_wire(wire)


def test_a_message_may_carry_several_frames_each_checked() -> None:
    ack = {"t": "ack", "sid": "s", "p": 1, "seq": 0, "n": 3}
    opened = {"t": "opened", "sid": "s"}
    data = encode_frame(opened) + encode_frame(ack) + encode_frame({**ack, "seq": 1})
    assert decode_frames(data) == [opened, ack, {**ack, "seq": 1}]
    with pytest.raises(ProtocolError, match="expected one frame, got 3"):
        decode_frame(data)  # the handshake is one frame alone
    bad = encode_frame(opened) + msgpack.packb({"t": "exec", "code": "import os"})
    with pytest.raises(ProtocolError, match="unknown frame type 'exec'"):
        decode_frames(bad)
    with pytest.raises(FrameTooLargeError):
        decode_frames(data, max_bytes=len(data) - 1)
    with pytest.raises(ProtocolError, match="ends inside a frame"):
        decode_frames(data[:-1])  # a message never ends with part of a frame


async def test_outbox_holds_senders_back_while_the_peer_does_not_read() -> None:
    release = asyncio.Event()
    written: list[bytes] = []

    async def write(data: bytes) -> None:  # a socket whose peer stopped reading
        await release.wait()
        written.append(data)

    outbox = Outbox(write, multi=True, on_error=lambda exc: None)
    frame = encode_frame({"t": "opened", "sid": "x" * 100})
    sent = 0

    async def producer() -> None:
        nonlocal sent
        while sent < 2 * QUEUE_HIGH_WATER // len(frame):
            await outbox.send(frame)
            sent += 1

    task = asyncio.create_task(producer())
    for _ in range(100):
        await asyncio.sleep(0)
    # Held at the high-water mark, not queueing the whole run.
    assert sent <= QUEUE_HIGH_WATER // len(frame) + 2
    release.set()
    await asyncio.wait_for(task, 10)
    await outbox.drain()
    assert b"".join(written) == frame * sent  # everything, in order


async def test_outbox_sends_what_one_turn_queued_as_one_message_only_when_allowed() -> None:
    written: list[bytes] = []
    errors: list[BaseException] = []

    async def write(data: bytes) -> None:
        written.append(data)

    frames = [encode_frame({"t": "opened", "sid": f"s{i}"}) for i in range(5)]
    big = encode_frame(
        {"t": "result", "sid": "s", "p": 0, "seq": 0, "values": ["x" * COALESCE_BYTES]}
    )
    multi = Outbox(write, multi=True, on_error=errors.append)
    for f in [*frames, big, *frames]:
        await multi.send(f)
    await multi.drain()
    # The first frame of a turn goes at once; the rest of the turn follows together, never
    # past COALESCE_BYTES.
    assert written == [frames[0], b"".join(frames[1:]), big, b"".join(frames)]

    written.clear()
    small = Outbox(write, multi=True, on_error=errors.append, limit=2 * len(frames[0]))
    for f in frames:
        await small.send(f)
    await small.drain()
    assert written == [frames[0], frames[1] + frames[2], frames[3] + frames[4]]  # the peer's limit

    written.clear()
    single = Outbox(write, multi=False, on_error=errors.append)
    for f in frames:
        await single.send(f)
    await single.drain()
    assert written == frames
    assert errors == []


async def test_outbox_send_nowait_queues_a_turn_as_one_message_and_reports_its_room() -> None:
    written: list[bytes] = []

    async def write(data: bytes) -> None:
        written.append(data)

    outbox = Outbox(write, multi=True, on_error=lambda exc: None)
    frames = [encode_frame({"t": "opened", "sid": f"s{i}"}) for i in range(3)]
    for f in frames:
        outbox.send_nowait(f)  # no await: nothing is written yet
    assert written == []
    await outbox.drain()
    assert written == [b"".join(frames)]

    big = encode_frame({"t": "opened", "sid": "x" * 100})
    while outbox.has_room:
        outbox.send_nowait(big)
    waiter = asyncio.create_task(outbox.wait_for_room())
    await outbox.drain()
    await asyncio.wait_for(waiter, 5)  # the queue went out: room again
    assert outbox.has_room


async def test_outbox_reports_a_failed_write_and_drops_what_was_queued() -> None:
    errors: list[BaseException] = []
    calls = 0

    async def write(data: bytes) -> None:
        nonlocal calls
        calls += 1
        raise ConnectionResetError("peer gone")

    outbox = Outbox(write, multi=False, on_error=errors.append)
    for i in range(3):
        await outbox.send(encode_frame({"t": "opened", "sid": f"s{i}"}))
    await outbox.drain()
    # The first frame's write failed at once; the two queued behind it in that turn were
    # tried once more (by the outbox's task) and then dropped.
    assert calls == 2
    assert [type(e) for e in errors] == [ConnectionResetError] * 2
    await asyncio.sleep(0)  # a new turn
    await outbox.send(encode_frame({"t": "opened", "sid": "later"}))
    await asyncio.wait_for(outbox.drain(), 5)
    assert calls == 3
