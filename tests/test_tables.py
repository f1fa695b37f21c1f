"""Rows from each source kind into a Delta table through two real nodes."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import reactivex
from deltalake import DeltaTable, QueryBuilder

import deltaflow
from deltaflow import Delete, StreamerOptions
from deltaflow.engines import create_table
from deltaflow.errors import SchemaError, ServerError, UsageError
from deltaflow.partitioning import partition_of
from deltaflow.server import Node, NodeConfig
from deltaflow.spark_integration.spark_engine import SparkTableEngine
from deltaflow.tables import BUCKET_COLUMN, maintenance, read_table_settings, staging
from deltaflow.tables.deltars_engine import DeltaRsTableEngine
from deltaflow.tables.engine import TableEngine
from deltaflow.tables.flock import table_lock
from deltaflow.tables.footprint import Footprint
from deltaflow.tables.grouping import last_per_key
from deltaflow.tables.merge_on_read import MERGE_FILES_AT
from deltaflow.tables.settings import TableSettings
from deltaflow.testing import at_fault_point

from .conftest import TEST_SPARK, engine_options, read_delta, read_spark, start_cluster


@pytest.fixture(params=["spark", "spark-sql", "delta-rs", "spark-dv", "delta-rs-dv"])
def engine(request: pytest.FixtureRequest) -> str:
    """Every table test runs against both engines, the Spark engine's two writers, and both
    engines' merge-on-read (tables with deletion vectors): their semantics must be
    identical."""
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
    # One partition: one bucket, 0 (the layout column is the table's last).
    assert table == {
        1: {"id": 1, "name": "a", "value": None, BUCKET_COLUMN: 0},
        2: {"id": 2, "name": "b", "value": 2.5, BUCKET_COLUMN: 0},
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


# --- Table management: layout, explicit creation, schema rules, deletion vectors -------------


@contextlib.asynccontextmanager
async def table_engine(
    engine: str, warehouse: Path, node_id: str = "t1", **kwargs: Any
) -> AsyncIterator[TableEngine]:
    """A node's table engine alone (no server): staging and commits, as a node runs them."""
    eng: TableEngine
    options = engine_options(engine)
    kwargs = {"deletion_vectors": options.get("deletion_vectors", False), **kwargs}
    if options["engine"] == "spark":
        writer = options.get("spark_writer", "direct")
        eng = SparkTableEngine(
            warehouse, node_id=node_id, spark=TEST_SPARK, writer=writer, **kwargs
        )
    else:
        eng = DeltaRsTableEngine(warehouse, node_id=node_id, **kwargs)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


async def upsert(
    eng: TableEngine, table: str, rows: list[Any], deletes: frozenset[int] = frozenset()
) -> None:
    await (await eng.stage(table, ["id"], rows, deletes))


def read_all(path: Path) -> list[dict[str, Any]]:
    """Every row through delta-rs's query engine, which applies deletion vectors (its
    ``to_pyarrow_table`` refuses tables that have them)."""
    reader = QueryBuilder().register("t", DeltaTable(str(path))).execute("SELECT * FROM t")
    return sorted(pa.table(reader.read_all()).to_pylist(), key=lambda r: r["id"])


def commit_actions(path: Path, version: int) -> tuple[str, list[dict[str, Any]]]:
    """The node that made a commit (from its lane marks) and its add and remove actions."""
    node, files = "", []
    for line in (path / "_delta_log" / f"{version:020d}.json").read_text().splitlines():
        action = json.loads(line)
        if "commitInfo" in action:
            meta = action["commitInfo"].get("userMetadata") or "{}"
            node = json.loads(meta).get("deltaflow", {}).get("node", "")
        files += [action[k] for k in ("add", "remove") if k in action]
    return node, files


def removes(path: Path, version: int) -> int:
    """How many files a commit removed."""
    lines = (path / "_delta_log" / f"{version:020d}.json").read_text().splitlines()
    return sum("remove" in json.loads(line) for line in lines)


async def test_explicit_create_stores_schema_layout_and_settings(
    spark: Any, warehouse: Path, engine: str
) -> None:
    settings = await asyncio.to_thread(
        create_table,
        warehouse,
        "people",
        schema="id:long,name:string,score:double",
        key="id",
        buckets=16,
        allow_schema_evolution=True,
        engine=engine_options(engine)["engine"],
        spark=TEST_SPARK,
    )
    assert settings == TableSettings(key=("id",), buckets=16, schema_evolution=True)
    table = DeltaTable(str(warehouse / "people"))
    meta = table.metadata()
    assert meta.partition_columns == [BUCKET_COLUMN]
    assert meta.configuration["deltaflow.key"] == '["id"]'
    assert meta.configuration["deltaflow.buckets"] == "16"
    assert meta.configuration["deltaflow.schemaEvolution"] == "true"
    assert meta.configuration["delta.checkpointInterval"] == "100"
    assert pa.schema(table.schema().to_arrow()).names == ["id", "name", "score", BUCKET_COLUMN]
    assert read_table_settings(warehouse, "people") == settings
    with pytest.raises(UsageError, match="exists already"):
        create_table(warehouse, "people", schema="id:long", key="id")
    with pytest.raises(UsageError, match="not in the schema"):
        create_table(warehouse, "other", schema="id:long", key="uid")
    # Any node writes it with its stored settings, whatever its own defaults.
    async with table_engine(engine, warehouse, table_buckets=0) as eng:
        await upsert(eng, "people", [{"id": i, "name": f"p{i}", "score": 1.0} for i in range(50)])
    rows = read_all(warehouse / "people")
    assert [r["id"] for r in rows] == list(range(50))
    assert all(r[BUCKET_COLUMN] == partition_of(r["id"], 16) for r in rows)


async def test_group_touches_only_the_buckets_its_node_owns(
    cluster: list[Node], spark: Any, warehouse: Path
) -> None:
    items = [{"id": k, "name": f"r{r}", "value": float(r)} for r in range(2) for k in range(800)]
    async with deltaflow.connect([cluster[0].address]) as client:
        await client.stream_data(items, table="owned", key="id", options=OPTIONS)
        owners = client.partition_map.owners
    path = warehouse / "owned"
    rows = read_all(path)
    assert len(rows) == 800
    # The bucket is the partition the client routed the row by (64 buckets, 64 partitions).
    assert all(r[BUCKET_COLUMN] == partition_of(r["id"], 64) for r in rows)
    writers = set()
    for version in range(1, DeltaTable(str(path)).version() + 1):
        node, files = commit_actions(path, version)
        if not files and not node:
            continue  # the table's creation (deletion vectors enabled in a commit of its own)
        assert node in ("node-1", "node-2")
        writers.add(node)
        touched = {int(f["partitionValues"][BUCKET_COLUMN]) for f in files}
        assert touched and all(owners[b] == node for b in touched), (version, node, touched)
    assert writers == {"node-1", "node-2"}
    assert_table(spark, path, expected(items))


