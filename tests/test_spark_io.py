"""Spark as a source and a reader: DataFrames and Structured Streaming through real nodes.

The SparkSession (``spark`` fixture, ``local[2]``) is the source: its Python workers are separate
processes that import deltaflow and stream to nodes on 127.0.0.1. The nodes run the delta-rs
engine, which commits in a fraction of a second, and every table is read back with the
``deltalake`` package, independently of Spark.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import decimal
import json
import os
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from deltaflow import StreamerOptions
from deltaflow.errors import UsageError
from deltaflow.server import Node
from deltaflow.spark_integration import (
    DataFrameStreamError,
    foreach_batch,
    read_dead_letters,
    read_table,
    stream_dataframe,
)
from deltaflow.tables import BUCKET_COLUMN
from deltaflow.testing import KillOnKey

from .support import StartCluster, open_table, read_delta

pytestmark = pytest.mark.slow

UTC = datetime.UTC


@pytest.fixture
def engine() -> str:
    return "delta-rs"


@pytest.fixture
async def four_partition_cluster(
    spark: Any, warehouse: Path, start_cluster: StartCluster
) -> AsyncIterator[list[Node]]:
    """Two nodes with 4 deltaflow partitions: few lanes, so small batches fill quickly."""
    nodes = await start_cluster(warehouse, engine="delta-rs", partitions=4)
    yield nodes
    for node in reversed(nodes):
        await node.stop()


@pytest.fixture
def worker_timezone(spark: Any) -> Iterator[str]:
    """Spark's Python workers run in America/New_York (the driver and the session are UTC)."""
    env = spark.sparkContext.environment
    env["TZ"] = "America/New_York"
    try:
        yield env["TZ"]
    finally:
        del env["TZ"]


def _addresses(nodes: list[Node]) -> list[str]:
    return [n.address for n in nodes]


def _read_rows(warehouse: Path, table: str) -> dict[Any, dict[str, Any]]:
    """The keyed table as {id: row} through delta-rs, without deltaflow's layout column."""
    rows = read_delta(warehouse / table)
    for row in rows.values():
        row.pop(BUCKET_COLUMN, None)
    return rows


def _rows_appended(warehouse: Path, table: str) -> list[dict[str, Any]]:
    from deltalake import DeltaTable

    rows: list[dict[str, Any]] = DeltaTable(str(warehouse / table)).to_pyarrow_table().to_pylist()
    return rows


async def test_dataframe_of_60k_rows_in_4_partitions_lands_in_a_table(
    spark: Any, cluster: list[Node], warehouse: Path
) -> None:
    from pyspark.sql import functions as F

    n = 60_000
    df = spark.range(n, numPartitions=4).select(
        F.col("id"),
        (F.col("id") % 97).alias("bucket"),
        F.concat(F.lit("row-"), F.col("id").cast("string")).alias("name"),
        (F.col("id") * 0.5).alias("score"),
        F.timestamp_seconds(F.col("id") + 1_700_000_000).alias("at"),
    )
    assert df.rdd.getNumPartitions() == 4

    summary = await asyncio.to_thread(
        stream_dataframe,
        df,
        nodes=[cluster[0].address],  # the executors learn the other node from this one
        table="events",
        key="id",
        stream_id="load-1",
    )

    assert summary.stream_id == "load-1"
    assert summary.partitions == 4
    assert summary.items_sent == summary.items_applied == n
    assert summary.items_failed == summary.items_dead_lettered == 0
    # 4 Spark partitions x 64 deltaflow partitions, cut at page_size 1000 or at the end.
    assert n // 1000 <= summary.batches <= n // 1000 + 4 * 64
    assert summary.seconds > 0 and summary.rows_per_second > 0
    # Both nodes applied batches: the executors routed by partition, not through one node.
    assert all(node.statistics().engine.rows_committed > 0 for node in cluster)

    table = _read_rows(warehouse, "events")
    assert len(table) == n
    assert set(table) == set(range(n))
    for i in (0, 1, 14_999, 15_000, 37_457, n - 1):  # partition edges, and one inside
        assert table[i] == {
            "id": i,
            "bucket": i % 97,
            "name": f"row-{i}",
            "score": i * 0.5,
            "at": datetime.datetime.fromtimestamp(1_700_000_000 + i, UTC),
        }


