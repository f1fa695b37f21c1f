"""Bad input gets a precise error while the node keeps serving a concurrent good stream."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

import deltaflow
from deltaflow import DataStreamerError, StreamerOptions
from deltaflow.errors import AuthenticationError, SchemaError, UsageError
from deltaflow.partitioning import PartitionMap, partition_of
from deltaflow.protocol import WS_PATH, decode_frame, decode_frames, encode_frame, pack_item
from deltaflow.server import Node

from .support import StartCluster, read_delta

TOKEN = "s3cret-token"
KEY = b"k" * 32  # the stream key raw connections open their streams with


@pytest.fixture
async def guarded(
    spark: Any, warehouse: Path, start_cluster: StartCluster
) -> AsyncIterator[list[Node]]:
    """Two nodes with a token and a small (64 KiB) frame limit."""
    nodes = await start_cluster(warehouse, token=TOKEN, max_frame_bytes=64 * 1024)
    yield nodes
    for node in reversed(nodes):
        await node.stop()


async def raw_session(
    address: str, token: str | None = TOKEN, caps: list[str] | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    session = aiohttp.ClientSession()
    ws = await session.ws_connect(f"http://{address}{WS_PATH}", max_msg_size=1 << 24)
    hello = {"t": "hello", "v": [1], "caps": caps or [], "client": "raw", "token": token}
    await ws.send_bytes(encode_frame(hello))
    msg = await ws.receive()
    return session, ws, decode_frame(msg.data)


async def good_stream(address: str, n: int = 3000) -> deltaflow.StreamSummary:
    async with deltaflow.connect([address], token=TOKEN) as client:
        return await client.stream_data(
            [{"i": i} for i in range(n)],
            key="i",
            receiver="deltaflow.testing.Echo",
            options=StreamerOptions(page_size=100),
        )


async def expect_abort(ws: Any) -> tuple[dict[str, Any] | None, int]:
    """The node's error frame (None if the socket closed first), then the close code."""
    msg = await ws.receive()
    error = None
    if msg.type == aiohttp.WSMsgType.BINARY:
        error = decode_frame(msg.data)
        msg = await ws.receive()
    assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    return error, ws.close_code


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1\xc1 not msgpack",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"t": "batch", "sid": 1}),
        msgpack.packb({"t": "exec", "code": "import os"}),
        msgpack.ExtType(5, b"x"),
    ],
    ids=["garbage", "not-a-map", "wrong-field-types", "unknown-type", "ext-type"],
)
async def test_malformed_frame_closes_only_that_connection(
    guarded: list[Node], payload: Any
) -> None:
    address = guarded[0].address
    good = asyncio.create_task(good_stream(address))
    session, ws, welcome = await raw_session(address)
    try:
        assert welcome["t"] == "welcome"
        data = payload if isinstance(payload, bytes) else msgpack.packb(payload)
        await ws.send_bytes(data)
        error, code = await expect_abort(ws)
    finally:
        await session.close()
    assert error is not None
    assert error["code"] == "BAD_FRAME"
    assert error["node"] == "node-1"
    assert error["retriable"] is False
    assert code == aiohttp.WSCloseCode.PROTOCOL_ERROR
    assert (await good).items_acked == 3000


async def test_oversize_frame_is_refused_with_the_limit_named(guarded: list[Node]) -> None:
    address = guarded[1].address
    good = asyncio.create_task(good_stream(address))
    session, ws, _ = await raw_session(address)
    try:
        await ws.send_bytes(b"\x00" * (100 * 1024))
        error, code = await expect_abort(ws)
    finally:
        await session.close()
    # aiohttp's reader closes with 1009 (message too big) before the oversize frame is even
    # buffered, so no error frame comes (the client's own check names the limit instead:
    # tests/test_guarantees.py); only this connection is closed.
    assert code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
    assert error is None or error["code"] == "FRAME_TOO_LARGE", error
    assert (await good).items_acked == 3000


