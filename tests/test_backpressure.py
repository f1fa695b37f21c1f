"""Client memory is bounded by its options: a full window stops pulling the source."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import deltaflow
from deltaflow import StreamerOptions
from deltaflow.receivers import Receiver, ReceiverContext

from .conftest import start_cluster


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


async def test_a_full_window_stops_pulling_an_async_source(spark: Any, warehouse: Path) -> None:
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
            await Gate.arrived_event.wait()
            # The stream is stuck behind the gate; give it every chance to over-pull.
            await asyncio.sleep(0.5)
            assert pulled <= opts.max_in_flight * opts.page_size + 1
            Gate.opened.set()
            summary = await task
    finally:
        await nodes[0].stop()
    assert summary.items_acked == 10_000
    assert sorted(results) == list(range(10_000))
