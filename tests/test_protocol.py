"""The wire format: stable, strict, and safe to decode (the partition function:
tests/test_partitioning.py)."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import decimal
import pickle
import threading
import time
import uuid

import msgpack
import pytest

from deltaflow import protocol
from deltaflow.client.connection import _error_of
from deltaflow.errors import (
    FrameTooLargeError,
    OverloadedError,
    ProtocolError,
    SchemaError,
    ServerError,
    is_retriable,
)
from deltaflow.outbox import COALESCE_BYTES, QUEUE_HIGH_WATER, Outbox
from deltaflow.protocol import (
    CLIENT_ID,
    MAX_HELLO_BYTES,
    decode_frame,
    decode_frames,
    decode_hello,
    encode_frame,
    join_items,
    pack_item,
    pack_items,
    truncated_repr,
    unpack_items,
)
from deltaflow.server.frames import error_frame

from .support import allocation_peak


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
        ({"t": "open", "sid": "s", "receiver": "r", "key": b"k", "extra": 1}, "unexpected fields"),
        ({"t": "open", "sid": "s", "receiver": "r"}, "^'open' frame lacks field 'key'$"),
        ({"t": "ack", "sid": "s", "p": 0, "seq": 0}, "lacks field 'n'"),
        # Optional fields left out do not end the check of the fields after them.
        ({"t": "error", "code": "X", "msg": "m"}, "^'error' frame lacks field 'retriable'$"),
        (
            {"t": "batch", "sid": "s", "p": 0, "seq": 0, "n": 0, "arrow": b"", "base": "1"},
            "^'batch' frame field 'base' has type str$",
        ),
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
    with pytest.raises(ProtocolError, match="declares 2 items but carries more"):
        unpack_items(blob, 2)
    with pytest.raises(ProtocolError, match="declares 5 items but carries 3"):
        unpack_items(blob, 5)


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


def test_a_frame_is_a_map_with_string_keys_in_valid_msgpack() -> None:
    with pytest.raises(ProtocolError, match=r"^frame must be a msgpack map, got list$"):
        decode_frame(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError, match=r"^frame is not valid msgpack: "):
        decode_frame(b"\xc1")  # a byte msgpack never uses
    with pytest.raises(ProtocolError, match=r"^'opened' frame has unexpected fields \[1\]$"):
        decode_frame(msgpack.packb({"t": "opened", "sid": "s", 1: "x"}))
    # Maps inside items, and so inside results and args, may have keys of other types.
    assert unpack_items(pack_item({1: "x", b"k": None}), 1) == [{1: "x", b"k": None}]
    result = {"t": "result", "sid": "s", "p": 0, "seq": 0, "values": [{1: "x", 2.5: b"k"}]}
    assert decode_frame(encode_frame(result)) == result


def test_a_frame_of_exactly_the_size_limit_is_taken() -> None:
    data = encode_frame({"t": "opened", "sid": "x" * 100})
    assert decode_frame(data, max_bytes=len(data)) == {"t": "opened", "sid": "x" * 100}
    assert decode_frames(data, max_bytes=len(data)) == [{"t": "opened", "sid": "x" * 100}]


def test_every_frame_of_a_message_is_decoded_as_strictly_as_the_first() -> None:
    first = encode_frame({"t": "opened", "sid": "s"})
    smuggled = msgpack.packb(
        {"t": "open", "sid": "s", "receiver": "r", "args": msgpack.ExtType(42, b"x")}
    )
    with pytest.raises(ProtocolError, match="extension type 42 is not allowed"):
        decode_frames(first + smuggled)
    int_keys = msgpack.packb({"t": "opened", "sid": "s", 1: "x"})
    with pytest.raises(ProtocolError, match=r"unexpected fields \[1\]"):
        decode_frames(first + int_keys)
    when = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
    result = {"t": "result", "sid": "s", "p": 0, "seq": 0, "values": [when]}
    assert decode_frames(first + encode_frame(result))[1]["values"] == [when]
    for tail in (b"\xc4", b"\x92\x01"):  # a frame cut after its first byte(s)
        with pytest.raises(ProtocolError, match=r"^a message ends inside a frame$"):
            decode_frames(first + tail)


def test_the_field_table_notation_marks_optional_fields_and_where_bools_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A field type list says what a field takes; a trailing "?" makes it optional; True and
    # False go only where the list has bool (or any object), never where it has int.
    spec = {"n": (int,), "flag?": (bool,), "any?": (object,), "when?": (int, type(None))}
    monkeypatch.setitem(protocol._COMPILED, "probe", protocol._compile(spec))
    for frame in (
        {"t": "probe", "n": 1},
        {"t": "probe", "n": 1, "flag": True, "any": False, "when": None},
    ):
        assert decode_frame(encode_frame(frame)) == frame
    for frame, message in (
        ({"t": "probe"}, "^'probe' frame lacks field 'n'$"),
        ({"t": "probe", "n": True}, "^'probe' frame field 'n' has type bool$"),
        ({"t": "probe", "n": 1, "when": False}, "^'probe' frame field 'when' has type bool$"),
        (
            {"t": "probe", "n": 1, "flag?": True},
            r"^'probe' frame has unexpected fields \['flag\?'\]$",
        ),
        ({"t": "probe", "n": 1, "T": 1}, r"^'probe' frame has unexpected fields \['T'\]$"),
    ):
        with pytest.raises(ProtocolError, match=message):
            decode_frame(encode_frame(frame))


def test_result_frames_carry_the_table_value_types() -> None:
    values = [decimal.Decimal("-0.50"), dt.date(2026, 3, 4), dt.datetime(2026, 3, 4, 5, 6, 7, 8)]
    result = {"t": "result", "sid": "s", "p": 0, "seq": 1, "values": values}
    decoded = decode_frame(encode_frame(result))
    assert decoded["values"] == values
    assert [type(v) for v in decoded["values"]] == [type(v) for v in values]


def test_items_packed_on_another_thread_are_the_same_bytes() -> None:
    # Blocking clients may stream from several threads of one process.
    items = [b"\x00\xff", "é", dt.datetime(2026, 1, 2, tzinfo=dt.UTC), decimal.Decimal("1.5")]
    packed: list[list[bytes]] = []
    thread = threading.Thread(target=lambda: packed.append([pack_item(i) for i in items]))
    thread.start()
    thread.join()
    assert packed == [[pack_item(i) for i in items]]
    assert unpack_items(join_items(packed[0]), len(items)) == items
    assert pack_items(items) == packed[0]


class _WallClock(dt.tzinfo):
    """A zone without an offset: a datetime holding it is naive."""

    def utcoffset(self, when: dt.datetime | None) -> dt.timedelta | None:
        return None

    def dst(self, when: dt.datetime | None) -> dt.timedelta | None:
        return None

    def tzname(self, when: dt.datetime | None) -> str | None:
        return None


class _Timestamp(dt.datetime):
    """A datetime subclass like pandas' Timestamp, with nanoseconds."""

    nanosecond = 0