async def test_rows_that_do_not_fit_name_item_and_column(
    spark: Any, warehouse: Path, engine: str
) -> None:
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "fit", [{"id": 1, "name": "a", "value": 1.0}])
        for rows, item, column, text in [
            ([{"id": 2, "value": 2.0}, {"id": 3, "value": "x"}], 1, "value", "is double"),
            ([{"id": 2}, {"id": 3, "name": "c", "colour": "red"}], 1, "colour", "allow_schema"),
            ([{"id": 2}, {"name": "no key"}], 1, "id", "no value for key column"),
            ([{"id": 2, BUCKET_COLUMN: 3}], 0, BUCKET_COLUMN, "reserves"),
        ]:
            with pytest.raises(SchemaError, match=text) as info:
                await eng.stage("fit", ["id"], rows, frozenset())
            details = info.value.details
            assert (details["item"], details["column"]) == (item, column)
            assert f"item #{item}" in str(info.value)
        # Rows staged before the table existed are checked against it at commit: here another
        # node creates it (without the column) while this node waits for the lock.
        with table_lock(warehouse, "late"):
            write = await eng.stage("late", ["id"], [{"id": 1, "colour": "red"}], frozenset())
            await asyncio.sleep(0.2)  # the commit is waiting for the lock
            eng.create(
                "late",
                warehouse / "late",
                pa.schema([("id", pa.int64())]),
                TableSettings(key=("id",), buckets=4),
            )
        with pytest.raises(SchemaError, match=r"colour.*allow_schema_evolution"):
            await write
    assert read_all(warehouse / "fit") == [
        {"id": 1, "name": "a", "value": 1.0, BUCKET_COLUMN: partition_of(1, 64)}
    ]
    assert read_all(warehouse / "late") == []


async def test_schema_evolution_only_on_tables_that_allow_it(
    spark: Any, warehouse: Path, engine: str
) -> None:
    await asyncio.to_thread(
        create_table,
        warehouse,
        "evolving",
        schema={"id": "long", "name": "string"},
        key="id",
        allow_schema_evolution=True,
    )
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "evolving", [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}])
        await upsert(eng, "evolving", [{"id": 2, "name": "b2", "size": 7}, {"id": 3, "size": 9}])
        with pytest.raises(SchemaError, match=r"item #0.*'size'.* is long; 'big'") as info:
            await eng.stage("evolving", ["id"], [{"id": 4, "size": "big"}], frozenset())
        assert (info.value.details["item"], info.value.details["column"]) == (0, "size")
        # A table created on first write takes the node's default: no evolution.
        await upsert(eng, "fixed", [{"id": 1, "name": "a"}])
        with pytest.raises(SchemaError, match="does not allow schema evolution"):
            await eng.stage("fixed", ["id"], [{"id": 2, "size": 1}], frozenset())
        # The operator allows it (as the error says): the node sees it at the next write.
        # (With Spark on a table with deletion vectors: delta-rs's way would add a feature
        # Spark cannot read, docs/tables.md.)
        if engine.endswith("-dv"):
            fixed = warehouse / "fixed"
            spark.sql(
                f"ALTER TABLE delta.`{fixed}` SET TBLPROPERTIES ('deltaflow.schemaEvolution' = "
                "'true')"
            )
        else:
            DeltaTable(str(warehouse / "fixed")).alter.set_table_properties(
                {"deltaflow.schemaEvolution": "true"}, raise_if_not_exists=False
            )
        await upsert(eng, "fixed", [{"id": 2, "size": 1}])
        assert eng.stats.columns_added == 2
    rows = {r["id"]: (r["name"], r["size"]) for r in read_all(warehouse / "evolving")}
    assert rows == {1: ("a", None), 2: ("b2", 7), 3: (None, 9)}
    assert read_spark(spark, warehouse / "evolving")[3]["size"] == 9
    assert [(r["id"], r["size"]) for r in read_all(warehouse / "fixed")] == [(1, None), (2, 1)]


async def test_deletion_vectors_per_engine(spark: Any, warehouse: Path, engine: str) -> None:
    # Created by either engine (delta-rs's own way would add a feature Spark cannot read), the
    # table is read by both.
    await asyncio.to_thread(
        create_table,
        warehouse,
        "dv",
        schema="id:long,name:string",
        key="id",
        buckets=2,
        deletion_vectors=True,
        engine="delta-rs" if engine.startswith("delta-rs") else "spark",
        spark=TEST_SPARK,
    )
    path = warehouse / "dv"
    assert DeltaTable(str(path)).metadata().configuration["delta.enableDeletionVectors"] == "true"
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "dv", [{"id": i, "name": "a"} for i in range(100)])
        written = {a["path"] for a in commit_actions(path, DeltaTable(str(path)).version())[1]}
        await upsert(eng, "dv", [{"id": 1, "name": "b"}, {"id": 2}], frozenset({1}))
    last = DeltaTable(str(path))
    if engine == "spark-sql":
        # Spark's MERGE marked the replaced rows instead of rewriting their files.
        metrics = last.history(1)[0]["operationMetrics"]
        assert int(metrics["numTargetDeletionVectorsAdded"]) > 0
        assert int(metrics["numTargetFilesRemoved"]) == 0
    else:  # merge-on-read: the files holding ids 1 and 2 get vectors, one new file holds id 1
        _, actions = commit_actions(path, last.version())
        marked = [a for a in actions if a.get("deletionVector") and "modificationTime" in a]
        assert {a["path"] for a in marked} <= written and marked
        assert sum(a["deletionVector"]["cardinality"] for a in marked) == 2
        new = [a for a in actions if "modificationTime" in a and not a.get("deletionVector")]
        assert [json.loads(a["stats"])["numRecords"] for a in new] == [1]
    want = {i: "a" for i in range(100) if i != 2} | {1: "b"}
    assert {r["id"]: r["name"] for r in read_all(path)} == want
    assert {k: r["name"] for k, r in read_spark(spark, path).items()} == want