async def test_client_never_sends_an_item_larger_than_a_batch(guarded: list[Node]) -> None:
    async with deltaflow.connect([guarded[0].address], token=TOKEN) as client:
        big = {"i": 1, "blob": b"x" * 200_000}
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                [{"i": 0}, big],
                key="i",
                receiver="deltaflow.testing.Echo",
                options=StreamerOptions(max_batch_bytes=100_000),
            )
    assert "source item #1 packs to" in str(info.value)
    # The item before it was still buffered: neither was sent.
    assert info.value.failed_items == [{"i": 0}, big]


async def test_wrong_token_is_refused_and_good_clients_go_on(guarded: list[Node]) -> None:
    address = guarded[0].address
    good = asyncio.create_task(good_stream(address))
    with pytest.raises(AuthenticationError, match="rejected the token"):
        async with deltaflow.connect([address], token="wrong"):
            pass
    session, _ws, error = await raw_session(address, token="wrong")
    with contextlib.suppress(Exception):
        await session.close()
    assert error["t"] == "error" and error["code"] == "UNAUTHORIZED"
    assert (await good).items_acked == 3000


@pytest.mark.parametrize("engine", ["spark", "delta-rs"])
async def test_rows_that_do_not_fit_the_schema_fail_only_their_batch(
    cluster: list[Node], warehouse: Path
) -> None:
    opts = StreamerOptions(page_size=1000, auto_flush_interval=0)
    async with deltaflow.connect([cluster[0].address]) as client:
        await client.stream_data(
            [{"id": i, "value": float(i)} for i in range(10)], table="typed", key="id"
        )
        partitions = client.partition_map.partitions
        rows = [{"id": i, "value": float(i)} for i in range(10, 100)]
        rows[40] = {"id": 50, "value": "not a number"}
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(rows, table="typed", key="id", options=opts)
    cause = info.value.cause
    assert isinstance(cause, SchemaError)
    assert "column 'value'" in str(cause) and "double" in str(cause)
    bad_partition = partition_of(50, partitions)
    in_bad = [r for r in rows if partition_of(r["id"], partitions) == bad_partition]
    assert info.value.failed_items == in_bad
    table = read_delta(warehouse / "typed")
    assert set(table) == set(range(100)) - {r["id"] for r in in_bad}


async def test_items_that_cannot_be_encoded_are_named(cluster: list[Node]) -> None:
    bad = {"i": 3, "when": object()}
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                [{"i": 1}, {"i": 2}, bad], key="i", receiver="deltaflow.testing.Echo"
            )
    assert isinstance(info.value.cause, UsageError)
    assert "source item #2 cannot be sent" in str(info.value.cause)
    assert info.value.failed_items == [{"i": 1}, {"i": 2}, bad]


def test_usage_errors_say_what_to_do() -> None:
    with pytest.raises(UsageError, match="host:port"):
        deltaflow.connect(["nohost"])
    with pytest.raises(UsageError, match="page_size"):
        StreamerOptions(page_size=0)
    with pytest.raises(UsageError, match="stagger_pages must be True or False"):
        StreamerOptions(stagger_pages="yes")  # type: ignore[arg-type]
    _ = dataclasses  # keep import for readability of options tests


async def test_a_stream_id_outside_the_allowed_characters_is_refused(guarded: list[Node]) -> None:
    session, ws, _ = await raw_session(guarded[0].address)
    try:
        for sid in ("../../etc/passwd", "x" * 161, "a\nb"):
            await ws.send_bytes(
                encode_frame({"t": "open", "sid": sid, "receiver": "x", "key": KEY})
            )
            answer = decode_frame((await ws.receive()).data)
            assert answer["t"] == "error" and answer["code"] == "BAD_FRAME"
            assert "stream id" in answer["msg"] and "not allowed" in answer["msg"]
        # The connection stays usable for a good stream id.
        await ws.send_bytes(
            encode_frame(
                {"t": "open", "sid": "good-1", "receiver": "deltaflow.testing.Echo", "key": KEY}
            )
        )
        assert decode_frame((await ws.receive()).data) == {"t": "opened", "sid": "good-1"}
    finally:
        await session.close()


