"""Client memory is bounded by its options: a full window stops pulling the source."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

import deltaflow
from deltaflow import StreamerOptions
from deltaflow.client.sources import _CHUNK
from deltaflow.partitioning import partition_of
from deltaflow.receivers import Receiver, ReceiverContext

from .support import StartCluster, Within


class Gate(Receiver):
    """Holds every batch until the test opens the gate."""

    opened: ClassVar[asyncio.Event]
    arrived: ClassVar[int] = 0
    arrived_event: ClassVar[asyncio.Event]

    async def receive(self, items: list[Any], ctx: ReceiverContext) -> list[Any]:
        Gate.arrived += 1
        Gate.arrived_event.set()
        await Gate.opened.wait()
        return items


async def test_a_full_window_stops_pulling_an_async_source(
    spark: Any, warehouse: Path, within: Within[Any], start_cluster: StartCluster
) -> None:
    Gate.opened, Gate.arrived_event, Gate.arrived = asyncio.Event(), asyncio.Event(), 0
    nodes = await start_cluster(warehouse, count=1, receivers=["tests.test_backpressure.Gate"])
    pulled = 0

    async def source() -> AsyncIterator[int]:
        nonlocal pulled
        for i in range(10_000):
            pulled += 1
            yield i

    opts = StreamerOptions(page_size=10, max_in_flight=2, per_partition_in_flight=2)
    try:
        async with deltaflow.connect([nodes[0].address]) as client:
            results: list[int] = []
            task = asyncio.create_task(
                client.stream_data(
                    source(),
                    key=lambda i: 0,
                    receiver="tests.test_backpressure.Gate",
                    on_result=results.append,
                    options=opts,
                )
            )
            await within(Gate.arrived_event.wait(), 30, "a batch reached the gate")
            # The stream is stuck behind the gate; give it every chance to over-pull.
            await asyncio.sleep(0.5)
            assert pulled <= opts.max_in_flight * opts.page_size + 1
            Gate.opened.set()
            summary = await within(task, 60, "the stream ended once the gate opened")
    finally:
        await nodes[0].stop()
    assert summary.items_acked == 10_000
    assert sorted(results) == list(range(10_000))


async def test_an_observable_emitting_on_its_own_thread_is_blocked_while_the_window_is_full(
    spark: Any, warehouse: Path, within: Within[Any], start_cluster: StartCluster
) -> None:
    import threading

    import reactivex

    Gate.opened, Gate.arrived_event, Gate.arrived = asyncio.Event(), asyncio.Event(), 0
    nodes = await start_cluster(warehouse, count=1, receivers=["tests.test_backpressure.Gate"])
    emitted = 0
    done = threading.Event()

    def produce(observer: Any, scheduler: Any = None) -> None:
        nonlocal emitted
        for i in range(5_000):
            emitted += 1
            observer.on_next(i)
        observer.on_completed()
        done.set()

    opts = StreamerOptions(page_size=10, max_in_flight=2, source_buffer=20)
    try:
        async with deltaflow.connect([nodes[0].address]) as client:
            task = asyncio.create_task(
                client.stream_data(
                    reactivex.create(produce),
                    key=lambda i: 0,
                    receiver="tests.test_backpressure.Gate",
                    options=opts,
                )
            )
            await within(Gate.arrived_event.wait(), 30, "a batch reached the gate")
            await asyncio.sleep(0.5)
            stats = client.statistics().streams[0]
            assert 1 <= stats.in_flight <= 2 and stats.acked == 0
            # window (2 x 10) + source buffer (20) + the item being pushed
            assert emitted <= 2 * 10 + 20 + 2
            assert not done.is_set()
            Gate.opened.set()
            summary = await within(task, 60, "the stream ended once the gate opened")
    finally:
        await nodes[0].stop()
    assert summary.items_acked == 5_000 and done.is_set()


async def test_an_observable_flooding_the_event_loop_gets_a_clear_overflow_error(
    spark: Any, warehouse: Path, within: Within[Any], start_cluster: StartCluster
) -> None:
    import threading

    import reactivex
    import reactivex.subject

    from deltaflow.client.sources import SourceOverflowError

    [node] = await start_cluster(warehouse, count=1)
    subject: reactivex.subject.Subject[int] = reactivex.subject.Subject()
    subscribed = threading.Event()

    def subscribe(observer: Any, scheduler: Any = None) -> Any:
        disposable = subject.subscribe(observer)
        subscribed.set()
        return disposable

    try:
        async with deltaflow.connect([node.address]) as client:
            task = asyncio.create_task(
                client.stream_data(
                    reactivex.create(subscribe),
                    key=lambda i: i,
                    receiver="deltaflow.testing.Echo",
                    options=StreamerOptions(source_buffer=100),
                )
            )
            assert await asyncio.to_thread(subscribed.wait, 30), "the bridge never subscribed"
            for i in range(1_000):  # on the loop, without yielding
                subject.on_next(i)
            with pytest.raises(deltaflow.DataStreamerError) as info:
                await within(task, 30, "the overflowing stream ended")
    finally:
        await node.stop()
    assert isinstance(info.value.cause, SourceOverflowError)
    assert "more than 100 items on the event loop thread" in str(info.value.cause)


SOURCE = 100_000


async def test_cancelling_a_stream_says_what_was_applied_and_what_is_in_doubt(
    spark: Any, warehouse: Path, within: Within[Any], start_cluster: StartCluster
) -> None:
    Gate.opened, Gate.arrived_event, Gate.arrived = asyncio.Event(), asyncio.Event(), 0
    nodes = await start_cluster(warehouse, count=1, receivers=["tests.test_backpressure.Gate"])
    opts = StreamerOptions(page_size=10, max_in_flight=2)
    taken = 0

    def numbers() -> Iterator[int]:
        nonlocal taken
        for i in range(SOURCE):
            taken += 1
            yield i

    try:
        async with deltaflow.connect([nodes[0].address]) as client:
            task = asyncio.create_task(
                client.stream_data(
                    numbers(),
                    key=lambda i: 0,
                    receiver="tests.test_backpressure.Gate",
                    options=opts,
                )
            )
            await within(Gate.arrived_event.wait(), 30, "a batch reached the gate")
            task.cancel()
            with pytest.raises(asyncio.CancelledError) as info:
                await within(task, 30, "the cancelled stream ended")
            assert repr(client).startswith("<Client open")
    finally:
        Gate.opened.set()
        await nodes[0].stop()
    err = info.value
    assert err.applied == 0
    assert err.in_doubt == list(range(20))  # the two batches the gate holds
    # Everything else taken from the source was never sent.
    assert err.not_applied == list(range(20, taken))
    # Pulled no further than the window and a chunk read ahead of it.
    assert taken <= 30 + 2 * _CHUNK < SOURCE  # in flight, buffered, a chunk taken and one read


async def test_linger_sends_a_trickle_at_once_and_a_busy_source_still_fills_pages(
    cluster: list[Any],
) -> None:
    address = cluster[0].address
    acked = asyncio.Queue[list[Any]]()
    blocking_acked: queue.Queue[list[Any]] = queue.Queue()

    # Each item waits for the previous one's ack: only a send of the partly filled buffer
    # (page 1,000, auto flush after a minute) lets it go on.
    async def trickle(count: int) -> AsyncIterator[dict[str, int]]:
        for i in range(count):
            yield {"i": i}
            assert [x["i"] for x in await acked.get()] == [i]

    def blocking_trickle(count: int) -> Iterator[dict[str, int]]:
        # Read on a worker thread: each item must reach the stream as soon as it is
        # yielded, not once a chunk of them has been read.
        for i in range(count):
            yield {"i": i}
            assert [x["i"] for x in blocking_acked.get(timeout=10)] == [i]

    async with deltaflow.connect([address]) as client:
        options = StreamerOptions(page_size=1000, auto_flush_interval=60, linger=0.02)
        for source, on_ack in (
            (trickle(5), acked.put_nowait),
            (blocking_trickle(5), blocking_acked.put_nowait),
        ):
            async with asyncio.timeout(20):
                summary = await client.stream_data(
                    source,
                    key="i",
                    receiver="deltaflow.testing.Echo",
                    on_ack=on_ack,
                    options=options,
                )
            assert summary.items_acked == 5

        # Without linger the first item sits in its buffer.
        no_linger = StreamerOptions(page_size=1000, auto_flush_interval=60)
        stream = asyncio.create_task(
            client.stream_data(
                trickle(1), key="i", receiver="deltaflow.testing.Echo", options=no_linger
            )
        )
        done, _ = await asyncio.wait({stream}, timeout=0.5)
        assert not done
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stream

        # A source that never stalls fills whole pages, linger or not.
        items = [{"i": i % 7} for i in range(7_000)]  # 7 keys, 1,000 items each
        busy = await client.stream_data(
            items, key="i", receiver="deltaflow.testing.Echo", options=options
        )
    assert busy.items_acked == len(items)
    assert sum(s.batches_acked for s in busy.per_node.values()) == 7


async def test_staggered_pages_cut_each_partitions_first_page_short_then_whole_pages(
    cluster: list[Any],
) -> None:
    """stagger_pages reaches the stream's cutting: partition p's first page holds
    page_size * (p + 1) // n items, then whole pages, and every item is applied once."""
    sizes: list[int] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        n = client.partition_map.partitions
        summary = await client.stream_data(
            list(range(200)),
            key=lambda i: 0,  # one partition: its batches are acknowledged in order
            receiver="deltaflow.testing.Echo",
            on_ack=lambda items: sizes.append(len(items)),
            options=StreamerOptions(page_size=64, per_partition_in_flight=1, stagger_pages=True),
        )
    first = 64 * (partition_of(0, n) + 1) // n
    assert summary.items_acked == 200
    assert sizes[0] == first and sum(sizes) == 200
    assert all(size == 64 for size in sizes[1:-1]) and 0 < sizes[-1] <= 64
