"""Groups of no rows left, on every write path: a ``sequence_by`` table whose every row was
deleted gets changes older than the deletes (the tombstones drop them all), or changes the
stored rows beat. Such a group is not a MERGE of nothing (its bucket list is empty, and SQL
has no ``IN ()``): it commits its lane marks alone, the stream goes on, and the changes count
as superseded, not failed."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest

import deltaflow
from deltaflow.server import Node
from deltaflow.tables.footprint import Footprint
from deltaflow.tables.settings import BUCKET_COLUMN

from .support import StartCluster, open_table, read_delta, table_engine

#: Every write path: delta-rs's MERGE, merge-on-read (``-dv``), optimistic commits on the S3
#: server, Spark's direct writer (copy-on-write; merge-on-read, where the finding's Spark MERGE
#: of ``IN ()`` came from) and its SQL MERGE.
ENGINES = ("delta-rs", "delta-rs-dv", "delta-rs-s3", "spark", "spark-dv", "spark-sql")


@pytest.fixture(params=ENGINES, name="engine")
def emptied_engine(request: pytest.FixtureRequest) -> str:
    if str(request.param).startswith("spark"):
        request.getfixturevalue("spark")  # the run's one session, started on first use
    return str(request.param)


def change(key: int, lsn: int, v: str = "") -> dict[str, Any]:
    return {"id": key, "lsn": lsn, "v": v}


def table_of(path: Any) -> dict[int, tuple[int, str]]:
    return {k: (r["lsn"], r["v"]) for k, r in read_delta(path).items()}


def last_commit(path: Any) -> tuple[int, str, dict[str, Any], set[str]]:
    """The table's version, its last commit's operation and the lane marks it records, and
    the table's live files."""
    table = open_table(path)
    commit = table.history(1)[0]
    lanes = json.loads(commit["userMetadata"])["deltaflow"]["lanes"]
    files = set(pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist())
    return table.version(), commit["operation"], lanes, files


async def test_changes_older_than_the_deletes_that_emptied_a_table_are_superseded(
    warehouse: Any, engine: str
) -> None:
    path = warehouse / "cdc"
    seq = 0

    async def apply(
        eng: Any, rows: list[dict[str, Any]], deletes: frozenset[int] = frozenset()
    ) -> None:
        nonlocal seq
        seq += 1  # one lane, one batch per group: the commit must record each mark
        staged = await eng.stage(
            "cdc", ["id"], rows, deletes, mark=("s/0", (seq, 0)), sequence=("lsn",)
        )
        await staged

    async with table_engine(engine, warehouse) as eng:
        await apply(eng, [change(k, 10, "a") for k in range(4)])
        await apply(eng, [change(k, 20) for k in range(4)], frozenset(range(4)))
        assert table_of(path) == {}
        version, *_, files = last_commit(path)
        # Older than the deletes, upserts and deletes: every change dropped, yet the group
        # commits its mark, changes no file and runs no MERGE (a Spark job of seconds).
        await apply(eng, [change(0, 15, "old"), change(1, 15, "old"), change(2, 18), change(3, 18)],
                    frozenset({2, 3}))  # fmt: skip
        assert eng.stats.changes_superseded == 4
        landed, operation, lanes, now = last_commit(path)
        assert (landed, lanes, now) == (version + 1, {"s/0": [seq, 0]}, files)
        assert operation != "MERGE"
        # Newer ones are applied; an older one beside them is dropped.
        await apply(eng, [change(0, 25, "new"), change(1, 25, "new"), change(2, 15, "old")])
        assert table_of(path) == {0: (25, "new"), 1: (25, "new")}
        # Older than the stored rows: every row of the group loses to them.
        await apply(eng, [change(0, 5, "late"), change(1, 24, "late")])
        landed, _, lanes, _ = last_commit(path)
        # (The SQL writer's MERGE is followed by its marks' txn actions: two versions.)
        merges = 2 if engine == "spark-sql" else 1
        assert (landed, lanes) == (version + 1 + 2 * merges, {"s/0": [seq, 0]})
    assert table_of(path) == {0: (25, "new"), 1: (25, "new")}


async def test_a_stream_of_superseded_changes_through_two_nodes_goes_on(
    warehouse: Any, start_cluster: StartCluster
) -> None:
    """Through real nodes and the table's committer (two delta-rs nodes): the stream of
    changes older than the table's deletes is acknowledged, item by item, as applied."""
    nodes: list[Node] = await start_cluster(warehouse, engine="delta-rs")
    options = deltaflow.StreamerOptions(page_size=2, auto_flush_interval=0.05)

    async def stream(items: list[Any]) -> Any:
        return await client.stream_data(
            items, table="cdc", key="id", sequence_by="lsn", options=options
        )

    async with deltaflow.connect([n.address for n in nodes]) as client:
        await stream([change(k, 10, "a") for k in range(6)])
        await stream([deltaflow.Delete(change(k, 20)) for k in range(6)])
        late = await stream([change(k, 15, "old") for k in range(6)])
        await stream([change(k, 25, "new") for k in (0, 1)])
    assert (late.items_acked, late.items_failed) == (6, 0)
    superseded = sum(n.statistics().engine.changes_superseded for n in nodes)
    assert superseded == 6
    assert table_of(warehouse / "cdc") == {0: (25, "new"), 1: (25, "new")}


#: How each engine's SQL quotes a column and renders a key (DataFusion, Spark SQL).
DIALECTS: dict[str, tuple[Callable[[str], str], Callable[[Any], str]]] = {
    "delta-rs": (lambda c: f'"{c}"', str),
    "spark-sql": (lambda c: f"`{c}`", str),
}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_merge_condition_of_a_group_of_no_rows_matches_nothing(
    tmp_path: Any, dialect: str, request: pytest.FixtureRequest
) -> None:
    """The ON clause of a footprint without buckets is valid SQL (no ``IN ()``) that matches
    no row: a MERGE deleting what it matches, of the table's own rows, deletes none."""
    from deltalake import DeltaTable, write_deltalake

    path = tmp_path / "t"
    rows = pa.table(
        {"id": pa.array([1, 2], pa.int64()), BUCKET_COLUMN: pa.array([0, 1], pa.int32())}
    )
    write_deltalake(str(path), rows, partition_by=[BUCKET_COLUMN])
    quote, literal = DIALECTS[dialect]
    footprint = Footprint.of(rows.slice(0, 0), ["id"], bucketed=True)
    on = footprint.merge_condition(["id"], quote, literal)
    if dialect == "delta-rs":
        DeltaTable(str(path)).merge(
            rows, on, source_alias="s", target_alias="t"
        ).when_matched_delete().execute()
    else:
        spark = request.getfixturevalue("spark")
        source = spark.createDataFrame(rows.to_pylist(), f"id BIGINT, {BUCKET_COLUMN} INT")
        source.createOrReplaceTempView("rows_of_t")
        spark.sql(
            f"MERGE INTO delta.`{path}` AS t USING rows_of_t AS s ON {on} WHEN MATCHED THEN DELETE"
        )
    assert sorted(read_delta(path)) == [1, 2]
