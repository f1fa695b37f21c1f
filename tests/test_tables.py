"""Rows from each source kind into a Delta table through two real nodes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import reactivex

import deltaflow
from deltaflow import Delete, StreamerOptions
from deltaflow.server import Node

from .conftest import read_delta, read_spark, start_cluster


@pytest.fixture(params=["spark", "delta-rs"])
def engine(request: pytest.FixtureRequest) -> str:
    """Every table test runs against both engines: their semantics must be identical."""
    return str(request.param)


OPTIONS = StreamerOptions(page_size=150, per_partition_in_flight=4, auto_flush_interval=0.5)


def workload(n_keys: int = 600, rounds: int = 3) -> list[Any]:
    """Every key written ``rounds`` times, then every 10th deleted, then some re-inserted."""
    items: list[Any] = [
        {"id": k, "name": f"r{r}-k{k}", "value": float(r * n_keys + k)}
        for r in range(rounds)
        for k in range(n_keys)
    ]
    items += [Delete({"id": k}) for k in range(0, n_keys, 10)]
    items += [{"id": k, "name": "back", "value": -1.0} for k in range(0, n_keys, 20)]
    return items


def expected(items: list[Any]) -> dict[int, dict[str, Any]]:
    state: dict[int, dict[str, Any]] = {}
    for item in items:
        if isinstance(item, Delete):
            state.pop(item.item["id"], None)
        else:
            state[item["id"]] = item
    return state


def source_of(kind: str, items: list[Any]) -> Any:
    if kind == "async_iterable":

        async def agen() -> AsyncIterator[Any]:
            for i, item in enumerate(items):
                if i % 100 == 0:
                    await asyncio.sleep(0)
                yield item

        return agen()
    if kind == "iterable":

        def gen() -> Iterator[Any]:
            yield from items

        return gen()
    assert kind == "observable"
    return reactivex.from_iterable(items)


def assert_table(spark: Any, path: Path, want: dict[int, dict[str, Any]]) -> None:
    for reader in (read_delta(path), read_spark(spark, path)):
        assert set(reader) == set(want)
        for k, row in want.items():
            assert reader[k]["name"] == row["name"], k
            assert reader[k]["value"] == row["value"], k


@pytest.mark.parametrize("kind", ["async_iterable", "iterable", "observable"])
async def test_each_source_kind_lands_in_table_with_last_value_and_deletes(
    cluster: list[Node], spark: Any, warehouse: Path, kind: str
) -> None:
    items = workload()
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            source_of(kind, items), table="events", key="id", options=OPTIONS
        )
    assert summary.items_acked == len(items)
    assert summary.items_failed == 0
    # The client routed straight to owners: both nodes applied batches, none was redirected.
    assert set(summary.per_node) == {"node-1", "node-2"}
    assert summary.batches_retried == 0
    assert_table(spark, warehouse / "events", expected(items))


async def test_blocking_facade_has_same_semantics(
    cluster: list[Node], spark: Any, warehouse: Path
) -> None:
    items = workload(n_keys=300, rounds=2)
    acked: list[Any] = []
    summary = await asyncio.to_thread(
        deltaflow.stream_data,
        iter(items),
        nodes=[cluster[1].address],
        table="sync_events",
        key="id",
        on_ack=acked.extend,
        options=OPTIONS,
    )
    assert summary.items_acked == len(items)
    assert sorted(map(repr, acked)) == sorted(map(repr, items))
    assert_table(spark, warehouse / "sync_events", expected(items))


async def test_group_commit_applies_many_batches_per_commit(
    cluster: list[Node], spark: Any, warehouse: Path
) -> None:
    items = workload(n_keys=2000, rounds=2)
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            items, table="grouped", key="id", options=StreamerOptions(page_size=100)
        )
    batches = sum(s.batches_acked for s in summary.per_node.values())
    commits = sum(n.statistics().engine.commits for n in cluster)
    assert batches >= 40
    # A MERGE per batch would make `batches` commits; groups make far fewer.
    assert commits <= batches / 4, (commits, batches)
    assert_table(spark, warehouse / "grouped", expected(items))


async def test_delete_then_reinsert_in_one_batch_keeps_source_order(
    cluster: list[Node], spark: Any, warehouse: Path
) -> None:
    items: list[Any] = [
        {"id": 1, "name": "a", "value": 1.0},
        Delete({"id": 1}),
        {"id": 1, "name": "b", "value": 2.0},
        {"id": 2, "name": "c", "value": 3.0},
        Delete({"id": 2}),
    ]
    async with deltaflow.connect([cluster[0].address]) as client:
        await client.stream_data(items, table="order_t", key="id")
    assert_table(spark, warehouse / "order_t", expected(items))
    assert set(read_delta(warehouse / "order_t")) == {1}


async def test_first_write_takes_every_column_and_a_leading_delete(
    spark: Any, warehouse: Path, engine: str
) -> None:
    # One partition: one batch makes the table. (A column new to an existing table is schema
    # evolution, which is not allowed yet.)
    [node] = await start_cluster(warehouse, count=1, partitions=1, engine=engine)
    items: list[Any] = [
        Delete({"id": 9}),
        {"id": 1, "name": "a"},
        {"id": 2, "name": "b", "value": 2.5},
    ]
    try:
        async with deltaflow.connect([node.address]) as client:
            await client.stream_data(
                items, table="wide", key="id", options=StreamerOptions(auto_flush_interval=0)
            )
    finally:
        await node.stop()
    table = read_delta(warehouse / "wide")
    assert table == {
        1: {"id": 1, "name": "a", "value": None},
        2: {"id": 2, "name": "b", "value": 2.5},
    }


async def test_interleaved_streams_in_one_group_equal_one_by_one_application(
    cluster: list[Node], spark: Any, warehouse: Path
) -> None:
    def stream_items(offset: int) -> list[Any]:
        items: list[Any] = []
        for r in range(4):
            items += [
                {"id": offset + k, "name": f"s{offset}-r{r}", "value": float(r)} for k in range(300)
            ]
            items += [Delete({"id": offset + k}) for k in range(r, 300, 7)]
        return items

    a, b = stream_items(0), stream_items(10_000)
    async with deltaflow.connect([cluster[0].address]) as client:
        await asyncio.gather(
            client.stream_data(a, table="mixed", key="id", options=OPTIONS),
            client.stream_data(b, table="mixed", key="id", options=OPTIONS),
        )
    # Keys of the two streams are disjoint, so applying one stream after the other, item by
    # item, is the reference result.
    assert_table(spark, warehouse / "mixed", expected(a + b))
    grouped = sum(n.statistics().engine.batches_committed for n in cluster)
    commits = sum(n.statistics().engine.commits for n in cluster)
    assert commits < grouped  # batches of both streams shared commits
