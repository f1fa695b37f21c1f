"""The table keeps itself in shape: a table's committer compacts its small files between commits
(``tables/commit/compaction.py``), beside writers that keep committing, and loses, doubles or
changes no row."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

import deltaflow
from deltaflow import StreamerOptions
from deltaflow.storage.paths import Location
from deltaflow.tables import maintenance

from .support import Eventually, StartCluster, open_table, read_all, read_delta, read_spark


@pytest.fixture(params=["delta-rs", "delta-rs-dv", "spark", "delta-rs-s3"])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def compactions(nodes: list[Any], table: str) -> int:
    return sum(n.statistics().engine.tables.get(table, _NONE).compactions for n in nodes)


class _None:
    compactions = 0


_NONE: Any = _None()


def live_files(path: Location) -> int:
    return int(open_table(path).get_add_actions(flatten=True).num_rows)


async def test_the_committer_compacts_small_files_beside_three_writers(
    spark: Any,
    warehouse: Location,
    engine: str,
    start_cluster: StartCluster,
    eventually: Eventually,
) -> None:
    """Three nodes; two clients upsert 1,000 keys six times over in small pages into a keyed
    table, and append 3,000 rows into another, while the tables' committer compacts every
    bucket that holds 2 small files. Compactions land during the streams, and afterwards every
    key holds its last value and every appended row is there once, read by deltalake and by
    Spark; the tables end with fewer files than their commits added."""
    nodes = await start_cluster(
        warehouse,
        count=3,
        engine=engine,
        table_buckets=4,
        table_bucket_rows=0,
        compact_min_files=2,
        compact_interval=0.2,
    )
    options = StreamerOptions(page_size=100, auto_flush_interval=0.0)
    keys, rounds = 1000, 6
    upserts = [{"id": i % keys, "v": i // keys} for i in range(keys * rounds)]
    appends = [{"id": i} for i in range(3000)]
    addresses = [n.address for n in nodes]

    async def upsert() -> None:
        async with deltaflow.connect(addresses) as client:
            for r in range(rounds):
                chunk = upserts[r * keys : (r + 1) * keys]
                await client.stream_data(chunk, table="kept", key="id", options=options)

    async def append() -> None:
        async with deltaflow.connect(addresses) as client:
            for r in range(6):
                chunk = appends[r * 500 : (r + 1) * 500]
                await client.stream_data(
                    chunk,
                    key="id",
                    options=options,
                    receiver="deltaflow.testing.AppendRows",
                    receiver_args={"table": "log"},
                )

    await asyncio.gather(upsert(), append())
    await eventually(
        lambda: compactions(nodes, "kept") > 0 and compactions(nodes, "log") > 0,
        "compactions of both tables",
    )
    kept, log = warehouse / "kept", warehouse / "log"
    want = {k: {"id": k, "v": rounds - 1} for k in range(keys)}
    assert {k: {"id": r["id"], "v": r["v"]} for k, r in read_delta(kept).items()} == want
    assert {k: {"id": r["id"], "v": r["v"]} for k, r in read_spark(spark, kept).items()} == want
    ids = Counter(r["id"] for r in _rows(log))
    assert ids == Counter(range(3000)), (
        f"{3000 - len(ids)} rows lost, {sum(ids.values()) - len(ids)} written twice"
    )
    assert len(read_spark(spark, log)) == 3000
    # Each of the append table's commits added a file or more (but the creation's).
    versions = int(open_table(log).version())
    assert live_files(log) < versions, "compaction left as many files as the commits added"
    # What `deltaflow table show` prints as the last compaction.
    last = await asyncio.to_thread(maintenance.last_compaction, warehouse, "log")
    assert last is not None and last["files_removed"] >= 2 and last["files_added"] == 1


def _rows(path: Location) -> list[dict[str, Any]]:
    return read_all(path)  # type: ignore[arg-type]