@pytest.mark.parametrize("engine", ["spark-dv", "delta-rs-dv"])
async def test_merge_on_read_after_a_restart_from_a_checkpoint(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """A node that starts on a table whose early commits are gone (log clean-up after a
    checkpoint) finds the files' deletion vectors in the checkpoint: the vectors it writes
    replace them, and no file is listed twice."""
    path = warehouse / "restarted"
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "restarted", [{"id": i, "name": "a"} for i in range(100)])
        await upsert(eng, "restarted", [{"id": i, "name": "b"} for i in range(50)])
        await upsert(eng, "restarted", [{"id": 200, "name": "a"}])  # the vectors' commit is gone
    table = DeltaTable(str(path))
    table.create_checkpoint()
    for version in range(table.version()):
        (path / "_delta_log" / f"{version:020d}.json").unlink()
    async with table_engine(engine, warehouse) as eng:  # a new node: nothing in memory
        eng.key_memory_bytes = 1  # and room for one file's keys: the others are read again
        await upsert(eng, "restarted", [{"id": i, "name": "c"} for i in range(25)], frozenset())
        await upsert(eng, "restarted", [{"id": 99}], frozenset({0}))
    want = {i: "c" if i < 25 else "b" if i < 50 else "a" for i in [*range(99), 200]}
    assert {k: r["name"] for k, r in read_delta(path).items()} == want
    assert {k: r["name"] for k, r in read_spark(spark, path).items()} == want
    live = pa.table(DeltaTable(str(path)).get_add_actions(flatten=True)).column("path").to_pylist()
    assert len(live) == len(set(live))