async def test_rows_become_wire_values_and_timestamps_keep_their_instant(
    spark: Any, cluster: list[Node], warehouse: Path, worker_timezone: str
) -> None:
    from pyspark.sql import functions as F

    # 05:30Z and 06:30Z on 2023-11-05 are both 01:30 in New York (clocks went back at 06:00Z):
    # PySpark gives the workers the same naive local time for both.
    first, second = 1_699_162_200, 1_699_165_800
    df = spark.range(4, numPartitions=2).select(
        F.col("id"),
        F.timestamp_seconds(F.when(F.col("id") % 2 == 0, first).otherwise(second)).alias("at"),
        F.lit("2024-03-10 02:30:00").cast("timestamp_ntz").alias("wall"),
        F.struct(
            (F.col("id") * 1.5).alias("x"), F.timestamp_seconds(F.lit(first)).alias("seen")
        ).alias("point"),
        F.array(F.lit("a"), F.col("id").cast("string")).alias("tags"),
        F.concat(F.lit("note-"), F.col("id").cast("string")).alias("note"),
        F.col("id").cast("string").cast("binary").alias("blob"),
        (F.col("id") * 100 + 5).cast("decimal(10,2)").alias("amount"),
        F.date_add(F.lit("1500-02-28").cast("date"), F.col("id").cast("int")).alias("day"),
    )

    summary = await asyncio.to_thread(
        stream_dataframe, df, nodes=_addresses(cluster), table="typed", key="id", stream_id="t1"
    )
    assert summary.items_applied == 4
    # Run again under the same stream id (a Spark task retry, or a rerun of the job): every
    # batch is cut the same way and its lane mark is already in the table, so none is written.
    deduplicated = sum(node.statistics().engine.batches_deduplicated for node in cluster)
    again = await asyncio.to_thread(
        stream_dataframe, df, nodes=_addresses(cluster), table="typed", key="id", stream_id="t1"
    )
    assert again.items_applied == 4
    assert (
        sum(node.statistics().engine.batches_deduplicated for node in cluster) - deduplicated
        == again.batches
        == summary.batches
    )
    # Nulls travel as nulls (into a table that exists: a first write needs a typed value).
    await asyncio.to_thread(
        stream_dataframe,
        df.where("id = 0").withColumn("note", F.lit(None).cast("string")),
        nodes=_addresses(cluster),
        table="typed",
        key="id",
    )

    # The table's columns are the DataFrame's types, exactly (its rows travel as Arrow).
    import pyarrow as pa

    types = {f.name: f.type for f in pa.schema(open_table(warehouse / "typed").schema().to_arrow())}
    assert types["amount"] == pa.decimal128(10, 2)
    assert (types["day"], types["wall"]) == (pa.date32(), pa.timestamp("us"))
    table = _read_rows(warehouse, "typed")
    for i in range(4):
        expected_at = datetime.datetime.fromtimestamp(first if i % 2 == 0 else second, UTC)
        assert table[i] == {
            "id": i,
            "at": expected_at,
            "wall": datetime.datetime(2024, 3, 10, 2, 30),  # wall-clock time: timestamp_ntz
            "point": {"x": i * 1.5, "seen": datetime.datetime.fromtimestamp(first, UTC)},
            "tags": ["a", str(i)],
            "note": f"note-{i}" if i > 0 else None,
            "blob": str(i).encode(),
            "amount": decimal.Decimal(f"{i * 100 + 5}.00"),
            "day": datetime.date(1500, 2, 28) + datetime.timedelta(days=i),
        }