def test_datetime_subclasses_cross_as_the_instant_or_wall_time_they_hold() -> None:
    aware = _Timestamp(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    naive = _Timestamp(2026, 1, 2, 3, 4, 5, 6)
    wall = _Timestamp(2026, 1, 2, 3, 4, 5, 6, tzinfo=_WallClock())
    got = unpack_items(join_items(pack_item(v) for v in (aware, naive, wall)), 3)
    assert got == [aware, naive.replace(), wall.replace(tzinfo=None)]
    assert got[0].utcoffset() == dt.timedelta(0) and got[1].tzinfo is None
    assert got[2].tzinfo is None and got[2].hour == 3
    fine = _Timestamp(2026, 1, 2)
    fine.nanosecond = 7  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"has nanoseconds; deltaflow carries microseconds$"):
        pack_item(fine)


def test_a_value_msgpack_cannot_carry_is_refused_naming_its_type() -> None:
    with pytest.raises(TypeError, match=r"^can not serialize 'object' object$"):
        pack_item({"v": object()})
    with pytest.raises(TypeError, match=r"^Decimal NaN cannot be sent: table decimals hold finite"):
        pack_item(decimal.Decimal("NaN"))


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 65535, 65536])
def test_a_well_formed_batch_is_read_in_one_pass(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The node reads a batch's items as one msgpack array (one C call); the item-by-item
    # reader only runs to say what is wrong with a batch.
    kinds = [{1: "int key"}, dt.datetime(2026, 1, 2, tzinfo=dt.UTC), decimal.Decimal("1.5"), "s"]
    items = [kinds[i] if i < len(kinds) else i for i in range(count)]
    blob = join_items(pack_items(items))

    def item_by_item(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a well-formed batch of {count} items was read item by item")

    monkeypatch.setattr(protocol.msgpack, "Unpacker", item_by_item)
    assert unpack_items(blob, count) == items


def test_a_batch_count_is_checked_without_reading_past_it() -> None:
    assert unpack_items(b"", 0) == []
    three = join_items(pack_item(i) for i in range(3))
    garbage = b"\xc1" * 3  # bytes msgpack never uses: reading them would fail differently
    with pytest.raises(ProtocolError, match=r"^batch declares 2 items but carries more$"):
        unpack_items(three + garbage, 2)
    with pytest.raises(ProtocolError, match=r"^batch declares 0 items but carries more$"):
        unpack_items(pack_item(1) + garbage, 0)
    maps = join_items(pack_item({i: "x"}) for i in range(3))  # keys items may have
    with pytest.raises(ProtocolError, match=r"^batch declares 5 items but carries 3$"):
        unpack_items(maps, 5)
    with pytest.raises(ProtocolError, match=r"^batch items are not valid msgpack: "):
        unpack_items(pack_item(1) + garbage, 3)
    with pytest.raises(ProtocolError, match=r"^batch declares -1 items but carries more$"):
        unpack_items(pack_item(1), -1)


class _StalledSocket:
    """A socket whose writes wait until the test lets one through."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def write(self, data: bytes) -> None:
        self.written.append(data)
        self.started.set()
        await self.release.wait()
        self.release.clear()

    async def wrote(self, count: int) -> None:
        """Wait until ``count`` writes started."""
        async with asyncio.timeout(5):
            while len(self.written) < count:
                self.started.clear()
                await self.started.wait()


async def test_outbox_room_is_exactly_the_high_water_mark() -> None:
    socket = _StalledSocket()
    outbox = Outbox(socket.write, multi=False, on_error=lambda exc: None)
    written = 0
    for _ in range(2):  # a new outbox, then one whose queue went out: the count starts at 0
        outbox.send_nowait(b"a" * (QUEUE_HIGH_WATER - 1))
        outbox.send_nowait(b"b")
        assert outbox.has_room, "at the high-water mark there is still room"
        outbox.send_nowait(b"c")
        assert not outbox.has_room, "past the high-water mark there is none"
        for _ in range(3):
            written += 1
            await socket.wrote(written)
            socket.release.set()
        await outbox.drain()
    assert socket.written == [b"a" * (QUEUE_HIGH_WATER - 1), b"b", b"c"] * 2


async def test_outbox_room_returns_as_soon_as_at_most_the_mark_is_queued() -> None:
    socket = _StalledSocket()
    outbox = Outbox(socket.write, multi=False, on_error=lambda exc: None)
    third = QUEUE_HIGH_WATER // 2 + 1
    for part in (b"1", b"2", b"3"):
        outbox.send_nowait(part * third)
    assert not outbox.has_room
    rooms = []
    for count in (1, 2, 3):  # each write starts once the previous one went through
        await socket.wrote(count)
        rooms.append(outbox.has_room)
        socket.release.set()
    assert rooms == [False, True, True]
    await outbox.drain()
    assert socket.written == [b"1" * third, b"2" * third, b"3" * third]
    outbox.send_nowait(b"4")
    outbox.send_nowait(b"5" * QUEUE_HIGH_WATER)
    assert not outbox.has_room
    await socket.wrote(4)
    assert outbox.has_room, "exactly the mark is queued behind the write: room"
    socket.release.set()
    await socket.wrote(5)
    socket.release.set()
    await outbox.drain()


async def test_outbox_writes_the_first_frame_of_every_turn_at_once() -> None:
    written: list[bytes] = []

    async def write(data: bytes) -> None:
        written.append(data)

    outbox = Outbox(write, multi=True, on_error=lambda exc: None)
    for turn in range(3):
        await outbox.send(b"%d" % turn)
        assert written[-1] == b"%d" % turn, "a lone frame waited for the outbox's task"
        await asyncio.sleep(0)  # the next turn of the event loop
    assert written == [b"0", b"1", b"2"]


@pytest.mark.parametrize(
    ("err", "retriable"),
    [
        (OverloadedError("busy", node="n1"), True),
        (OverloadedError("busy", node="n1", retriable=False), False),
        (SchemaError("no column v", node="n1", details={"item": 3}), False),
        (SchemaError("no column v", node="n1", retriable=True), True),
        (ServerError("commit failed", node="n1", retriable=False), False),
    ],
)
def test_an_error_frame_becomes_an_error_with_the_frames_retry_decision(
    err: ServerError, retriable: bool
) -> None:
    frame = decode_frame(encode_frame(error_frame(err, sid="s", p=0, seq=1)))
    assert frame["retriable"] is retriable
    got = _error_of(frame)
    assert type(got) is type(err)
    assert (got.args, got.node, got.details) == (err.args, err.node, err.details)
    assert got.retriable is retriable and is_retriable(got) is retriable
    # An unknown code is a generic server error that still follows the frame.
    unknown = _error_of({**frame, "code": "NEW_CODE"})
    assert type(unknown) is ServerError and unknown.details["code"] == "NEW_CODE"
    assert is_retriable(unknown) is retriable


def test_an_errors_retry_decision_is_fixed_when_it_is_built() -> None:
    err = OverloadedError("busy", node="n1", details={"item": 2})
    with pytest.raises(AttributeError, match="fixed when it is built"):
        err.retriable = False
    final = err.as_final()
    assert type(final) is OverloadedError and final is not err
    assert (final.args, final.node, final.details) == (err.args, err.node, err.details)
    assert (is_retriable(err), is_retriable(final)) == (True, False)
    assert final.as_final() is final
    for kept in (copy.copy(final), pickle.loads(pickle.dumps(final))):
        assert type(kept) is OverloadedError and kept.retriable is False
        assert (kept.args, kept.node, kept.details) == (err.args, err.node, err.details)


MiB = 1024 * 1024


def test_a_hello_is_capped_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    hello = {"t": "hello", "v": [1], "caps": [], "client": "c", "token": "t" * 4000}
    assert len(encode_frame(hello)) <= MAX_HELLO_BYTES
    assert decode_hello(encode_frame(hello)) == hello
    with pytest.raises(ProtocolError, match=r"^expected hello, got 'opened'$"):
        decode_hello(encode_frame({"t": "opened", "sid": "s"}))
    big = encode_frame({**hello, "token": "t" * MAX_HELLO_BYTES})

    def unread(*args: object, **kwargs: object) -> None:
        raise AssertionError("a hello over the limit was decoded")

    monkeypatch.setattr(protocol.msgpack, "unpackb", unread)
    with pytest.raises(FrameTooLargeError, match=rf"^hello of {len(big)} bytes exceeds the limit "):
        decode_hello(big)


def test_a_batch_holds_at_most_one_item_per_16_bytes_of_the_frame_limit() -> None:
    limit = MiB // 16
    rows = join_items(pack_items({"i": i % 100} for i in range(limit)))
    assert len(unpack_items(rows, limit, max_bytes=MiB)) == limit  # up to the limit: taken
    empty_maps = b"\x80" * MiB
    with (
        allocation_peak() as peak,
        pytest.raises(ProtocolError, match=rf"^batch declares {MiB} items; a batch holds at most "),
    ):
        unpack_items(empty_maps, MiB, max_bytes=MiB)
    assert peak[0] < 64 * 1024  # refused unread


def nested_empty_maps(count: int, per_item: int) -> bytes:
    """``count`` items, each an array of ``per_item`` empty maps (1 byte each)."""
    return (b"\xdd" + per_item.to_bytes(4, "big") + b"\x80" * per_item) * count


def test_maps_arrays_and_extension_values_are_counted_however_they_nest() -> None:
    limit = MiB // 16  # one per 16 bytes of the limit
    over = f"^message holds more than {limit} maps, arrays and extension values"
    with allocation_peak() as peak, pytest.raises(ProtocolError, match=over):
        unpack_items(nested_empty_maps(8, limit // 8), 8, max_bytes=MiB)
    assert peak[0] < 16 * MiB  # they took 75 MiB before they were counted
    decimals = join_items(pack_items([[decimal.Decimal(1)] * (limit // 2)] * 2))
    with pytest.raises(ProtocolError, match=over):
        unpack_items(decimals, 2, max_bytes=MiB)
    # In frames too, and in every frame of a message.
    result = {"t": "result", "sid": "s", "p": 0, "seq": 0}
    crowded = encode_frame({**result, "values": [[{}] * limit]})
    opened = encode_frame({"t": "opened", "sid": "s"})
    for data in (crowded, opened + crowded):
        with pytest.raises(ProtocolError, match=over):
            decode_frames(data, max_bytes=MiB)
    # The limit is the whole message's: the two frames' maps and the two arrays fill it.
    fits = {**result, "values": [[{}] * (limit - 4)]}
    assert decode_frames(opened + encode_frame(fits), max_bytes=MiB)[1] == fits


def test_values_nested_deeper_than_msgpacks_stack_are_refused_by_name() -> None:
    deep = b"\x91" * 1025 + b"\xc0"
    with pytest.raises(ProtocolError, match=r"^batch items are nested deeper than 1024 levels$"):
        unpack_items(deep, 1)
    args = b"\x84" + b"".join(map(msgpack.packb, ("t", "open", "sid", "s", "receiver", "r")))
    with pytest.raises(ProtocolError, match=r"^frame is nested deeper than 1024 levels$"):
        decode_frame(args + msgpack.packb("args") + deep)
    nested: object = None
    for _ in range(500):
        nested = [nested]
    assert unpack_items(b"\x91" * 500 + b"\xc0", 1) == [nested]


def test_values_from_the_wire_reach_protocol_errors_cut_short() -> None:
    for frame, start in (
        ({"t": "x" * 100_000}, "unknown frame type 'xxxx"),
        ({"t": "opened", "sid": "s", **{f"f{i}": 1 for i in range(10_000)}}, "'opened' frame has"),
    ):
        with pytest.raises(ProtocolError) as info:
            decode_frame(encode_frame(frame))
        assert str(info.value).startswith(start) and "..." in str(info.value)
        assert len(str(info.value)) < 120
    assert truncated_repr("a\nb") == "'a\\nb'"  # quoted: no line of its own in a log
    deep: list[object] = []
    for _ in range(5000):
        deep = [deep]
    started = time.monotonic()
    for value in (b"\x00" * MiB, "x" * MiB, [{}] * MiB, dict.fromkeys(range(MiB)), deep):
        shown = truncated_repr(value)
        assert len(shown) <= 67 and shown[0] in "'b[{", shown
    assert time.monotonic() - started < 0.5  # none of them is walked whole


def test_client_ids_are_plain_and_short() -> None:
    for good in (uuid.uuid4().hex, "worker-3@host:7700/a.b_c", "a" * 64):
        assert CLIENT_ID.fullmatch(good), good
    for bad in ("", "a" * 65, "id\n", "a b", "é", "x\r", "\x1b[2J", "\x00"):
        assert not CLIENT_ID.fullmatch(bad), bad
