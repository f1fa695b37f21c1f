"""The guarantees of docs/guarantees.md, each pinned by a test that fails when it breaks:
per-key order over every key, ack only after the commit, the client's frame limit, the hooks'
errors, the dead-letter table, and the node's bounds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

import deltaflow
from deltaflow import DataStreamerError, Delete, StreamerOptions
from deltaflow.client.results import ResultDispatcher
from deltaflow.engines import create_table
from deltaflow.errors import FrameTooLargeError, UsageError
from deltaflow.protocol import WS_PATH, decode_frames, encode_frame, join_items, pack_item
from deltaflow.server import Node
from deltaflow.server.dispatcher import LANE_WINDOW
from deltaflow.testing import RecordOrder, RequestDropper, at_fault_point

from .support import Eventually, StartCluster, holding, read_delta

FAST_RETRY = {"retry_initial_backoff": 0.01, "retry_max_backoff": 0.1}
LOSSY = {**FAST_RETRY, "ack_timeout": 1.0}  # a lost request costs one ack timeout


@pytest.fixture
def engine() -> str:
    return "delta-rs"  # commits in milliseconds: an ack timeout of 1 s is never a commit's


# -- 4. Per-key order, over every key, with pipelining and lost requests ---------------------


async def test_every_key_is_applied_in_source_order_with_pipelined_batches_and_lost_requests(
    cluster: list[Node],
) -> None:
    keys, versions = 60, 12
    items = [[k, v] for v in range(versions) for k in range(keys)]
    RecordOrder.applied = []
    dropper = RequestDropper(every=4)
    options = StreamerOptions(page_size=3, per_partition_in_flight=4, max_in_flight=32, **LOSSY)
    async with deltaflow.connect([cluster[0].address], connection_factory=dropper) as client:
        summary = await client.stream_data(
            items, key=lambda kv: kv[0], receiver="deltaflow.testing.RecordOrder", options=options
        )
    assert dropper.dropped >= 10, "too few requests lost to exercise resends"
    assert summary.items_acked == len(items)
    seen: dict[int, list[int]] = {}
    applied_once: set[tuple[int, int]] = set()
    for k, v in RecordOrder.applied:
        if (k, v) not in applied_once:  # a batch applied again after a lost ack: its first time
            applied_once.add((k, v))
            seen.setdefault(k, []).append(v)
    out_of_order = {k: vs for k, vs in seen.items() if vs != list(range(versions))}
    assert not out_of_order, f"keys applied out of source order: {out_of_order}"
    assert sorted(seen) == list(range(keys))


async def test_every_key_of_a_table_ends_as_its_operations_applied_in_order(
    cluster: list[Node], warehouse: Path
) -> None:
    items: list[Any] = []
    state: dict[int, int] = {}
    for r in range(12):
        for k in range(80):
            op = (k + r) % 3
            if op == 2 and k in state:
                items.append(Delete({"id": k}))
                del state[k]
            else:
                items.append({"id": k, "v": r * 1000 + k})
                state[k] = r * 1000 + k
    dropper = RequestDropper(every=5)
    options = StreamerOptions(page_size=4, per_partition_in_flight=4, **LOSSY)
    async with deltaflow.connect([cluster[1].address], connection_factory=dropper) as client:
        await client.stream_data(items, table="ordered", key="id", options=options)
    assert dropper.dropped > 0
    # Every batch was applied once (the lost requests never reached a node), none skipped.
    assert sum(n.dispatcher.stats.items_applied for n in cluster) == len(items)
    table = {k: row["v"] for k, row in read_delta(warehouse / "ordered").items()}
    wrong = {k: (table.get(k), state.get(k)) for k in set(table) | set(state)}
    wrong = {k: pair for k, pair in wrong.items() if pair[0] != pair[1]}
    assert not wrong, f"(table, expected) differ for keys {wrong}"


# -- 3. Ack only after the commit is durable -------------------------------------------------


class Hold:
    """A fault-point action that holds threads reaching it until released: all of them, or
    only the first ``count``."""

    def __init__(self, count: int | None = None) -> None:
        self.count = count
        self.reached = threading.Semaphore(0)
        self.released = threading.Event()
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if self.count is not None:
                if self.count == 0:
                    return
                self.count -= 1
        self.reached.release()
        assert self.released.wait(30), "a held commit was never released"

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()  # a failed test must not leave a commit thread held

    async def wait_reached(self) -> None:
        got = await asyncio.to_thread(self.reached.acquire, True, 10)
        assert got, "no commit reached the fault point within 10 s"


async def test_no_ack_leaves_while_its_commit_is_held(cluster: list[Node], warehouse: Path) -> None:
    await asyncio.to_thread(
        create_table, warehouse, "held", schema="id:long,v:long", key="id", engine="delta-rs"
    )
    acked_at: list[float] = []
    hold = Hold()  # every commit, on both nodes
    with hold, at_fault_point("prepared", hold):
        async with deltaflow.connect([cluster[0].address]) as client:
            stream = asyncio.create_task(
                client.stream_data(
                    [{"id": i, "v": i} for i in range(200)],
                    table="held",
                    key="id",
                    on_ack=lambda items: acked_at.append(time.monotonic()),
                    options=StreamerOptions(page_size=20),
                )
            )
            await hold.wait_reached()
            # A group was applied, staged and prepared; while its commit is held, no batch
            # of it (nor any staged behind it) may be acknowledged.
            acked = sum(n.dispatcher.stats.batches_acked for n in cluster)
            assert acked == 0, f"{acked} batch(es) acknowledged before their commit was durable"
            released_at = time.monotonic()
            hold.released.set()
            summary = await asyncio.wait_for(stream, 30)
    assert summary.items_acked == 200
    assert acked_at and min(acked_at) >= released_at, "an ack came before the commit"
    assert sorted(read_delta(warehouse / "held")) == list(range(200))


async def test_a_batch_writing_two_tables_is_acked_only_once_both_commits_are_durable(
    cluster: list[Node], warehouse: Path, eventually: Eventually
) -> None:
    names = ["both_a", "both_b"]
    for name in names:
        await asyncio.to_thread(
            create_table, warehouse, name, schema="id:long,v:long", key="id", engine="delta-rs"
        )
    hold = Hold(count=1)  # the first of the two commits
    acked_at: list[float] = []
    with hold, at_fault_point("prepared", hold):
        async with deltaflow.connect([cluster[0].address]) as client:
            stream = asyncio.create_task(
                client.stream_data(
                    [{"id": i, "v": i} for i in range(20)],
                    key=lambda row: 0,  # one lane, one batch
                    receiver="deltaflow.testing.TwoTables",
                    receiver_args={"tables": names},
                    on_ack=lambda items: acked_at.append(time.monotonic()),
                    options=StreamerOptions(page_size=20),
                )
            )
            await hold.wait_reached()
            # The other table's commit lands; the batch still waits for the held one.
            await eventually(
                lambda: sum(n.engine.stats.commits for n in cluster) >= 1,
                "the other table's commit",
            )
            acked = sum(n.dispatcher.stats.batches_acked for n in cluster)
            assert acked == 0, "the batch was acknowledged with one of its two commits held"
            released_at = time.monotonic()
            hold.released.set()
            summary = await asyncio.wait_for(stream, 30)
    assert summary.items_acked == 20
    assert acked_at and min(acked_at) >= released_at
    for name in names:
        assert sorted(read_delta(warehouse / name)) == list(range(20)), name


# -- The client's frame limit ----------------------------------------------------------------


async def test_the_client_refuses_a_frame_over_the_nodes_limit_before_sending_it(
    warehouse: Path,
    start_cluster: StartCluster,
) -> None:
    nodes = await start_cluster(warehouse, count=1, engine="delta-rs", max_frame_bytes=64 * 1024)
    try:
        items = [{"i": i, "blob": b"x" * 1000} for i in range(200)]
        async with deltaflow.connect([nodes[0].address]) as client:
            with pytest.raises(DataStreamerError) as info:
                await client.stream_data(
                    items,
                    key=lambda item: 0,
                    receiver="deltaflow.testing.Echo",
                    options=StreamerOptions(page_size=200, max_batch_bytes=1 << 20, **FAST_RETRY),
                )
            # The frame never left: the connection the node would have closed (1009) is open.
            assert nodes[0].statistics().connections == 1, "the oversize frame was sent"
        err = info.value
        assert isinstance(err.cause, FrameTooLargeError), repr(err.cause)
        assert "exceeds node node-1's limit of 65536 bytes" in str(err.cause)
        assert "lower StreamerOptions.max_batch_bytes" in str(err.cause)
        assert err.failed_items == items
        assert nodes[0].dispatcher.stats.batches_received == 0
    finally:
        await nodes[0].stop()


# -- Hooks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hook", ["on_ack", "on_commit"])
async def test_an_exception_from_a_hook_becomes_the_streams_cause(
    cluster: list[Node], hook: str
) -> None:
    calls: list[Any] = []

    def broken(value: Any) -> None:
        calls.append(value)
        raise RuntimeError(f"{hook} broke")

    items = list(range(100))
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                items,
                key=lambda x: 0,
                receiver="deltaflow.testing.Echo",
                options=StreamerOptions(page_size=10, max_in_flight=1),
                **{hook: broken},
            )
    err = info.value
    assert isinstance(err.cause, RuntimeError) and str(err.cause) == f"{hook} broke"
    assert len(calls) == 1, "the stream went on after its hook raised"
    # The batch whose hook raised was applied; exactly the ones after it were not.
    assert err.failed_items == items[10:]


async def test_on_ack_is_not_called_for_dropped_batches(cluster: list[Node]) -> None:
    acked: list[int] = []
    items = list(range(50))
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            items,
            key=lambda x: x // 10,  # five lanes of one batch each
            receiver="deltaflow.testing.FailOn",
            receiver_args={"fail_on": 23},
            on_ack=acked.extend,
            options=StreamerOptions(page_size=10, on_failure="drop"),
        )
    assert summary.items_failed == 10
    assert sorted(acked) == [x for x in items if not 20 <= x < 30]


# -- The dead-letter table -------------------------------------------------------------------


async def test_dead_letter_rows_carry_their_columns_and_a_bounded_error(
    cluster: list[Node], warehouse: Path
) -> None:
    long_reason = "x" * 5000
    items = [{"id": i, "ok": i != 7} for i in range(10)]
    items[7]["why"] = long_reason
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            [Delete({"id": 3}), *items[1:]],
            key=lambda r: 0,
            receiver="deltaflow.testing.FailOn",
            receiver_args={"fail_on": items[7]},
            options=StreamerOptions(page_size=10, on_failure="fallback"),
            stream_id="dl-cols",
        )
    assert summary.items_dead_lettered == 10
    rows = sorted(
        read_delta(warehouse / "deltaflow_dead_letters", key="position").values(),
        key=lambda r: r["position"],
    )
    assert [r["position"] for r in rows] == list(range(10))
    first = rows[0]
    assert set(first) == {
        "stream_id",
        "position",
        "partition",
        "seq",
        "error_code",
        "error",
        "node",
        "payload",
        "payload_json",
        "deleted",
        "failed_at",
    }
    assert (first["stream_id"], first["seq"], first["error_code"]) == (
        "dl-cols",
        0,
        "RECEIVER_FAILED",
    )
    assert first["node"] in {"node-1", "node-2"}
    assert first["deleted"] is True and msgpack.unpackb(first["payload"]) == {"id": 3}
    assert msgpack.unpackb(rows[7]["payload"]) == items[7]
    assert all(len(r["error"]) == 2000 for r in rows), "the error is cut at 2,000 characters"
    assert json.loads(first["payload_json"]) == {"id": 3}  # readable without msgpack
    assert json.loads(rows[7]["payload_json"]) == items[7]
    assert all(abs(r["failed_at"].timestamp() - time.time()) < 120 for r in rows)


async def test_a_failed_dead_letter_write_fails_the_stream_listing_its_items(
    cluster: list[Node], warehouse: Path
) -> None:
    # A dead-letter table that cannot take dead letters: one of other columns.
    await asyncio.to_thread(create_table, warehouse, "occupied", schema="x:long")
    items = [{"id": i} for i in range(10)]
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                items,
                key=lambda r: 0,
                receiver="deltaflow.testing.FailOn",
                receiver_args={"fail_on": items[4]},
                options=StreamerOptions(
                    page_size=10, on_failure="fallback", dead_letter_table="occupied"
                ),
            )
    err = info.value
    assert err.failed_items == items
    assert all("dead-letter table failed" in f.reason for f in err.failures), err.failures
    assert "SCHEMA_MISMATCH" in str(err.cause) and "stream_id" in str(err.cause)


# -- The node's bounds -----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def raw_stream(address: str, sid: str, receiver: str) -> AsyncIterator[Any]:
    """A WebSocket speaking the protocol by hand, with stream ``sid`` opened."""
    async with aiohttp.ClientSession() as session:
        ws = await session.ws_connect(f"http://{address}{WS_PATH}", max_msg_size=1 << 24)
        hello = {"t": "hello", "v": [1], "caps": ["results"], "client": "raw", "token": None}
        await ws.send_bytes(encode_frame(hello))
        await ws.receive()
        open_frame = {"t": "open", "sid": sid, "receiver": receiver, "key": b"k" * 32}
        await ws.send_bytes(encode_frame(open_frame))
        opened = await ws.receive()
        assert decode_frames(opened.data)[0]["t"] == "opened"
        yield ws
        await ws.send_bytes(encode_frame({"t": "close", "sid": sid}))
        await ws.close()


async def test_a_lane_holds_at_most_its_window_of_waiting_batches(
    cluster: list[Node], eventually: Eventually
) -> None:
    node = cluster[0]
    p = node.partition_map.owners.index(node.node_id)
    async with raw_stream(node.address, "bounded", "deltaflow.testing.Echo") as ws:
        # Batches 1.. wait for batch 0, which never comes; the window ends at 0 + 64.
        for seq in range(1, LANE_WINDOW + 1):
            frame = {"t": "batch", "sid": "bounded", "p": p, "seq": seq, "n": 1, "base": 0}
            await ws.send_bytes(encode_frame({**frame, "items": join_items([pack_item(seq)])}))
        answer = decode_frames((await asyncio.wait_for(ws.receive(), 10)).data)[0]
    assert answer["t"] == "error" and answer["code"] == "BAD_FRAME", answer
    assert answer["seq"] == LANE_WINDOW and answer["retriable"] is False
    assert f"< base + {LANE_WINDOW} (the lane's window)" in answer["msg"]
    # The stream's state, its 63 waiting batches included, is freed by its close.
    await eventually(lambda: node.dispatcher.stats.streams == 0, "stream state freed on close")


async def test_a_streams_state_is_freed_when_it_ends(
    cluster: list[Node], eventually: Eventually
) -> None:
    async with deltaflow.connect([cluster[0].address]) as client:
        await client.stream_data(
            list(range(500)), key=lambda x: x, receiver="deltaflow.testing.Echo"
        )
        await eventually(
            lambda: all(n.dispatcher.stats.streams == 0 for n in cluster), "streams closed"
        )
        assert sum(n.dispatcher.stats.batches_acked for n in cluster) > 0


# -- Usage errors and receivers that cannot start --------------------------------------------


async def test_table_and_receiver_are_exclusive_and_a_table_names_its_key_by_columns(
    cluster: list[Node],
) -> None:
    async with deltaflow.connect([cluster[0].address]) as client:
        for kwargs, message in [
            ({"table": "t", "receiver": "deltaflow.testing.Echo", "key": "id"}, "exactly one"),
            ({"key": "id"}, "exactly one"),
            ({"table": "t", "sequence_by": "lsn"}, "sequence_by orders the changes to a key"),
            ({"table": "t", "key": lambda r: r}, "needs key="),
            ({"table": "t", "key": "id", "sequence_by": "id"}, r"\['id'\] are the key"),
            ({"receiver": "deltaflow.testing.Echo"}, "key= is required"),
        ]:
            with pytest.raises(UsageError, match=message):
                await client.stream_data([{"id": 1}], **kwargs)
        # Nothing was opened on the nodes.
        assert all(n.dispatcher.stats.batches_received == 0 for n in cluster)


async def test_a_receiver_whose_constructor_raises_fails_its_stream_only(
    cluster: list[Node],
) -> None:
    async with deltaflow.connect([cluster[0].address]) as client:
        broken = client.stream_data(
            [{"id": i} for i in range(50)], key="id", receiver="deltaflow.testing.Unconstructible"
        )
        good = client.stream_data(
            list(range(300)), key=lambda x: x, receiver="deltaflow.testing.Echo"
        )
        failed, fine = await asyncio.gather(broken, good, return_exceptions=True)
    assert isinstance(failed, DataStreamerError), repr(failed)
    assert failed.cause is not None and "RECEIVER_FAILED" in str(failed.cause)
    assert "cannot be constructed" in str(failed.cause)
    assert failed.failed_items == [{"id": i} for i in range(50)]
    assert isinstance(fine, deltaflow.StreamSummary) and fine.items_acked == 300


async def test_results_are_replayed_to_a_resend_until_base_passes_their_batch(
    cluster: list[Node],
) -> None:
    node = cluster[0]
    p = node.partition_map.owners.index(node.node_id)

    def batch(seq: int, base: int) -> bytes:
        frame = {"t": "batch", "sid": "kept", "p": p, "seq": seq, "n": 1, "base": base}
        return encode_frame({**frame, "items": join_items([pack_item(f"r{seq}")])})

    async def answers(ws: Any, seq: int) -> list[dict[str, Any]]:
        """The frames answering batch ``seq``: its results, then its ack."""
        got: list[dict[str, Any]] = []
        while not got or got[-1]["t"] != "ack":
            for frame in decode_frames((await asyncio.wait_for(ws.receive(), 10)).data):
                assert frame.get("seq") == seq, frame
                got.append(frame)
        return got

    async with raw_stream(node.address, "kept", "deltaflow.testing.Echo") as ws:
        for seq in range(6):  # the client has none of their acks yet: base stays 0
            await ws.send_bytes(batch(seq, 0))
            assert [f["t"] for f in await answers(ws, seq)] == ["result", "ack"], seq
        # A resend (its ack lost) gets its results again, then its ack.
        await ws.send_bytes(batch(3, 0))
        replay = await answers(ws, 3)
        assert [f["t"] for f in replay] == ["result", "ack"]
        assert replay[0]["values"] == ["r3"] and replay[1]["dup"] is True
        # The client now has the acks of batches 0 to 3: their results are dropped.
        await ws.send_bytes(batch(6, 4))
        assert [f["t"] for f in await answers(ws, 6)] == ["result", "ack"]
        await ws.send_bytes(batch(3, 3))  # a late copy: acknowledged without them
        assert [f["t"] for f in await answers(ws, 3)] == ["ack"]
        await ws.send_bytes(batch(5, 4))
        assert [f["t"] for f in await answers(ws, 5)] == ["result", "ack"]
    assert node.dispatcher.stats.duplicates == 3
    assert node.dispatcher.stats.batches_acked == 7


async def test_a_full_result_buffer_makes_its_reader_wait() -> None:
    release = asyncio.Event()
    delivered: list[int] = []

    async def slow(value: int) -> None:
        await release.wait()
        delivered.append(value)

    results = ResultDispatcher(slow, buffer=3)
    put = asyncio.create_task(results.put(list(range(10))))
    # The subscriber holds one value and the buffer three: the put cannot finish.
    for _ in range(20):
        await asyncio.sleep(0)
    assert not put.done(), "the reader went on while the result buffer was full"
    assert results._queue.qsize() == 3
    release.set()
    await asyncio.wait_for(put, 5)
    await asyncio.wait_for(results.finish(None), 5)
    assert delivered == list(range(10))


async def test_a_group_whose_commit_fails_is_committed_write_by_write(warehouse: Path) -> None:
    from deltaflow.engines.delta_rs import DeltaRsTableEngine
    from deltaflow.errors import SchemaError
    from deltaflow.tables.settings import TableSettings

    engine = DeltaRsTableEngine(warehouse, node_id="t1")
    await engine.start()
    try:
        # Three writes staged before the table exists, to commit as one group; the middle one
        # has a column the table (created meanwhile by another writer) does not allow.
        async with holding(warehouse, "late"):
            writes = [
                await engine.stage("late", ["id"], rows, frozenset())
                for rows in (
                    [{"id": 1}, {"id": 2}],
                    [{"id": 3, "colour": "red"}],
                    [{"id": 4}],
                )
            ]
            import pyarrow as pa

            await asyncio.to_thread(  # blocking, as the engine's own calls are: off the loop
                engine.create,
                "late",
                warehouse / "late",
                pa.schema([("id", pa.int64())]),
                TableSettings(key=("id",), buckets=4),
            )
        outcomes = await asyncio.gather(*writes, return_exceptions=True)
    finally:
        await engine.stop()
    assert outcomes[0] is None and outcomes[2] is None, outcomes
    assert isinstance(outcomes[1], SchemaError) and "colour" in str(outcomes[1])
    assert sorted(read_delta(warehouse / "late")) == [1, 2, 4]
