"""Custom receivers by class name: results back to the caller, failures reported exactly."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import reactivex

import deltaflow
from deltaflow import DataStreamerError, StreamerOptions
from deltaflow.errors import ReceiverError, UnknownReceiverError
from deltaflow.partitioning import partition_of
from deltaflow.server import Node

ONE_BATCH_PER_PARTITION = StreamerOptions(page_size=1000, auto_flush_interval=0)


async def test_results_of_a_registered_receiver_reach_a_callable(cluster: list[Node]) -> None:
    items = list(range(500))
    results: list[Any] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            items, key=lambda x: x, receiver="deltaflow.testing.Echo", on_result=results.append
        )
    assert sorted(results) == items
    assert summary.results == len(items)


async def test_streamed_results_reach_an_async_callable_and_an_observer(
    cluster: list[Node],
) -> None:
    items = [{"n": i} for i in range(300)]
    seen_async: list[Any] = []
    seen_observer: list[Any] = []
    completed = asyncio.Event()

    async def on_result(value: Any) -> None:
        await asyncio.sleep(0)
        seen_async.append(value)

    observer = reactivex.Observer(on_next=seen_observer.append, on_completed=completed.set)
    async with deltaflow.connect([cluster[1].address]) as client:
        await client.stream_data(
            items, key="n", receiver="deltaflow.testing.EchoStream", on_result=on_result
        )
        await client.stream_data(
            items, key="n", receiver="deltaflow.testing.EchoStream", on_result=observer
        )
    key = lambda r: r["n"]  # noqa: E731
    assert sorted(seen_async, key=key) == items
    assert sorted(seen_observer, key=key) == items
    assert completed.is_set()


async def test_a_raising_receiver_fails_the_stream_with_exactly_that_batchs_items(
    cluster: list[Node],
) -> None:
    items = list(range(200))
    bad = 137
    results: list[Any] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        partitions = client.partition_map.partitions
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                items,
                key=lambda x: x,
                receiver="deltaflow.testing.FailOn",
                receiver_args={"fail_on": bad},
                on_result=results.append,
                options=ONE_BATCH_PER_PARTITION,
            )
    bad_batch = [i for i in items if partition_of(i, partitions) == partition_of(bad, partitions)]
    err = info.value
    assert err.failed_items == bad_batch
    assert isinstance(err.cause, ReceiverError)
    assert "ValueError" in str(err.cause) and "injected failure on item 137" in str(err.cause)
    assert err.cause.node in {"node-1", "node-2"}
    # Every other batch was applied and its results came back.
    assert sorted(results) == [i for i in items if i not in bad_batch]


async def test_a_retriable_receiver_error_is_resent_and_succeeds(cluster: list[Node]) -> None:
    from deltaflow.testing import FailOn

    FailOn.raised = 0
    results: list[Any] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            list(range(50)),
            key=lambda x: x,
            receiver="deltaflow.testing.FailOn",
            receiver_args={"fail_on": 7, "retriable": True, "times": 2},
            on_result=results.append,
        )
    assert summary.batches_retried == 2
    assert sorted(results) == list(range(50))


async def test_unknown_receiver_is_a_clear_error_and_other_streams_go_on(
    cluster: list[Node],
) -> None:
    async with deltaflow.connect([cluster[0].address]) as client:
        good = asyncio.create_task(
            client.stream_data(
                list(range(2000)),
                key=lambda x: x,
                receiver="deltaflow.testing.Echo",
                on_result=lambda v: None,
            )
        )
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(["x", "y"], key=lambda x: x, receiver="os.system")
        summary = await good
    cause = info.value.cause
    assert isinstance(cause, UnknownReceiverError)
    assert "'os.system' is not registered" in str(cause)
    assert "--receiver os.system" in str(cause)
    assert sorted(info.value.failed_items) == ["x", "y"]
    assert summary.items_acked == 2000
    # Nothing was imported on the node's behalf.
    assert "os.system" not in cluster[0].registry


async def test_a_custom_receiver_writes_a_table_and_streams_results(
    spark: Any, warehouse: Any
) -> None:
    from deltaflow import Delete

    from .conftest import read_delta, start_cluster

    nodes = await start_cluster(warehouse, receivers=["examples.receivers.EnrichOrders"])
    try:
        orders: list[Any] = [{"id": i, "amount": 10.0 * i} for i in range(100)]
        orders.append(Delete({"id": 5}))
        results: list[Any] = []
        async with deltaflow.connect([nodes[0].address]) as client:
            await client.stream_data(
                orders,
                key="id",
                receiver="examples.receivers.EnrichOrders",
                receiver_args={"vat": 0.5},
                on_result=results.append,
            )
    finally:
        for node in nodes:
            await node.stop()
    assert sorted(r["id"] for r in results) == list(range(100))
    assert {r["id"]: r["gross"] for r in results}[10] == 150.0
    table = read_delta(warehouse / "orders")
    assert set(table) == set(range(100)) - {5}
    assert table[10]["gross"] == 150.0