async def test_a_replay_under_the_same_client_stream_id_appends_nothing_twice(
    cluster: list[Node], warehouse: Path
) -> None:
    import deltaflow

    rows = [{"id": i, "n": i % 5} for i in range(500)]
    options = StreamerOptions(page_size=20, auto_flush_interval=0)
    append = {"receiver": "deltaflow.testing.AppendRows", "receiver_args": {"table": "log"}}
    async with deltaflow.connect(_addresses(cluster)) as client:
        first = await client.stream_data(
            rows, key="id", options=options, stream_id="replay-1", **append
        )
        assert first.stream_id == "replay-1"
        await client.stream_data(rows, key="id", options=options, stream_id="replay-1", **append)
        assert Counter(r["id"] for r in _rows_appended(warehouse, "log")) == Counter(range(500))
        # A new id is a new stream: the same rows are appended again.
        await client.stream_data(rows, key="id", options=options, stream_id="replay-2", **append)
        assert Counter(r["id"] for r in _rows_appended(warehouse, "log")) == Counter(
            {i: 2 for i in range(500)}
        )
        for bad in ("", "a b", "x" * 129, "s/1"):
            with pytest.raises(UsageError, match="stream_id="):
                await client.stream_data(rows, key="id", stream_id=bad, **append)
        # Staggered pages are cut by the items and their order alone: a replay cuts the same
        # batches, so its marks still match and nothing is appended twice.
        staggered = dataclasses.replace(options, stagger_pages=True)
        for _ in range(2):
            await client.stream_data(
                rows, key="id", options=staggered, stream_id="replay-3", **append
            )
        assert Counter(r["id"] for r in _rows_appended(warehouse, "log")) == Counter(
            {i: 3 for i in range(500)}
        )


def test_columns_the_wire_cannot_carry_are_rejected_before_any_job(
    spark: Any, warehouse: Path
) -> None:
    from pyspark.sql import functions as F

    df = spark.range(3).select(
        F.col("id"),
        F.lit(None).alias("nothing"),
        F.struct(F.expr("INTERVAL 3 DAYS").alias("wait")).alias("meta"),
    )
    with pytest.raises(UsageError) as err:
        stream_dataframe(df, nodes=["127.0.0.1:1"], table="t", key="id")
    message = str(err.value)
    assert "'nothing' is void" in message and "cast to the intended type" in message
    assert "'meta.wait' is interval" in message
    assert not warehouse.exists()

    twice = spark.range(3).select(F.col("id"), F.col("id").alias("x"), F.col("id").alias("x"))
    with pytest.raises(UsageError, match=r"duplicate column names \['x'\]"):
        stream_dataframe(twice, nodes=["127.0.0.1:1"], table="t", key="id")
    with pytest.raises(UsageError, match="stream_id='a/b' is not allowed"):
        stream_dataframe(
            spark.range(1), nodes=["127.0.0.1:1"], table="t", key="id", stream_id="a/b"
        )
    # A stream key goes with a caller's id, and is checked once, on the driver.
    with pytest.raises(UsageError, match="stream_key= goes with stream_id="):
        stream_dataframe(
            spark.range(1), nodes=["127.0.0.1:1"], table="t", key="id", stream_key="k" * 16
        )
    with pytest.raises(UsageError, match="stream_key= has 5 bytes"):
        stream_dataframe(
            spark.range(1),
            nodes=["127.0.0.1:1"],
            table="t",
            key="id",
            stream_id="s",
            stream_key="short",
        )
    with pytest.raises(UsageError, match="stream_key= has 5 bytes"):
        foreach_batch(
            nodes=["127.0.0.1:1"], query_name="q", table="t", key="id", stream_key="short"
        )
    with pytest.raises(UsageError, match="query_name='my query' is not allowed"):
        foreach_batch(nodes=["127.0.0.1:1"], query_name="my query", table="t", key="id")
    with pytest.raises(UsageError, match="needs key="):
        foreach_batch(nodes=["127.0.0.1:1"], query_name="q", table="t", key=lambda r: r)
    with pytest.raises(UsageError, match="foreachBatch"):
        stream_dataframe(
            spark.readStream.format("rate").load(), nodes=["127.0.0.1:1"], table="t", key="value"
        )
    with pytest.raises(UsageError, match="must look like 'host:port'"):
        stream_dataframe(spark.range(1), nodes=["localhost"], table="t", key="id")
    with pytest.raises(UsageError, match=r"warehouse directory .* does not exist"):
        read_table(spark, warehouse, "events")
    with pytest.raises(UsageError, match="not allowed"):
        read_table(spark, warehouse, "../events")