@pytest.mark.parametrize("caps", [[], ["multi"]], ids=["one-frame-per-message", "multi"])
async def test_frames_share_a_message_only_with_a_client_that_lists_multi(
    guarded: list[Node], caps: list[str]
) -> None:
    session, ws, welcome = await raw_session(guarded[0].address, caps=caps)
    try:
        assert ("multi" in welcome["caps"]) == bool(caps)
        owned = PartitionMap.from_wire(welcome["map"]).owners
        partitions = [p for p, node in enumerate(owned) if node == welcome["node"]][:6]
        sid = "raw-multi-" + "-".join(caps)
        # Echo answers each item with itself: 6 results of 9 KB from one message's batches.
        items = {p: pack_item({"i": p, "blob": "x" * 9_000}) for p in partitions}
        frames = [{"t": "open", "sid": sid, "receiver": "deltaflow.testing.Echo", "key": KEY}]
        frames += [
            {"t": "batch", "sid": sid, "p": p, "seq": 0, "n": 1, "items": items[p]}
            for p in partitions
        ]
        # A node reads several frames in one message from any client.
        await ws.send_bytes(b"".join(encode_frame(f) for f in frames))
        per_message: list[list[str]] = []
        acked: set[int] = set()
        async with asyncio.timeout(30):
            while len(acked) < len(partitions):
                msg = await ws.receive()
                assert len(msg.data) <= 64 * 1024  # never past the node's (announced) limit
                got = decode_frames(msg.data)
                per_message.append([f["t"] for f in got])
                acked |= {f["p"] for f in got if f["t"] == "ack"}
    finally:
        await session.close()
    assert acked == set(partitions)
    sizes = [len(kinds) for kinds in per_message]
    if caps:  # what one event-loop turn produced went out together
        assert max(sizes) > 1, per_message
    else:
        assert set(sizes) == {1}, per_message


async def test_a_client_joins_frames_only_up_to_the_nodes_limit(guarded: list[Node]) -> None:
    # 32 batches of one 12 KB item go out in one event-loop turn: joined, they would be far
    # over the nodes' 64 KiB limit, and a node closes a connection sending such a message.
    items = [{"i": i, "blob": "x" * 12_000} for i in range(200)]
    async with deltaflow.connect([guarded[0].address], token=TOKEN) as client:
        summary = await client.stream_data(
            items,
            key="i",
            receiver="deltaflow.testing.Echo",
            options=StreamerOptions(page_size=1, max_in_flight=32),
        )
    assert summary.items_acked == len(items)
    assert summary.batches_retried == 0


async def test_a_table_name_with_a_trailing_newline_is_refused(
    cluster: list[Node], warehouse: Path
) -> None:
    """Finding 7: ``re.match`` with ``$`` took ``"events\\n"`` and the node made a directory
    named so. Every name pattern is matched whole now."""
    from deltaflow.receivers.base import check_table_name

    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(UsageError, match=r"table name 'events\\n' is not allowed"):
            await client.stream_data([{"id": 1}], table="events\n", key="id")
    # The node's own check, for a client that does not check first.
    with pytest.raises(SchemaError, match=r"table name 'events\\n' is not allowed"):
        check_table_name("events\n")
    names = await asyncio.to_thread(lambda: [p.name for p in Path(warehouse).iterdir()])
    assert not any(name.startswith("events") for name in names)


