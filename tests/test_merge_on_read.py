"""Merge-on-read on tables with deletion vectors: the vectors each engine writes, read by
both Spark and delta-rs; vectors found in a checkpoint or written by another writer; a
bucket kept to a few files; keys without ranges merged instead; two writers' commits racing on
the S3 server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import QueryBuilder

from deltaflow.engines import create_table
from deltaflow.tables.merge_on_read import MERGE_FILES_AT
from deltaflow.testing import at_fault_point

from .support import (
    LOCAL_ENGINES,
    commit_actions,
    creating_engine,
    every_engine,  # noqa: F401 - this module's engine fixture
    open_table,
    read_all,
    read_delta,
    read_spark,
    table_engine,
    upsert,
)


@pytest.mark.parametrize("engine", LOCAL_ENGINES, indirect=True)
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
        engine=creating_engine(engine),
    )
    path = warehouse / "dv"
    assert open_table(path).metadata().configuration["delta.enableDeletionVectors"] == "true"
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "dv", [{"id": i, "name": "a"} for i in range(100)])
        written = {a["path"] for a in commit_actions(path, open_table(path).version())[1]}
        await upsert(eng, "dv", [{"id": 1, "name": "b"}, {"id": 2}], frozenset({1}))
    last = open_table(path)
    if engine.startswith(("spark-sql", "spark-connect")):
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
    table = open_table(path)
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
    live = pa.table(open_table(path).get_add_actions(flatten=True)).column("path").to_pylist()
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
            live = open_table(path).get_add_actions(flatten=True).num_rows
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
    live = pa.table(open_table(path).get_add_actions(flatten=True)).column("path").to_pylist()
    assert len(live) == len(set(live))


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
    reader = QueryBuilder().register("t", open_table(warehouse / "floats"))
    got = {
        r["x"]: r["name"]
        for r in pa.table(reader.execute("SELECT * FROM t").read_all()).to_pylist()
    }
    assert got == {i / 4: "b" for i in range(8) if i != 2}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["delta-rs-s3-dv"])
async def test_merge_on_read_commits_racing_on_a_store_lose_nothing(
    warehouse: Path, engine: str
) -> None:
    """Two nodes commit to one table on the S3 server, where no lock is shared: the second
    commits the version the first planned while the first is between its files and its commit.
    deltaflow writes these log entries itself (delta-rs's transaction API takes no deletion
    vectors) with a create-if-absent put, so the first's commit is refused and made again on
    the next version, and both writes are in the table. A plain put overwrote the second's
    commit, and its acknowledged rows were gone."""
    path = warehouse / "raced"
    loop = asyncio.get_running_loop()
    async with (
        table_engine(engine, warehouse, "t1", table_buckets=0) as first,
        table_engine(engine, warehouse, "t2", table_buckets=0) as second,
    ):
        await upsert(first, "raced", [{"id": i, "name": "a"} for i in range(100)])
        raced: list[str] = []

        def second_commits() -> None:  # on the first's commit thread; once
            if not raced:
                raced.append("t2")
                rows = [{"id": i, "name": "b"} for i in range(10)]
                asyncio.run_coroutine_threadsafe(upsert(second, "raced", rows), loop).result(60)

        with at_fault_point("before_commit", second_commits):
            await upsert(first, "raced", [{"id": i, "name": "c"} for i in range(5, 15)])
        conflicts = first.stats.commit_conflicts
    assert raced == ["t2"]
    want = {i: "a" for i in range(100)} | {i: "b" for i in range(5)}
    want |= {i: "c" for i in range(5, 15)}
    rows = read_all(path)
    assert {r["id"]: r["name"] for r in rows} == want and len(rows) == 100
    assert conflicts == 1
    assert open_table(path).version() == 3  # created, the second's commit, the first's