async def test_failed_rows_are_counted_per_partition_or_dead_lettered_and_read_back(
    spark: Any, cluster: list[Node], warehouse: Path
) -> None:
    from pyspark.sql import functions as F

    with pytest.raises(UsageError, match="no deltaflow table 'orders'") as err:
        await asyncio.to_thread(read_table, spark, warehouse, "orders")
    assert str(warehouse / "orders") in str(err.value)
    assert f"tables under {warehouse}: none" in str(err.value)

    # Spark partition 0 holds ids 0-99, partition 1 ids 100-199, whose key is null: the node
    # refuses those rows (SchemaError), partition 0's rows land.
    df = spark.range(200, numPartitions=2).select(
        F.when(F.col("id") < 100, F.col("id")).alias("id"), F.col("id").alias("n")
    )
    with pytest.raises(DataFrameStreamError) as failed:
        await asyncio.to_thread(
            stream_dataframe, df, nodes=_addresses(cluster), table="orders", key="id"
        )
    [failure] = failed.value.failures
    assert failure.partition == 1 and failure.stream_id.endswith(":1")
    assert failure.items_not_applied == 100 and failure.items_applied == 0
    assert "SCHEMA_MISMATCH" in failure.error
    # The cause, said once: not wrapped in its stream's own "stream ... failed: ...".
    assert failure.error.startswith("SchemaError: ") and "failed:" not in failure.error
    assert str(failed.value).count(failure.stream_id) == 1
    assert failed.value.summary.items_applied == 100
    assert sorted(read_delta(warehouse / "orders")) == list(range(100))

    with pytest.raises(UsageError, match="on_failure='fallback'") as err:
        await asyncio.to_thread(read_dead_letters, spark, warehouse)
    assert "tables under" in str(err.value) and "orders" in str(err.value)

    summary = await asyncio.to_thread(
        stream_dataframe,
        df,
        nodes=_addresses(cluster),
        table="orders",
        key="id",
        options=StreamerOptions(on_failure="fallback"),
        stream_id="fallback-1",
    )
    assert summary.items_applied == 100 and summary.items_dead_lettered == 100

    dead = await asyncio.to_thread(lambda: read_dead_letters(spark, warehouse).collect())
    assert len(dead) == 100
    assert {r.stream_id for r in dead} == {"fallback-1:1"}
    assert {r.error_code for r in dead} == {"SCHEMA_MISMATCH"}
    assert sorted(r.position for r in dead) == list(range(100))
    orders = await asyncio.to_thread(read_table, spark, warehouse, "orders")
    assert orders.columns == ["id", "n"]  # without the layout column
    assert sorted(r.id for r in orders.collect()) == list(range(100))
    every = await asyncio.to_thread(read_table, spark, warehouse, "orders", all_columns=True)
    assert BUCKET_COLUMN in every.columns