async def test_a_row_without_its_key_is_named_or_quarantined(
    cluster: list[Node], warehouse: Path
) -> None:
    import pyarrow as pa

    from .support import open_table

    rows: list[Any] = [{"id": i, "v": i} for i in range(10)]
    rows[3] = {"v": 3}  # no key column
    rows[6] = deltaflow.Delete({"name": "x"})  # a delete without its key
    batches = [
        pa.table({"id": [10, 11], "v": [1, 2]}),
        pa.table({"v": [7, 8, 9]}),  # a batch without the key column
        pa.table({"id": [12], "v": [3]}),
    ]
    quarantine = StreamerOptions(on_bad_row="quarantine")
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(rows, table="keyless", key="id")
        with pytest.raises(DataStreamerError) as arrow_info:
            await client.stream_data(batches, table="keyless", key="id")
        summary = await client.stream_data(rows, table="keyless", key="id", options=quarantine)
        arrow = await client.stream_data(batches, table="keyless", key="id", options=quarantine)
    cause = str(info.value.cause)
    assert isinstance(info.value.cause, UsageError)
    assert "source item #3 has no key column 'id' (its columns: v)" in cause
    assert "on_bad_row='quarantine'" in cause
    assert "lacks the key column(s) ['id'] (its columns: v)" in str(arrow_info.value.cause)
    assert (summary.items_acked, summary.items_quarantined) == (8, 2)
    assert (summary.items_dead_lettered, summary.items_failed) == (2, 0)
    assert (arrow.items_acked, arrow.items_quarantined, arrow.items_failed) == (3, 3, 0)
    assert sorted(read_delta(warehouse / "keyless")) == [0, 1, 2, 4, 5, 7, 8, 9, 10, 11, 12]
    dead = open_table(warehouse / "deltaflow_dead_letters").to_pyarrow_table().to_pylist()
    letters = sorted((r["position"], r["partition"], r["seq"], r["deleted"]) for r in dead)
    assert letters == [(2, -1, -1, False), (3, -1, -1, False), (3, -1, -1, False),
                       (4, -1, -1, False), (6, -1, -1, True)]  # fmt: skip
    assert {r["error_code"] for r in dead} == {"SCHEMA_MISMATCH"}
    by_payload = {msgpack.unpackb(r["payload"]).get("v"): r["error"] for r in dead}
    assert "no key column 'id'" in by_payload[3]
    assert "an Arrow batch of 3 rows" in by_payload[8]


async def test_rows_without_their_key_in_a_long_source_are_set_aside_where_they_stand(
    cluster: list[Node], warehouse: Path
) -> None:
    """Keyless rows at the ends of the client's read-ahead chunks (4,096 rows) and pages of a
    long source: each is dead-lettered with its own position, every other row applied."""
    from .support import open_table

    n, missing = 9_000, {0, 99, 100, 4_095, 4_096, 8_191, 8_999}
    rows: list[Any] = [{"v": i} if i in missing else {"id": i, "v": i} for i in range(n)]
    options = StreamerOptions(
        on_bad_row="quarantine", page_size=100, dead_letter_table="long_keyless_dead"
    )
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(rows, table="long_keyless", key="id", options=options)
    assert (summary.items_acked, summary.items_dead_lettered) == (n - len(missing), len(missing))
    assert sorted(read_delta(warehouse / "long_keyless")) == sorted(set(range(n)) - missing)
    dead = open_table(warehouse / "long_keyless_dead").to_pyarrow_table().to_pylist()
    assert {r["position"]: msgpack.unpackb(r["payload"])["v"] for r in dead} == {
        i: i for i in missing
    }


async def test_an_arrow_page_may_not_set_deltaflow_s_columns(
    cluster: list[Node], warehouse: Path
) -> None:
    """A page's column under deltaflow's prefixes (stored or a group's working column) fails
    its batch naming the column, and the table keeps what it held."""
    import pyarrow as pa

    async with deltaflow.connect([cluster[0].address]) as client:
        await client.stream_data([{"id": 1, "v": 1}], table="paged", key="id")
        for column in ("_deltaflow_bucket", "__deltaflow_replace"):
            page = pa.table({"id": [1], "v": [2], column: pa.array([True])})
            with pytest.raises(DataStreamerError) as info:
                await client.stream_data([page], table="paged", key="id")
            assert f"the page sets column {column!r}, which deltaflow reserves" in str(info.value)
    assert {k: r["v"] for k, r in read_delta(warehouse / "paged").items()} == {1: 1}


