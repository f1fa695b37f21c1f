"""How a group is applied to the table's files: new keys appended, a MERGE that reads only
the files its key ranges can be in, deltaflow's copy-on-write rewrite (``rewrite.py``),
and the engine's MERGE for tables with features the file writers do not handle; every
way keeps exactly-once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import deltaflow
from deltaflow.engines import create_table
from deltaflow.storage.paths import StorePath
from deltaflow.testing import at_fault_point

from .support import (
    MARKS_FOLLOW,
    WRITE_PATHS,
    every_engine,  # noqa: F401 - this module's engine fixture
    open_table,
    read_all,
    read_delta,
    read_spark,
    table_engine,
    upsert,
)


def removes(path: Path, version: int) -> int:
    """How many files a commit removed."""
    lines = (path / "_delta_log" / f"{version:020d}.json").read_text().splitlines()
    return sum("remove" in json.loads(line) for line in lines)


@pytest.mark.parametrize(
    "engine", ["spark", "delta-rs", "spark-dv", "delta-rs-dv", "spark-connect"], indirect=True
)
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


@pytest.mark.parametrize("engine", WRITE_PATHS, indirect=True)
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
        files = pa.table(open_table(path).get_add_actions(flatten=True)).to_pylist()
        # Two ranges, cut at the wide gap: 510-529 and the new key 5000.
        changed = [*range(510, 530), 5000]
        others = [f["path"] for f in files if f["max.id"] < 510 or f["min.id"] > 529]
        assert len(others) >= 9
        hideout = warehouse / "hidden" if isinstance(warehouse, StorePath) else tmp_path
        for name in others:
            (path / name).rename(hideout / name)
        await upsert(eng, "ranged", [{"id": i, "name": "b"} for i in changed])
        for name in others:
            (hideout / name).rename(path / name)
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


@pytest.mark.parametrize("engine", WRITE_PATHS, indirect=True)
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
    last = open_table(path).version()
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
    operations = [h["operation"] for h in reversed(open_table(path).history())]
    # Created, one append (and its marks); the resend committed nothing.
    assert len(operations) == (3 if engine in MARKS_FOLLOW else 2), operations


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
    async with table_engine(engine, warehouse, table_buckets=2, table_bucket_rows=0) as eng:
        for start in range(0, 2000, 200):  # appended: ten files of 200-id ranges per bucket
            await upsert(
                eng, "straddle", [{"id": i, "name": "a"} for i in range(start, start + 200)]
            )
        for start in range(100, 1900, 200):  # each group straddles two of them
            rows = [{"id": i, "name": "b"} for i in range(start, start + 200)]
            await upsert(eng, "straddle", rows, frozenset({0}))  # and deletes its first key
    files = pa.table(open_table(path).get_add_actions(flatten=True))
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
    assert len(open_table(path).history()) == 4
    assert removes(path, 3) == 1
    rows = {r["id"]: (r["name"], r["size"]) for r in read_all(path)}
    assert rows == {i: ("a", None) for i in range(100)} | {3: ("c", 9)}


@pytest.mark.parametrize(
    "engine", ["spark", "spark-sql", "delta-rs", "spark-connect"], indirect=True
)
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
    # Create, append, delete (on the SQL writer the append and the delete each followed by
    # the commit of their marks).
    versions = len(open_table(warehouse / "holes").history())
    assert versions == (5 if engine in MARKS_FOLLOW else 3)
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


@pytest.mark.parametrize("engine", ["spark", "delta-rs", "spark-connect"], indirect=True)
async def test_tables_with_constraints_are_merged_and_keep_them(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """A table with a feature the copy-on-write writer does not enforce (here a CHECK
    constraint) is merged by the engine's MERGE, which does: a row breaking it fails its
    batch."""
    path = warehouse / "checked"
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "checked", [{"id": i, "name": "a"} for i in range(10)])
        open_table(path).alter.add_constraint({"known_name": "name <> 'bad'"})
        await upsert(eng, "checked", [{"id": 1, "name": "b"}])
        assert open_table(path).history(1)[0]["operation"] == "MERGE"
        with pytest.raises(deltaflow.DeltaflowError, match=r"failed validation|violated"):
            await upsert(eng, "checked", [{"id": 2, "name": "bad"}])
    assert {r["id"]: r["name"] for r in read_all(path)} == {i: "a" for i in range(10)} | {1: "b"}