async def test_structured_streaming_query_restarted_from_its_checkpoint_writes_each_row_once(
    spark: Any, four_partition_cluster: list[Node], warehouse: Path, tmp_path: Path
) -> None:
    """An append table (no key, so a duplicate would show) fed by a file-source query through
    the foreachBatch adapter. Run 1 fails after micro-batch 1 landed; run 2 replays it and has
    an executor SIGKILLed in the middle of micro-batch 2; run 3 replays that and finishes."""
    nodes = four_partition_cluster
    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    source.mkdir()
    files, per_file = 6, 300
    for f in range(files):
        lines = (json.dumps({"id": f * per_file + i, "file": f, "n": i}) for i in range(per_file))
        path = source / f"part-{f}.json"
        path.write_text("\n".join(lines) + "\n")
        os.utime(path, (1_700_000_000 + f, 1_700_000_000 + f))  # the source takes oldest first
    total = files * per_file

    # Small batches and a window of 2: the executor that is killed has had most of its
    # batches acknowledged (so they are in the table) before it dies.
    options = StreamerOptions(page_size=20, max_in_flight=2, per_partition_in_flight=1)
    crashed: list[int] = []

    def run(key: Any, crash_after_batch: int | None) -> None:
        writer = foreach_batch(
            nodes=_addresses(nodes),
            query_name="clicks-query",
            receiver="deltaflow.testing.AppendRows",
            receiver_args={"table": "clicks"},
            key=key,
            options=options,
        )

        def write(df: Any, batch_id: int) -> None:
            writer(df, batch_id)
            if batch_id == crash_after_batch and not crashed:
                crashed.append(batch_id)
                raise RuntimeError(f"injected crash after micro-batch {batch_id} landed")

        query = (
            spark.readStream.schema("id long, file long, n long")
            .option("maxFilesPerTrigger", 2)
            .json(str(source))
            .writeStream.foreachBatch(write)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    def landed() -> Counter[int]:
        return Counter(row["id"] for row in _rows_appended(warehouse, "clicks"))

    # Run 1: micro-batches 0 and 1 land, then the query fails before Spark records batch 1.
    with pytest.raises(Exception, match="injected crash after micro-batch 1"):
        await asyncio.to_thread(run, "id", 1)
    assert crashed == [1]
    assert landed() == Counter(range(4 * per_file))

    # Run 2: Spark replays micro-batch 1 (all of it is skipped by the lane marks), then the
    # Python worker streaming file 4 (micro-batch 2) is SIGKILLed when it reaches id 1450.
    deduplicated = sum(n.statistics().engine.batches_deduplicated for n in nodes)
    killer = KillOnKey("id", 4 * per_file + 250, tmp_path / "killed")
    with pytest.raises(Exception, match=r"(?i)python worker|crashed|exited"):
        await asyncio.to_thread(run, killer, None)
    assert (tmp_path / "killed").exists()
    assert sum(n.statistics().engine.batches_deduplicated for n in nodes) > deduplicated
    partial = landed()
    assert max(partial.values()) == 1
    assert 4 * per_file < len(partial) < total  # part of micro-batch 2 had landed

    # Run 3: micro-batch 2 is replayed: what landed is skipped, the rest is written once.
    await asyncio.to_thread(run, killer, None)
    final = landed()
    assert final == Counter(range(total))
    assert await asyncio.to_thread(lambda: read_table(spark, warehouse, "clicks").count()) == total


async def test_a_failed_arrow_partition_counts_every_row_it_did_not_apply(
    cluster: list[Node], warehouse: Path
) -> None:
    """A Spark partition streamed as Arrow batches whose stream fails counts as not applied
    every row it did not apply: those of the pages that failed, of the batches its client had
    read and not sent, and of the batches still in the partition (counted in rows, never in
    batches). Run as the executors run it, without Spark."""
    import pyarrow as pa

    from deltaflow.spark_integration.dataframe import PartitionStreamer, deterministic_options

    batches = [  # 120,000 rows, more than the client reads ahead; no key: every page fails
        pa.record_batch({"id": pa.nulls(2000, pa.int64()), "n": pa.array(range(2000))})
        for _ in range(60)
    ]
    streamer = PartitionStreamer(
        base_id="counted",
        nodes=tuple(_addresses(cluster)),
        token=None,
        tls=None,
        table="counted",
        key="id",
        receiver=None,
        receiver_args=None,
        # One batch in flight: the client stops taking batches, and reads some ahead.
        options=deterministic_options(StreamerOptions(max_in_flight=1, page_size=100)),
        schema=None,
    )
    [summary] = await asyncio.to_thread(lambda: list(streamer.stream_batches(iter(batches))))
    outcome = pa.Table.from_batches([summary]).to_pylist()[0]
    assert outcome["partition"] == 0 and outcome["stream_id"] == "counted:0"
    assert outcome["error"] and "no value for key column 'id'" in outcome["error"]
    assert (outcome["applied"], outcome["not_applied"]) == (0, 120_000)
