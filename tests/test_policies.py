"""What happens to items whose batch fails: fail, fallback (dead-letter table), drop; the
upstream commit position; a subscriber that raises."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from deltalake import DeltaTable

import deltaflow
from deltaflow import CommitPosition, DataStreamerError, StreamerOptions
from deltaflow.client.sources import aiter_source
from deltaflow.server import Node

# One partition, ten items a batch: item 35 fails batch 3 of the only lane.
ONE_LANE = {
    "key": lambda x: 0,
    "receiver": "deltaflow.testing.FailOn",
    "receiver_args": {"fail_on": 35},
}
ITEMS = list(range(100))
BAD_BATCH = list(range(30, 40))


def opts(policy: str) -> StreamerOptions:
    return StreamerOptions(page_size=10, on_failure=policy, retry_initial_backoff=0.01)


async def test_fallback_writes_the_failed_batch_to_the_dead_letter_table_and_goes_on(
    cluster: list[Node], warehouse: Path
) -> None:
    results: list[int] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            ITEMS, on_result=results.append, options=opts("fallback"), **ONE_LANE
        )
    assert summary.items_dead_lettered == 10
    assert summary.items_failed == 0
    # Batches behind the failed one in the same partition were still applied, in order.
    assert results == [i for i in ITEMS if i not in BAD_BATCH]
    rows = DeltaTable(str(warehouse / "deltaflow_dead_letters")).to_pyarrow_table().to_pylist()
    assert sorted(msgpack.unpackb(r["payload"]) for r in rows) == BAD_BATCH
    assert sorted(r["position"] for r in rows) == BAD_BATCH
    assert all(r["stream_id"] == summary.stream_id for r in rows)
    assert all(r["error_code"] == "RECEIVER_FAILED" for r in rows)
    assert all("injected failure on item 35" in r["error"] for r in rows)


async def test_drop_counts_the_failed_batch_and_goes_on(cluster: list[Node]) -> None:
    results: list[int] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            ITEMS, on_result=results.append, options=opts("drop"), **ONE_LANE
        )
    assert summary.items_failed == 10
    assert summary.items_acked == 90
    assert results == [i for i in ITEMS if i not in BAD_BATCH]


async def test_fail_stops_and_reports_the_batch_and_everything_behind_it(
    cluster: list[Node],
) -> None:
    positions: list[CommitPosition] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                ITEMS, on_commit=positions.append, options=opts("fail"), **ONE_LANE
            )
    assert info.value.failed_items == list(range(30, 100))
    # The upstream may commit up to the failed item, never past it.
    assert positions[-1].count == 30 and positions[-1].last == 29


async def test_commit_position_only_moves_over_a_contiguous_settled_prefix(
    cluster: list[Node],
) -> None:
    positions: list[CommitPosition] = []
    acked: set[int] = set()

    def on_ack(items: list[Any]) -> None:
        acked.update(i["n"] for i in items)

    def on_commit(position: CommitPosition) -> None:
        # Everything before the position is acknowledged at the moment it is offered.
        assert acked >= set(range(position.count))
        positions.append(position)

    async with deltaflow.connect([cluster[1].address]) as client:
        await client.stream_data(
            [{"n": i} for i in range(5000)],
            key="n",
            receiver="deltaflow.testing.Echo",
            on_ack=on_ack,
            on_commit=on_commit,
            options=StreamerOptions(page_size=50),
        )
    counts = [p.count for p in positions]
    assert counts == sorted(counts) and counts[-1] == 5000
    assert positions[-1].last == {"n": 4999}
    assert len(positions) > 1


async def test_a_raising_subscriber_fails_the_stream_with_its_error(cluster: list[Node]) -> None:
    seen: list[int] = []

    def on_result(value: int) -> None:
        if len(seen) == 50:
            raise RuntimeError("subscriber gave up")
        seen.append(value)

    taken = 0
    acked: list[int] = []

    def numbers() -> Iterator[int]:
        nonlocal taken
        for i in range(100_000):
            taken += 1
            yield i

    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                numbers(),
                key=lambda x: x,
                receiver="deltaflow.testing.Echo",
                on_result=on_result,
                on_ack=acked.extend,
                options=StreamerOptions(page_size=100, max_in_flight=4),
            )
    assert isinstance(info.value.cause, RuntimeError)
    assert "subscriber gave up" in str(info.value)
    assert len(seen) == 50
    # It stopped pulling early, and every item it took is applied or reported, not both.
    assert taken < 50_000
    failed = info.value.failed_items
    assert sorted(acked + failed) == list(range(taken))
    assert not set(acked) & set(failed)


async def test_the_queue_example_commits_only_the_safe_offset(
    cluster: list[Node], warehouse: Path
) -> None:
    from examples.queue_commit import main

    queue = await main([cluster[0].address], messages=5_000)
    assert queue.committed == 4_999
    assert len(DeltaTable(str(warehouse / "payments")).to_pyarrow_table()) == 1000


async def test_a_failure_while_the_source_is_idle_ends_the_stream(cluster: list[Node]) -> None:
    import asyncio

    async def trickle() -> Any:
        for i in range(10):
            yield i
        await asyncio.Event().wait()  # an idle queue: nothing more for now

    async with deltaflow.connect([cluster[0].address]) as client, asyncio.timeout(60):
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                trickle(),
                key=lambda x: 0,
                receiver="deltaflow.testing.FailOn",
                receiver_args={"fail_on": 3},
                options=StreamerOptions(auto_flush_interval=0.1),
            )
    assert info.value.failed_items == list(range(10))


async def test_items_taken_from_a_blocking_iterator_are_all_accounted_for(
    cluster: list[Node],
) -> None:
    yielded = 0

    def numbers() -> Any:
        nonlocal yielded
        for i in range(10_000):
            yielded += 1
            yield i

    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                numbers(),
                key=lambda x: 0,
                receiver="deltaflow.testing.FailOn",
                receiver_args={"fail_on": 25},
                options=StreamerOptions(page_size=10, max_in_flight=1),
            )
    failed = info.value.failed_items
    # Applied (0-19) + everything else taken from the iterator, even items still in a chunk.
    assert failed == list(range(20, yielded))
    assert yielded < 10_000


async def test_a_stopping_stream_takes_only_the_item_its_blocking_source_is_reading() -> None:
    """The worker reading a blocking iterator cannot be interrupted inside it, but once the
    stream stops it reads no further item: not the rest of a 256-item chunk."""
    release = threading.Event()
    yielded = 0

    def numbers() -> Any:
        nonlocal yielded
        for i in range(1000):
            if i == 1:
                release.wait(timeout=10)  # the worker is inside the iterator when the stop comes
            yielded += 1
            yield i

    items = aiter_source(numbers(), buffer=16)
    assert await anext(items) == 0
    stopping = asyncio.create_task(items.leftovers())  # type: ignore[attr-defined]
    await asyncio.sleep(0)  # leftovers() runs to its first await: the stop is asked
    release.set()
    assert await asyncio.wait_for(stopping, timeout=10) == [1]
    assert yielded == 2


async def test_a_blocking_source_that_raises_reports_exactly_the_items_not_applied(
    cluster: list[Node],
) -> None:
    def rows() -> Any:  # a generator (read on a worker thread) failing mid-chunk
        yield from range(300)
        raise RuntimeError("source broke after 300 items")

    acked: list[int] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                rows(), key=lambda x: x, receiver="deltaflow.testing.Echo", on_ack=acked.extend
            )
    err = info.value
    assert isinstance(err.cause, RuntimeError) and "source broke" in str(err.cause)
    # Every item read before the error is either applied or reported, never lost.
    assert sorted(acked + err.failed_items) == list(range(300))
    assert set(acked).isdisjoint(err.failed_items)


async def test_a_replay_under_the_same_stream_id_dead_letters_its_own_failures(
    cluster: list[Node], warehouse: Path
) -> None:
    options = StreamerOptions(on_failure="fallback", dead_letter_table="replays")
    async with deltaflow.connect([cluster[1].address]) as client:
        for bad in (1, 2):  # two runs of one stream id, each rejecting a different item
            items = [{"id": i, "ok": i != bad} for i in range(5)]
            summary = await client.stream_data(
                items,
                key="id",
                receiver="deltaflow.testing.Validate",
                options=options,
                stream_id="nightly-load",
            )
            assert summary.items_dead_lettered == 1
    rows = DeltaTable(str(warehouse / "replays")).to_pyarrow_table().to_pylist()
    assert sorted(msgpack.unpackb(r["payload"])["id"] for r in rows) == [1, 2]


def test_a_one_column_key_sequence_routes_like_the_column() -> None:
    from deltaflow.client.stream_types import key_function

    row = {"id": 42, "region": "eu"}
    assert key_function(["id"])(row) == key_function("id")(row) == 42  # as the node buckets it
    assert key_function(("region", "id"))(row) == ("eu", 42)


async def test_dead_letters_of_a_stream_that_fails_meanwhile_are_written_and_not_listed(
    cluster: list[Node], warehouse: Path
) -> None:
    """The source fails right after the batch that will be dead-lettered went out: its failure
    arrives while the stream winds down, and starts the dead-letter sender then. Those items
    must still reach the dead-letter table, and not also be reported as failed."""

    def items() -> Iterator[int]:
        yield from range(40)
        raise RuntimeError("the source broke")

    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(items(), options=opts("fallback"), **ONE_LANE)
    assert isinstance(info.value.cause, RuntimeError)
    rows = DeltaTable(str(warehouse / "deltaflow_dead_letters")).to_pyarrow_table().to_pylist()
    assert sorted(msgpack.unpackb(r["payload"]) for r in rows) == BAD_BATCH
    assert not set(info.value.failed_items) & set(BAD_BATCH)
