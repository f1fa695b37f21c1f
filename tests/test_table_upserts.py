"""Rows from each source kind into a Delta table through two real nodes: the last value of
every key, deletes in source order, every column of a first write, and each node writing
only the buckets it owns."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import reactivex

import deltaflow
from deltaflow import Delete, StreamerOptions
from deltaflow.partitioning import partition_of
from deltaflow.server import Node
from deltaflow.tables import BUCKET_COLUMN

from .support import (
    EVERY_ENGINE,
    MARKS_FOLLOW,
    OPTIONS,
    StartCluster,
    assert_table,
    commit_actions,
    every_engine,  # noqa: F401 - this module's engine fixture
    expected,
    open_table,
    read_all,
    read_delta,
    workload,
)


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


#: Every engine takes an iterable; the other kinds differ on the client only (the node sees the
#: same batches), so they run on one engine.
SOURCES = [(e, "iterable") for e in EVERY_ENGINE] + [
    ("delta-rs", "async_iterable"),
    ("delta-rs", "observable"),
]


@pytest.mark.parametrize(("engine", "kind"), SOURCES, indirect=["engine"])
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


@pytest.mark.parametrize("engine", ["delta-rs"], indirect=True)  # a client-side facade
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
    spark: Any, warehouse: Path, engine: str, start_cluster: StartCluster
) -> None:
    # One partition: one batch makes the table. (A column new to an existing table is schema
    # evolution, which such a table does not allow.)
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
    # One partition: one bucket, 1 (level 1 of the layout; its column is the table's last).
    assert table == {
        1: {"id": 1, "name": "a", "value": None, BUCKET_COLUMN: 1},
        2: {"id": 2, "name": "b", "value": 2.5, BUCKET_COLUMN: 1},
    }


async def test_group_touches_only_the_buckets_its_node_owns(
    spark: Any, warehouse: Path, engine: str, start_cluster: StartCluster
) -> None:
    """With every bucket from the start, a commit's files are all in buckets of partitions
    the committing nodes own."""
    await _touches_only_owned_buckets(spark, warehouse, engine, start_cluster, bucket_rows=0)


@pytest.mark.parametrize("engine", ["delta-rs", "delta-rs-s3-dv"], indirect=True)
async def test_a_grown_table_s_groups_touch_only_the_buckets_their_node_owns(
    spark: Any, warehouse: Path, engine: str, start_cluster: StartCluster
) -> None:
    """Once a table whose buckets grow is at its top level (here one row per bucket: from its
    first commit on), its layout is the fixed one: the same holds. (The engines' paths are
    the fixed layout's, which the test above runs on every engine.)"""
    await _touches_only_owned_buckets(spark, warehouse, engine, start_cluster, bucket_rows=1)


async def _touches_only_owned_buckets(
    spark: Any, warehouse: Path, engine: str, start_cluster: StartCluster, *, bucket_rows: int
) -> None:
    cluster = await start_cluster(warehouse, engine=engine, table_bucket_rows=bucket_rows)
    items = [{"id": k, "name": f"r{r}", "value": float(r)} for r in range(2) for k in range(800)]
    async with deltaflow.connect([cluster[0].address]) as client:
        # The second round is written once the first is in the table: at the top level.
        for round_ in (items[:800], items[800:]):
            await client.stream_data(round_, table="owned", key="id", options=OPTIONS)
        owners = client.partition_map.owners
    path = warehouse / "owned"
    rows = read_all(path)
    assert len(rows) == 800
    # The bucket is the partition the client routed the row by (64 buckets, 64 partitions),
    # at the top level (values from 64) of a table whose levels grow.
    top = 64 if bucket_rows else 0
    assert all(r[BUCKET_COLUMN] == top + partition_of(r["id"], 64) for r in rows)
    writers = set()
    grown = False
    for version in range(1, open_table(path).version() + 1):
        nodes, files = commit_actions(path, version)
        if not files and (not nodes or engine in MARKS_FOLLOW):
            # The table's creation (deletion vectors enabled in a commit of its own), or the
            # commit of a SQL MERGE's marks.
            continue
        assert set(nodes) <= {"node-1", "node-2"}
        writers.update(nodes)
        # A version holds the groups of the nodes it names (a committer combines several):
        # every file in it is in a bucket one of them owns.
        values = {int(f["partitionValues"][BUCKET_COLUMN]) for f in files}
        touched = {v - top for v in values if v >= top}  # level 1: the empty table's groups
        assert values and all(owners[b] in nodes for b in touched), (version, nodes, values)
        grown |= bool(touched)
    assert writers == {"node-1", "node-2"}
    assert grown
    assert_table(spark, path, expected(items))