async def test_rows_set_aside_wait_for_the_dead_letter_table(
    cluster: list[Node], warehouse: Path
) -> None:
    """Quarantined rows cannot pile up in the client: while the dead-letter table's writes
    are held, the stream stops pulling its source once the dead-letter window is full, and
    goes on when they land."""
    from .support import holding, open_table

    pulled = 0

    async def source() -> AsyncIterator[dict[str, int]]:
        nonlocal pulled
        for i in range(60):
            pulled += 1
            yield {"id": i, "v": i} if i == 0 else {"v": i}  # the rest without their key

    window = 4
    options = StreamerOptions(on_bad_row="quarantine", max_in_flight=window, page_size=10)
    async with deltaflow.connect([cluster[0].address]) as client:
        async with holding(warehouse, "deltaflow_dead_letters"):
            stream = asyncio.create_task(
                client.stream_data(source(), table="aside", key="id", options=options)
            )
            seen = -1
            while pulled != seen:  # until the source is no longer pulled
                seen = pulled
                await asyncio.sleep(0.5)  # (no event marks "nothing happens")
            assert not stream.done()
            assert pulled <= 1 + window + 1, f"{pulled} items pulled past a full window"
        summary = await asyncio.wait_for(stream, 120)
    assert (summary.items_acked, summary.items_quarantined, summary.items_failed) == (1, 59, 0)
    dead = open_table(warehouse / "deltaflow_dead_letters").to_pyarrow_table()
    assert sorted(dead.column("position").to_pylist()) == list(range(1, 60))


@pytest.mark.parametrize(
    ("name", "fix"), [("my-table", "my_table"), ("orders.v2", "orders_v2"), ("über", "_ber")]
)
async def test_a_bad_table_name_is_refused_before_anything_is_sent(
    name: str, fix: str, cluster: list[Node]
) -> None:
    sent: list[int] = []

    def rows() -> Any:
        sent.append(1)
        yield {"id": 1}

    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(UsageError, match=rf"table name '{name}' is not allowed.*'{fix}', say"):
            await client.stream_data(rows(), table=name, key="id")
    with pytest.raises(UsageError, match=r"dead_letter_table: table name 'dead letters'"):
        StreamerOptions(dead_letter_table="dead letters")
    assert sent == []  # not one row was pulled


async def test_a_misnamed_key_fails_the_stream_rather_than_quarantine_every_row(
    cluster: list[Node],
) -> None:
    """Under quarantine, rows without their key are set aside; but when none of the first
    1,000 rows has it, the key is misnamed: the stream fails and says so."""
    import pyarrow as pa

    from deltaflow.client.admission import KEYLESS_LIMIT

    rows = [{"Id": i, "v": i} for i in range(KEYLESS_LIMIT + 500)]
    quarantine = StreamerOptions(on_bad_row="quarantine")
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(rows, table="misnamed", key="id", options=quarantine)
        with pytest.raises(DataStreamerError) as arrow_info:
            await client.stream_data(
                [pa.table({"Id": list(range(2_000))})], table="misnamed", key="id",
                options=quarantine,
            )  # fmt: skip
        # An empty batch without the key quarantines nothing and fails nothing.
        empty = await client.stream_data(
            [pa.table({"Id": pa.array([], pa.int64())}), pa.table({"id": [1]})],
            table="misnamed", key="id", options=quarantine,
        )  # fmt: skip
    said = str(info.value.cause)
    assert f"the first {KEYLESS_LIMIT:,} rows of the stream all lack their key" in said
    assert "is key=['id'] right?" in said
    assert "lacks the key column(s) ['id']" in str(arrow_info.value.cause)
    assert (empty.items_acked, empty.items_quarantined, empty.items_failed) == (1, 0, 0)