@pytest.mark.parametrize("engine", ["spark-dv", "delta-rs-dv"])
async def test_merge_on_read_keeps_a_bucket_to_a_few_files(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """Each commit adds a file per bucket; merging a size tier once it holds MERGE_FILES_AT
    files keeps the count bounded over a long stream, with every key's last value."""
    path = warehouse / "long"
    want: dict[int, str] = {}
    async with table_engine(engine, warehouse, table_buckets=1) as eng:
        for round_ in range(40):  # 60 of 2,000 keys each: few files ever lose every row
            rows = [{"id": (round_ * 97 + i * 41) % 2000, "name": f"r{round_}"} for i in range(60)]
            await upsert(eng, "long", rows)
            want |= {r["id"]: r["name"] for r in rows}
            live = DeltaTable(str(path)).get_add_actions(flatten=True).num_rows
            assert live < 2 * MERGE_FILES_AT, (round_, live)
    assert {k: r["name"] for k, r in read_delta(path).items()} == want
    assert {k: r["name"] for k, r in read_spark(spark, path).items()} == want


@pytest.mark.parametrize("engine", ["spark-dv", "delta-rs-dv"])
async def test_merge_on_read_sees_a_vector_written_outside_deltaflow(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """Another writer (Spark SQL, not holding deltaflow's lock) marks a row deleted between the
    commit reading the vectors and listing the files: the commit works from one version of
    both, so the outside delete stays and no file is listed twice."""
    path = warehouse / "outside"
    async with table_engine(engine, warehouse, table_buckets=0) as eng:
        await upsert(eng, "outside", [{"id": i, "name": "a"} for i in range(10)])
        deleted: list[int] = []

        def other_writer() -> None:
            if not deleted:
                deleted.append(7)
                spark.sql(f"DELETE FROM delta.`{path}` WHERE id = 7")

        with at_fault_point("before_listing", other_writer):
            await upsert(eng, "outside", [{"id": 2, "name": "b"}])
    assert deleted == [7]
    want = {i: "b" if i == 2 else "a" for i in range(10) if i != 7}
    assert {k: r["name"] for k, r in read_delta(path).items()} == want
    assert {k: r["name"] for k, r in read_spark(spark, path).items()} == want
    live = pa.table(DeltaTable(str(path)).get_add_actions(flatten=True)).column("path").to_pylist()
    assert len(live) == len(set(live))


@pytest.mark.parametrize("engine", ["spark", "delta-rs", "spark-dv", "delta-rs-dv"])
async def test_a_group_prepared_before_another_node_applied_part_of_it_applies_only_the_rest(
    warehouse: Path, engine: str
) -> None:
    """A group is prepared (its rows collapsed and, for merge-on-read, its files written)
    before its node takes the table's lock. Meanwhile the node that took one of its lanes over
    applies that lane's batch and a later one. The commit applies only the group's other
    batch: the lane's later value stays."""
    loop = asyncio.get_running_loop()
    path = warehouse / "handover"
    async with (
        table_engine(engine, warehouse) as first,
        table_engine(engine, warehouse, node_id="t2") as second,
    ):
        await upsert(first, "handover", [{"id": i, "name": "a"} for i in range(10)])

        async def second_applies_the_lane() -> None:
            for seq, name in ((0, "old"), (1, "new")):
                rows = [{"id": 3, "name": name}]
                await (
                    await second.stage(
                        "handover", ["id"], rows, frozenset(), mark=("s/0", (seq, 0))
                    )
                )

        took_over: list[str] = []

        def other_node() -> None:  # on the first engine's commit thread, before its lock
            if not took_over:
                took_over.append("s/0")
                asyncio.run_coroutine_threadsafe(second_applies_the_lane(), loop).result(120)

        running = True  # both writes are held until both are staged: they make one group
        staged = [
            await first.stage(
                "handover", ["id"], rows, frozenset(), mark=(lane, (0, 0)), held=lambda: running
            )
            for lane, rows in (
                ("s/0", [{"id": 3, "name": "old"}]),
                ("s/1", [{"id": 5, "name": "x"}]),
            )
        ]
        with at_fault_point("prepared", other_node):
            running = False
            first.release()
            await asyncio.gather(*staged)
        assert took_over == ["s/0"]
        assert first.stats.batches_deduplicated == 1
    want = {i: "a" for i in range(10)} | {3: "new", 5: "x"}
    assert {k: r["name"] for k, r in read_delta(path).items()} == want


def _listing(files: Any) -> list[dict[str, Any]]:
    return sorted(pa.table(files).to_pylist(), key=lambda row: row["path"])


@pytest.mark.parametrize("engine", ["delta-rs", "delta-rs-dv", "spark-dv"])
async def test_the_live_files_kept_from_new_commits_are_those_delta_rs_lists(
    warehouse: Path, engine: str
) -> None:
    """A node keeps a table's live files up to date from the commits made since it listed
    them, instead of delta-rs's replay of the log at every commit. Through two nodes'
    commits (updates, deletes, tier merges), a column added to the table, and a compaction,
    the listing is the one delta-rs reads afresh: the same files, sizes, row counts, buckets
    and key statistics; a statistic it does not convert exactly (a timestamp's) may only be
    missing, which makes a file a candidate for every key."""
    path = warehouse / "listed"

    def same_as_delta_rs(eng: TableEngine) -> None:
        listed = eng.live_files(path)
        assert listed is not None
        ours, version = listed
        table = DeltaTable(str(path))
        assert version == table.version()
        theirs = _listing(table.get_add_actions(flatten=True))
        assert [r["path"] for r in _listing(ours)] == [r["path"] for r in theirs]
        for mine, real in zip(_listing(ours), theirs, strict=True):
            assert mine.keys() == real.keys()
            for column, value in mine.items():
                if value != real[column]:  # only a statistic not converted may be missing
                    assert value is None and column in ("min.ts", "max.ts"), (column, real)

    moment = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    async with (
        table_engine(engine, warehouse, schema_evolution=True) as first,
        table_engine(engine, warehouse, node_id="t2", schema_evolution=True) as second,
    ):
        for n in range(3 * MERGE_FILES_AT):
            eng = (first, second)[n % 2]
            rows = [{"id": i, "name": f"r{n}", "ts": moment} for i in range(n, n + 40)]
            await upsert(eng, "listed", rows, frozenset(range(0, 40, 9)))
            if n % 4 == 3:
                same_as_delta_rs(eng)
        assert first.log.keeps(path) and second.log.keeps(path)  # not listed afresh
        await upsert(first, "listed", [{"id": 7, "name": "x", "ts": moment, "extra": 1.5}])
        same_as_delta_rs(second)
        await asyncio.to_thread(DeltaTable(str(path)).optimize.compact)
        same_as_delta_rs(first)
        same_as_delta_rs(second)


@pytest.mark.parametrize("engine", ["delta-rs", "delta-rs-dv"])
async def test_a_group_whose_preparation_fails_is_applied_by_its_commit(
    warehouse: Path, engine: str
) -> None:
    """Preparing a group outside the lock (for merge-on-read, writing its files) can fail, on
    a full disk say. The commit then does all of it under the lock, where an error would be
    reported per batch, and the node goes on committing. delta-rs only: the base class runs
    the two stages."""
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "unprepared", [{"id": i, "name": "a"} for i in range(3)])

        def disk_full() -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        with at_fault_point("prepared", disk_full):
            async with asyncio.timeout(60):
                await upsert(eng, "unprepared", [{"id": 1, "name": "b"}])
        await upsert(eng, "unprepared", [{"id": 2, "name": "c"}])
    path = warehouse / "unprepared"
    assert {k: r["name"] for k, r in read_delta(path).items()} == {0: "a", 1: "b", 2: "c"}


@pytest.mark.parametrize("engine", ["spark", "delta-rs", "spark-dv", "delta-rs-dv"])
async def test_a_table_partitioned_by_other_columns_keeps_them(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """A table another program created, partitioned by its own column: deltaflow's file
    writers carry only the bucket partition, so such a table is merged by the engine's MERGE,
    and every row keeps its partition value."""
    path = warehouse / "regions"
    vectors = "true" if engine.endswith("-dv") else "false"
    spark.sql(
        f"CREATE TABLE delta.`{path}` (id BIGINT, name STRING, region STRING) USING delta "
        f"PARTITIONED BY (region) TBLPROPERTIES ('delta.enableDeletionVectors' = '{vectors}')"
    )
    spark.sql(
        f"INSERT INTO delta.`{path}` VALUES "
        + ", ".join(f"({i}, 'a', '{'eu' if i < 5 else 'us'}')" for i in range(10))
    )
    async with table_engine(engine, warehouse) as eng:
        await (
            await eng.stage(
                "regions", ["id"], [{"id": 1, "name": "b", "region": "eu"}], frozenset()
            )
        )
        await (
            await eng.stage(
                "regions", ["id"], [{"id": 20, "name": "c", "region": "us"}], frozenset()
            )
        )
    want = {i: ("b" if i == 1 else "a", "eu" if i < 5 else "us") for i in range(10)}
    want[20] = ("c", "us")
    assert {k: (r["name"], r["region"]) for k, r in read_delta(path).items()} == want
    assert {k: (r["name"], r["region"]) for k, r in read_spark(spark, path).items()} == want


async def test_vacuum_deletes_what_no_version_needs_and_keeps_deletion_vectors(
    spark: Any, warehouse: Path
) -> None:
    """Files of failed commits go; the deletion vector files the log names stay, live ones
    included (delta-rs's own full vacuum deletes those, and the table can no longer be
    read)."""
    path = warehouse / "swept"
    async with table_engine("delta-rs-dv", warehouse, table_buckets=2) as eng:
        for round_ in range(3):
            rows = [{"id": i, "name": f"r{round_}"} for i in range(round_ * 30, 100)]
            await upsert(eng, "swept", rows)
    vectors = {f.name for f in path.glob("deletion_vector_*.bin")}
    assert vectors  # merge-on-read wrote some
    # What a commit that never landed leaves behind: a data file and a vector file.
    (path / "_deltaflow_bucket=0" / "part-00000-failed.snappy.parquet").write_bytes(b"x")
    (path / "deletion_vector_00000000-0000-0000-0000-000000000000.bin").write_bytes(b"\x01")
    week_ago = time.time() - 7 * 86400
    for file in path.rglob("*"):
        if file.is_file() and "_delta_log" not in file.parts:
            os.utime(file, (week_ago, week_ago))
    before = read_delta(path)
    listed = maintenance.vacuum(warehouse, "swept", retention_hours=24, dry_run=True)
    assert sorted(listed) == [
        "_deltaflow_bucket=0/part-00000-failed.snappy.parquet",
        "deletion_vector_00000000-0000-0000-0000-000000000000.bin",
    ]
    assert maintenance.vacuum(warehouse, "swept", retention_hours=24, dry_run=False) == listed
    assert not any((path / name).exists() for name in listed)
    assert {f.name for f in path.glob("deletion_vector_*.bin")} == vectors
    assert read_delta(path) == before
    assert {k: r["name"] for k, r in read_spark(spark, path).items()} == {
        k: r["name"] for k, r in before.items()
    }


async def test_a_merge_reads_only_the_files_its_key_ranges_can_be_in(
    spark: Any, warehouse: Path, engine: str, tmp_path: Path
) -> None:
    """Keys that arrive roughly in order fall in few files: the MERGE names their ranges, so it
    reads those files only, however large the table. Proven by hiding every other file: the
    MERGE would fail if it opened one."""
    path = warehouse / "ranged"
    async with table_engine(engine, warehouse, table_buckets=0) as eng:
        for start in range(0, 1000, 100):  # ten commits, files of disjoint id ranges
            await upsert(eng, "ranged", [{"id": i, "name": "a"} for i in range(start, start + 100)])
        files = pa.table(DeltaTable(str(path)).get_add_actions(flatten=True)).to_pylist()
        # Two ranges, cut at the wide gap: 510-529 and the new key 5000.
        changed = [*range(510, 530), 5000]
        others = [f["path"] for f in files if f["max.id"] < 510 or f["min.id"] > 529]
        assert len(others) >= 9
        for name in others:
            (path / name).rename(tmp_path / name)
        await upsert(eng, "ranged", [{"id": i, "name": "b"} for i in changed])
        for name in others:
            (tmp_path / name).rename(path / name)
        # String keys: their range is quoted into the MERGE, quotes and backslashes included.
        keys = ["it's", "back\\slash", "plain", 'say "hi"']
        await (await eng.stage("named", ["k"], [{"k": k, "v": 1} for k in keys], frozenset()))
        await (await eng.stage("named", ["k"], [{"k": k, "v": 2} for k in keys[:2]], frozenset()))
    rows = {r["id"]: r["name"] for r in read_all(path)}
    assert rows == {i: "b" if i in changed else "a" for i in [*range(1000), 5000]}
    named = read_delta(warehouse / "named", key="k")
    assert {k: r["v"] for k, r in named.items()} == {
        "it's": 2,
        "back\\slash": 2,
        "plain": 1,
        'say "hi"': 1,
    }


async def test_a_group_of_new_keys_is_appended_and_one_with_an_old_key_merged(
    spark: Any, warehouse: Path, engine: str
) -> None:
    path = warehouse / "fresh"
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "fresh", [{"id": i, "name": "a"} for i in range(100)])
        # Only new keys, and a delete of a key the table never held: appended, the delete
        # dropped (it deletes nothing).
        rows = [{"id": i, "name": "b"} for i in range(100, 200)] + [{"id": 7000}]
        await upsert(eng, "fresh", rows, frozenset({100}))
        # One old key among new ones: merged.
        await upsert(eng, "fresh", [{"id": 5, "name": "c"}, {"id": 300, "name": "c"}])
        await upsert(eng, "fresh", [{"id": 6}], frozenset({0}))
    # Appends add files only; a merge (or delta-rs's rewrite, or a merge-on-read's new
    # deletion vectors) replaces the files it changes. The last four commits are the groups'.
    last = DeltaTable(str(path)).version()
    replaced = [removes(path, version) > 0 for version in range(last - 3, last + 1)]
    assert replaced == [False, False, True, True], replaced
    want = {i: "a" for i in range(100)} | {i: "b" for i in range(100, 200)} | {5: "c", 300: "c"}
    del want[6]
    assert {r["id"]: r["name"] for r in read_all(path)} == want
    assert {k: r["name"] for k, r in read_spark(spark, path).items()} == want


async def test_a_resent_group_of_new_keys_is_not_applied_twice(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """The append shortcut keeps exactly-once: a batch sent again after its append landed (a
    crash before the ack, another node taking over) is skipped by its lane mark."""
    rows = [{"id": i, "name": "a"} for i in range(50)]
    for _ in range(2):  # the second engine is a node that got the batch again
        async with table_engine(engine, warehouse) as eng:
            staged = await eng.stage("resent", ["id"], rows, frozenset(), mark=("s/0", (0, 0)))
            await staged
    path = warehouse / "resent"
    assert [r["id"] for r in read_all(path)] == list(range(50))
    operations = [h["operation"] for h in reversed(DeltaTable(str(path)).history())]
    assert len(operations) == 2, operations  # created, one append; the resend committed nothing


#: The engines (and writer) that apply groups by deltaflow's own copy-on-write (rewrite.py).
COPY_ON_WRITE = pytest.mark.parametrize("engine", ["spark", "delta-rs"])


@COPY_ON_WRITE
async def test_rewrites_keep_files_to_their_key_ranges(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """Groups that straddle files (they always do: a group is what arrived meanwhile) must not
    gather the rows they copy. A MERGE writes the rest of every file it touches into its new
    file, so each later group rewrites everything before it: this table would end as one file
    of ~1,000 rows per bucket. deltaflow's copy-on-write (rewrite.py) keeps files to their key
    ranges; Spark's data skipping must still find every row by the statistics it writes."""
    path = warehouse / "straddle"
    async with table_engine(engine, warehouse, table_buckets=2) as eng:
        for start in range(0, 2000, 200):  # appended: ten files of 200-id ranges per bucket
            await upsert(
                eng, "straddle", [{"id": i, "name": "a"} for i in range(start, start + 200)]
            )
        for start in range(100, 1900, 200):  # each group straddles two of them
            rows = [{"id": i, "name": "b"} for i in range(start, start + 200)]
            await upsert(eng, "straddle", rows, frozenset({0}))  # and deletes its first key
    files = pa.table(DeltaTable(str(path)).get_add_actions(flatten=True))
    assert max(files.column("num_records").to_pylist()) <= 200
    deleted = set(range(100, 1900, 200))
    want = {i: "b" if 100 <= i < 1900 else "a" for i in range(2000) if i not in deleted}
    assert {r["id"]: r["name"] for r in read_all(path)} == want
    skipped = spark.read.format("delta").load(str(path)).where("id BETWEEN 650 AND 1020")
    assert {r["id"]: r["name"] for r in skipped.collect()} == {
        k: v for k, v in want.items() if 650 <= k <= 1020
    }


@COPY_ON_WRITE
async def test_rewrite_reads_older_files_and_keeps_exactly_once(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """The copy-on-write reads files written before a column was added (the column is null in
    their kept rows), and its commit carries the lane marks: the same batch sent again to
    another node is skipped."""
    path = warehouse / "grown"
    schema = {"id": "long", "name": "string"}
    await asyncio.to_thread(
        create_table,
        warehouse,
        "grown",
        schema=schema,
        key="id",
        buckets=0,
        allow_schema_evolution=True,
    )
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "grown", [{"id": i, "name": "a"} for i in range(100)])
    update = [{"id": 3, "name": "c", "size": 9}]
    for _ in range(2):  # the second engine is a node that got the batch again
        async with table_engine(engine, warehouse) as eng:
            await (await eng.stage("grown", ["id"], update, frozenset(), mark=("s/0", (0, 0))))
    # create, append, add column, rewrite (one file of 100 rows replaced); no second update.
    assert len(DeltaTable(str(path)).history()) == 4
    assert removes(path, 3) == 1
    rows = {r["id"]: (r["name"], r["size"]) for r in read_all(path)}
    assert rows == {i: ("a", None) for i in range(100)} | {3: ("c", 9)}


@COPY_ON_WRITE
async def test_deletes_of_keys_no_file_holds_still_record_their_marks(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """A group that only deletes keys inside the table's key range that no file holds changes
    no file, yet its commit must land with its lane marks, so the batch sent again (a lost
    ack, another node) is skipped rather than applied after later writes."""
    async with table_engine(engine, warehouse, table_buckets=0) as eng:
        await upsert(eng, "holes", [{"id": i, "name": "a"} for i in range(0, 100, 2)])
        await (await eng.stage("holes", ["id"], [{"id": 51}], frozenset({0}), mark=("s/0", (5, 0))))
    async with table_engine(engine, warehouse, table_buckets=0) as eng:
        await (await eng.stage("holes", ["id"], [{"id": 51}], frozenset({0}), mark=("s/0", (5, 0))))
        assert eng.stats.batches_deduplicated == 1
    assert len(DeltaTable(str(warehouse / "holes")).history()) == 3  # create, append, delete
    assert len(read_all(warehouse / "holes")) == 50


@COPY_ON_WRITE
async def test_a_writer_committing_between_files_and_commit_loses_nothing(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """Another writer (Spark SQL, outside deltaflow and its commit lock) commits after a
    group's files are written and before the commit that adds them: the commit notices the
    table moved and is made again on the new version, and both writes are in the table."""
    path = warehouse / "raced"
    others: list[int] = []

    def other_writer() -> None:
        if not others:  # once: the retried commit must then land
            others.append(500)
            spark.sql(f"INSERT INTO delta.`{path}` VALUES (500, 'other')")

    async with table_engine(engine, warehouse, table_buckets=0) as eng:
        await upsert(eng, "raced", [{"id": i, "name": "a"} for i in range(100)])
        with at_fault_point("before_commit", other_writer):
            await upsert(eng, "raced", [{"id": i, "name": "b"} for i in range(10)])
        if engine in ("spark", "spark-dv", "delta-rs-dv"):  # deltaflow's own commit checks
            assert eng.stats.commit_conflicts == 1
    assert others == [500]
    want = {i: "b" if i < 10 else "a" for i in range(100)} | {500: "other"}
    assert {r["id"]: r["name"] for r in read_all(path)} == want
    assert {k: r["name"] for k, r in read_spark(spark, path).items()} == want


@COPY_ON_WRITE
async def test_tables_with_constraints_are_merged_and_keep_them(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """A table with a feature the copy-on-write writer does not enforce (here a CHECK
    constraint) is merged by the engine's MERGE, which does: a row breaking it fails its
    batch."""
    path = warehouse / "checked"
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "checked", [{"id": i, "name": "a"} for i in range(10)])
        DeltaTable(str(path)).alter.add_constraint({"known_name": "name <> 'bad'"})
        await upsert(eng, "checked", [{"id": 1, "name": "b"}])
        assert DeltaTable(str(path)).history(1)[0]["operation"] == "MERGE"
        with pytest.raises(deltaflow.DeltaflowError, match=r"failed validation|violated"):
            await upsert(eng, "checked", [{"id": 2, "name": "bad"}])
    assert {r["id"]: r["name"] for r in read_all(path)} == {i: "a" for i in range(10)} | {1: "b"}


def test_a_footprint_is_fresh_only_if_no_file_of_its_buckets_can_hold_a_key() -> None:
    files = pa.table(
        {
            "min.id": pa.array([0, None], pa.int64()),
            "max.id": pa.array([10, None], pa.int64()),
            f"partition.{BUCKET_COLUMN}": pa.array([1, 2], pa.int32()),
        }
    )
    assert Footprint((1,), "id", ((20, 30),)).checked_against(files).fresh
    assert not Footprint((1,), "id", ((5, 30),)).checked_against(files).fresh
    # A file without statistics may hold any key of its bucket.
    assert not Footprint((2,), "id", ((20, 30),)).checked_against(files).fresh
    assert (
        not Footprint(None, "id", ((20, 30),))
        .checked_against(files.drop_columns(["partition._deltaflow_bucket"]))
        .fresh
    )
    assert not Footprint(None, "id", ((20, 30),)).checked_against(pa.table({"path": ["x"]})).fresh
    assert (
        Footprint(None, "id", ((1, 2),))
        .checked_against(pa.table({"path": pa.array([], pa.string())}))
        .fresh
    )
    assert not Footprint(None).checked_against(pa.table({"path": pa.array([], pa.string())})).fresh


@pytest.mark.parametrize(
    ("key", "values"),
    [
        (["id"], [3, 1, 3, 2, 1, 3]),  # integers
        (["id"], ["b", "a", "b", "c", "a", "b"]),  # dictionary codes
        (["id"], [1.5, 2.5, 1.5, 0.5, 2.5, 1.5]),  # floats: dictionary codes
        (["id", "region"], [1, 2, 1, 1, 2, 1]),  # composite: the hash aggregation
    ],
)
def test_a_group_keeps_the_last_row_of_each_key_in_order(key: list[str], values: list[Any]) -> None:
    """A group's rows collapse to the last per key, in the order those rows came, across the
    pages (chunks) the group was staged in."""
    rows = [{"id": v, "region": "eu", "seq": i} for i, v in enumerate(values)]
    if key == ["id", "region"]:
        rows[2]["region"] = "us"  # (1, eu) at 0, 3, 5 and (1, us) at 2
    pages = [pa.Table.from_pylist(rows[:2]), pa.Table.from_pylist(rows[2:])]
    group = pa.concat_tables(pages)
    last: dict[Any, int] = {}
    for i, row in enumerate(rows):
        last[repr([row[k] for k in key])] = i
    kept = last_per_key(group, key)
    assert kept.column("seq").to_pylist() == sorted(last.values())


def test_footprint_cuts_integer_keys_at_their_widest_gaps() -> None:
    data = pa.table({"id": [7, 3, 1000, 5, 4, 9_000_000, 1001, 3], "_deltaflow_bucket": [1] * 8})
    footprint = Footprint.of(data, ["id"], bucketed=True, max_ranges=3)
    assert footprint.buckets == (1,)
    assert footprint.ranges == ((3, 7), (1000, 1001), (9_000_000, 9_000_000))
    assert Footprint.of(data, ["id"], bucketed=False, max_ranges=1).ranges == ((3, 9_000_000),)
    # Consecutive keys are never cut apart: one range however many are allowed.
    assert Footprint.of(pa.table({"id": [2, 1, 3]}), ["id"], bucketed=False).ranges == ((1, 3),)
    assert Footprint.of(pa.table({"k": ["b", "a"]}), ["k"], bucketed=False).ranges == (("a", "b"),)
    # Composite and non-orderable keys get no range: the MERGE then names buckets only.
    assert Footprint.of(pa.table({"a": [1], "b": [2]}), ["a", "b"], bucketed=False).ranges == ()
    assert Footprint.of(pa.table({"f": [1.5]}), ["f"], bucketed=False).ranges == ()


async def test_max_group_bytes_bounds_a_group(warehouse: Path) -> None:
    """Engine-independent (the base class cuts groups): delta-rs only, for speed."""
    async with table_engine("delta-rs", warehouse, max_group_bytes=1) as eng:
        futures = [
            await eng.stage("small_groups", ["id"], [{"id": i, "v": 1.0}], frozenset())
            for i in range(4)
        ]
        await asyncio.gather(*futures)
        assert eng.stats.commits == eng.stats.batches_committed == 4
        assert eng.stats.largest_group_rows == 1
    async with table_engine("delta-rs", warehouse) as eng:
        await upsert(eng, "big_groups", [{"id": 0, "v": 0.0}])
        loop = asyncio.get_running_loop()
        waiting = asyncio.Event()
        lock = table_lock(warehouse, "big_groups")
        await asyncio.to_thread(lock.__enter__)  # off the loop: the last commit releases it there
        with contextlib.ExitStack() as held:
            held.push(lock)  # released when the block ends
            held.enter_context(
                at_fault_point("prepared", lambda: loop.call_soon_threadsafe(waiting.set))
            )
            first = await eng.stage("big_groups", ["id"], [{"id": 1, "v": 1.0}], frozenset())
            await waiting.wait()  # its group is prepared, and waits for the lock
            futures = [
                await eng.stage("big_groups", ["id"], [{"id": i, "v": 1.0}], frozenset())
                for i in range(2, 5)
            ]
        await asyncio.gather(first, *futures)
        # A group is taken and prepared before it waits for the lock: everything that queued
        # while another writer held the lock commits as the next group, not one by one.
        assert eng.stats.commits == 3 and eng.stats.largest_group_rows == 3


async def test_a_burst_of_writes_to_an_idle_table_commits_as_one_group(
    warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client flushes a batch per partition at once. The first write queued wakes the idle
    committer, which waits for the writes still being converted rather than committing a
    fragment of the burst while the rest waits a whole commit. delta-rs only: the base class
    forms groups."""
    monkeypatch.setattr(staging, "GATHER_SECONDS", 60.0)  # the bound is not under test
    async with table_engine("delta-rs", warehouse) as eng:
        await upsert(eng, "burst", [{"id": 0, "v": 0.0}])  # the table exists: groups prepare
        commits = eng.stats.commits
        prepared, passed = threading.Event(), threading.Lock()

        def slow_but_first() -> None:  # the first conversion passes; the others take 0.5 s,
            if not passed.acquire(blocking=False):  # or end once a group is prepared
                prepared.wait(timeout=0.5)

        with at_fault_point("converting", slow_but_first), at_fault_point("prepared", prepared.set):
            futures = await asyncio.gather(
                *(eng.stage("burst", ["id"], [{"id": i, "v": 1.0}], frozenset()) for i in (1, 2, 3))
            )
            await asyncio.gather(*futures)
        assert eng.stats.commits - commits == 1
        assert eng.stats.largest_group_rows == 3


async def test_min_commit_interval_spaces_commits_but_a_whole_group_goes_at_once(
    warehouse: Path,
) -> None:
    """A node's commit rate cap: writes queued within the interval after a commit wait and
    commit together; a queue holding a whole group commits without waiting. delta-rs only:
    the base class paces groups."""
    async with table_engine(
        "delta-rs", warehouse, min_commit_interval=60.0, max_group_rows=3
    ) as eng:
        await upsert(eng, "capped", [{"id": 0, "v": 0.0}])  # the first commit does not wait
        commits = eng.stats.commits
        futures = [
            await eng.stage("capped", ["id"], [{"id": i, "v": 1.0}], frozenset()) for i in (1, 2)
        ]
        done, _ = await asyncio.wait(futures, timeout=0.5)  # a commit takes ~10 ms
        assert not done
        async with asyncio.timeout(30):  # half the interval: only a full group gets through
            futures.append(await eng.stage("capped", ["id"], [{"id": 3, "v": 1.0}], frozenset()))
            await asyncio.gather(*futures)
        # Held back until the third made a whole group, then one commit.
        assert eng.stats.commits - commits == 1
        assert eng.stats.largest_group_rows == 3
    # Writes of a receiver still running do not make a whole group until it returns.
    async with table_engine(
        "delta-rs", warehouse, min_commit_interval=60.0, max_group_rows=3
    ) as eng:
        await upsert(eng, "held", [{"id": 0, "v": 0.0}])
        running = True
        held = await eng.stage(
            "held",
            ["id"],
            [{"id": 1, "v": 1.0}, {"id": 2, "v": 1.0}],
            frozenset(),
            held=lambda: running,
        )
        free = await eng.stage("held", ["id"], [{"id": 3, "v": 1.0}], frozenset())
        done, _ = await asyncio.wait({held, free}, timeout=0.5)
        assert not done
        running = False
        eng.release()
        async with asyncio.timeout(30):
            await asyncio.gather(held, free)
    # A group larger than the queue may hold: a full queue goes at once too (staging waits).
    async with table_engine(
        "delta-rs", warehouse, min_commit_interval=60.0, max_group_rows=10, max_queued_rows=2
    ) as eng:
        await upsert(eng, "full_queue", [{"id": 0, "v": 0.0}])
        async with asyncio.timeout(30):
            futures = [
                await eng.stage("full_queue", ["id"], [{"id": i, "v": 1.0}], frozenset())
                for i in (1, 2)
            ]
            await asyncio.gather(*futures)
    async with table_engine("delta-rs", warehouse, min_commit_interval=0.3) as eng:
        await upsert(eng, "spaced", [{"id": 0, "v": 0.0}])
        first = eng._tables["spaced"].queue.last_taken_at
        await upsert(eng, "spaced", [{"id": 1, "v": 1.0}])  # the interval had not passed
        second = eng._tables["spaced"].queue.last_taken_at
        assert first is not None and second is not None and second - first >= 0.3
    assert [r["id"] for r in read_all(warehouse / "capped")] == [0, 1, 2, 3]
    with pytest.raises(UsageError, match="min_commit_interval must be between 0 and 600"):
        NodeConfig(node_id="n", warehouse=warehouse, min_commit_interval=-1)


async def test_a_committer_that_fails_fails_its_group_and_goes_on(warehouse: Path) -> None:
    """An error nothing else handles (standing for a bug) fails the group it took, with the
    table named, instead of leaving its batches waiting for ever; the next group commits."""
    failures = iter([RuntimeError("injected committer bug")])

    def once() -> None:
        error = next(failures, None)
        if error is not None:
            raise error

    async with table_engine("delta-rs", warehouse) as eng:
        with at_fault_point("taken", once):
            async with asyncio.timeout(30):
                doomed = await eng.stage("bug", ["id"], [{"id": 1, "v": 1.0}], frozenset())
                with pytest.raises(ServerError, match="committer of table 'bug' failed"):
                    await doomed
                await upsert(eng, "bug", [{"id": 2, "v": 2.0}])
        assert eng.stats.batches_failed == 1
    assert [r["id"] for r in read_all(warehouse / "bug")] == [2]


async def test_table_cli_creates_and_shows_settings_without_the_bucket_column(
    warehouse: Path,
) -> None:
    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "deltaflow.cli", "table", *args, "--warehouse", str(warehouse)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    out = await asyncio.to_thread(
        cli,
        "create",
        "pairs",
        "--schema",
        "region:string,id:long,note:string",
        "--key",
        "region,id",
    )
    assert "table pairs created: key ['region', 'id'], 64 buckets" in out
    async with table_engine("delta-rs", warehouse) as eng:
        rows = [{"region": "eu", "id": i, "note": "n"} for i in range(5)]
        await (await eng.stage("pairs", ["region", "id"], rows, frozenset()))
    # A composite key is bucketed as the client routes it: by the tuple of its values.
    assert {(r["id"], r[BUCKET_COLUMN]) for r in read_all(warehouse / "pairs")} == {
        (i, partition_of(("eu", i), 64)) for i in range(5)
    }
    shown = await asyncio.to_thread(cli, "show", "--table", "pairs")
    assert "table pairs: 5 rows" in shown
    assert "settings: key ['region', 'id'], 64 buckets, schema evolution off" in shown
    assert "'note': 'n'" in shown and BUCKET_COLUMN not in shown
    assert BUCKET_COLUMN in await asyncio.to_thread(
        cli, "show", "--table", "pairs", "--all-columns"
    )


async def test_a_node_with_a_backlog_does_not_starve_another_on_the_table_lock(
    warehouse: Path,
) -> None:
    """flock is unfair: without the yield, a committer with a backlog re-locks at once after
    every commit and a polling waiter never gets in."""
    busy = DeltaRsTableEngine(warehouse, node_id="busy", max_group_rows=1)
    other = DeltaRsTableEngine(warehouse, node_id="other")
    await busy.start()
    await other.start()
    try:
        await upsert(busy, "shared", [{"id": -1, "v": 0.0}])  # the table exists
        backlog = [
            await busy.stage("shared", ["id"], [{"id": i, "v": 1.0}], frozenset())
            for i in range(30)
        ]  # 30 one-row groups, committed back to back
        await upsert(other, "shared", [{"id": 1000, "v": 2.0}])
        commits_before_other = busy.stats.commits
        await asyncio.gather(*backlog)
    finally:
        await other.stop()
        await busy.stop()
    # The other node got the lock after a commit or two, not after the whole backlog.
    assert commits_before_other <= 5, commits_before_other
    assert len(read_all(warehouse / "shared")) == 32


@pytest.mark.parametrize("engine", ["spark", "delta-rs", "spark-dv", "delta-rs-dv"])
async def test_a_checkpoint_is_written_after_its_commit_outside_the_table_lock(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """A checkpoint costs seconds on a large table (5 s measured, Spark, 2 cores). Written
    inside the commit, as Delta and delta-rs do by default, it held the table's lock, so every
    node's commits to the table, and their acks, waited for it every 100 commits."""
    path = warehouse / "checkpointed"
    loop = asyncio.get_running_loop()
    started, release = asyncio.Event(), threading.Event()

    def blocked() -> None:  # the checkpoint's thread waits here until the test is done
        loop.call_soon_threadsafe(started.set)
        release.wait(timeout=120)

    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "checkpointed", [{"id": 0, "v": 0.0}, {"id": 1, "v": 0.0}])
        due = DeltaTable(str(path)).version() + 2  # after the next two commits: this one,
        await asyncio.to_thread(  # and the write below, due a checkpoint (altered by Spark:
            spark.sql,  # delta-rs would add a table feature Spark cannot read)
            f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.checkpointInterval' = "
            f"'{due}', 'delta.logRetentionDuration' = 'interval 0 seconds')",
        )
        with at_fault_point("checkpointing", blocked):
            try:  # the write is acknowledged while its checkpoint is written
                # An update: with deletion vectors, the checkpoint must carry the vector.
                await asyncio.wait_for(upsert(eng, "checkpointed", [{"id": 1, "v": 1.0}]), 60)
                await asyncio.wait_for(started.wait(), 60)
                checkpoint = path / "_delta_log" / f"{due:020d}.checkpoint.parquet"
                assert not checkpoint.exists()  # not written inside the commit
                lock = table_lock(warehouse, "checkpointed")
                await asyncio.wait_for(asyncio.to_thread(lock.__enter__), 60)
                lock.__exit__(None, None, None)  # the lock was free during the checkpoint
                await asyncio.wait_for(upsert(eng, "checkpointed", [{"id": 2, "v": 2.0}]), 60)
                assert eng.stats.checkpoints == 0
            finally:
                release.set()
    assert eng.stats.checkpoints == 1 and eng.stats.checkpoint_seconds > 0  # stop() waited
    assert checkpoint.is_file()
    assert not (path / "_delta_log" / f"{0:020d}.json").exists()  # expired: cleaned up
    assert DeltaTable(str(path)).version() == due + 1
    # delta-rs writes the checkpoint for either engine; both read the table through it.
    assert [(r["id"], r["v"]) for r in read_all(path)] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert {k: r["v"] for k, r in read_spark(spark, path).items()} == {0: 0.0, 1: 1.0, 2: 2.0}


@pytest.mark.parametrize("engine", ["spark-dv", "delta-rs-dv"])
async def test_a_key_without_ranges_is_merged_on_a_table_with_deletion_vectors(
    warehouse: Path, engine: str
) -> None:
    """A float key has no key ranges, so the commit cannot tell which live files hold its
    keys: the group's files, written before the lock, are left aside and the group merged."""
    async with table_engine(engine, warehouse) as eng:
        for name in ("a", "b"):
            rows = [{"x": i / 4, "name": name} for i in range(8)]
            await (await eng.stage("floats", ["x"], rows, frozenset()))
        rows = [{"x": 0.5, "name": "c"}]
        await (await eng.stage("floats", ["x"], rows, frozenset({0})))
    reader = QueryBuilder().register("t", DeltaTable(str(warehouse / "floats")))
    got = {
        r["x"]: r["name"]
        for r in pa.table(reader.execute("SELECT * FROM t").read_all()).to_pylist()
    }
    assert got == {i / 4: "b" for i in range(8) if i != 2}
