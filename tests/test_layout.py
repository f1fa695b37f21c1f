"""Bucket levels (``tables/layout.py``): a keyed table's buckets grow with it, so a small
table is a few files, and every key is still found, whatever level its row was written at."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import deltaflow
from deltaflow.engines import create_table
from deltaflow.partitioning import partition_of
from deltaflow.tables import BUCKET_COLUMN
from deltaflow.tables.footprint import Footprint
from deltaflow.tables.layout import Levels

from .support import (
    StartCluster,
    every_engine,  # noqa: F401 - this module's engine fixture
    open_table,
    read_all,
    read_delta,
    read_spark,
    table_engine,
    upsert,
)


def live_files(path: Path) -> Any:
    return pa.table(open_table(path).get_add_actions(flatten=True))


@pytest.mark.parametrize("buckets", [64, 48, 16, 2, 1])
def test_each_level_has_bucket_values_of_its_own_and_a_key_is_found_at_every_level(
    buckets: int,
) -> None:
    levels = Levels(buckets, 100)
    seen: set[int] = set()
    for size in levels.sizes:
        values = set(levels.place(list(range(buckets)), size).to_pylist())
        assert len(values) == size and not values & seen  # no two levels share a value
        assert {levels.size_of(v) for v in values} == {size}
        seen |= values
    for p in range(buckets):
        found = set(levels.candidates([p]))
        assert len(found) == len(levels.sizes)
        assert all(levels.place([p], size)[0].as_py() in found for size in levels.sizes)
    # One bucket until it holds 100 rows, then 2, 4 ..., every bucket from 100 per bucket.
    sizes = [levels.size_for(n) for n in (0, 100, 101, 400, 401)]
    assert sizes == [min(size, buckets) for size in (1, 1, 2, 4, 8)]
    assert levels.size_for(100 * buckets + 1) == buckets


def test_a_merge_names_a_keys_bucket_at_every_level_and_joins_on_the_key_only() -> None:
    """A stored row may be at another level than the group's: the MERGE must not join on the
    bucket, and must name the key's bucket at each level (here 16 buckets: 5 levels)."""
    levels = Levels(16, 100)
    p = partition_of(7, 16)
    group = pa.table({"id": [7], BUCKET_COLUMN: levels.place([p], 1)})
    footprint = Footprint.of(group, ["id"], bucketed=True, levels=levels)
    assert footprint.buckets == (1, 2 + p % 2, 4 + p % 4, 8 + p % 8, 16 + p)
    on = footprint.merge_condition(["id"], lambda c: c, str)
    assert f"t.{BUCKET_COLUMN} = s.{BUCKET_COLUMN}" not in on
    assert f"t.{BUCKET_COLUMN} IN (1, {2 + p % 2}, {4 + p % 4}, {8 + p % 8}, {16 + p})" in on


async def test_a_small_table_written_by_two_nodes_is_a_few_files(
    warehouse: Path, start_cluster: StartCluster
) -> None:
    """300 rows upserted three times by two nodes: with every bucket from the start the table
    is a file or more per bucket; with levels it is the few files of one bucket."""
    await asyncio.to_thread(
        create_table,
        warehouse,
        "fixed",
        schema="id:long,name:string,value:double",
        key="id",
        bucket_rows=0,
    )
    nodes = await start_cluster(warehouse, engine="delta-rs")
    async with deltaflow.connect([nodes[0].address]) as client:
        for round_ in range(3):
            rows = [{"id": k, "name": f"r{round_}", "value": float(k)} for k in range(300)]
            for table in ("fixed", "small"):
                await client.stream_data(rows, table=table, key="id")
    for table in ("fixed", "small"):
        want = {k: "r2" for k in range(300)}
        assert {k: r["name"] for k, r in read_delta(warehouse / table).items()} == want
    fixed, small = live_files(warehouse / "fixed"), live_files(warehouse / "small")
    assert fixed.num_rows >= 40  # 64 buckets, most of them hold one of the 300 keys
    assert small.num_rows <= 4
    assert set(small.column(f"partition.{BUCKET_COLUMN}").to_pylist()) == {1}


@pytest.mark.parametrize("engine", ["delta-rs", "delta-rs-dv", "spark-sql"], indirect=True)
async def test_a_growing_table_finds_every_key_at_any_level(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """Keys written while the table had 1, 2, 4 ... buckets are updated and deleted once it has
    16: every write finds its key's row wherever it is, so the table never holds a key twice,
    and the rows written last are at the top level."""
    rng = random.Random(7)
    want: dict[int, str] = {}
    path = warehouse / "growing"
    levels_seen: set[int] = set()
    async with table_engine(engine, warehouse, table_buckets=16, table_bucket_rows=25) as eng:
        for start in range(0, 400, 50):  # grows through 1, 2, 4, 8 and 16 buckets
            fresh = [{"id": k, "name": f"new{k}"} for k in range(start, start + 50)]
            keys = sorted(want)
            old = [{"id": k, "name": f"upd{start}"} for k in rng.sample(keys, min(20, len(keys)))]
            dead = [{"id": k} for k in rng.sample(keys, min(3, len(keys)))]
            rows = fresh + old + dead
            await upsert(eng, "growing", rows, frozenset(range(len(fresh) + len(old), len(rows))))
            want.update({r["id"]: r["name"] for r in fresh + old})
            for r in dead:
                want.pop(r["id"], None)
            values = live_files(path).column(f"partition.{BUCKET_COLUMN}").to_pylist()
            levels_seen |= {Levels(16, 25).size_of(int(v)) for v in values}
            # read_delta fails on a key held twice.
            assert {k: r["name"] for k, r in read_delta(path).items()} == want
        # (A group prepared before the previous commit landed may skip a level.)
        assert {1, 16} <= levels_seen and len(levels_seen) >= 4
        # Every key written again: each row ends at the top level (values 16 to 31).
        everything = [{"id": k, "name": "last"} for k in sorted(want)]
        await upsert(eng, "growing", everything)
    rows = read_all(path)
    assert {r["id"] for r in rows} == set(want) and {r["name"] for r in rows} == {"last"}
    assert all(r[BUCKET_COLUMN] == 16 + partition_of(r["id"], 16) for r in rows)
    assert set(read_spark(spark, path)) == set(want)
