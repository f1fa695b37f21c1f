"""Spark as a source: ``stream_dataframe`` against Spark writing the same DataFrame itself.

One local SparkSession with Delta (``local[*]``) makes a DataFrame of N rows (id, name,
a ``decimal(12,2)`` amount, a timestamp) in 4 partitions. In one run, timed each:

- ``spark-append``: ``df.write.format("delta").mode("append")`` into a new table;
- ``spark-merge``: a Delta ``MERGE`` of the DataFrame into an empty table of its schema;
- ``deltaflow``: ``stream_dataframe(df, table=..., key="id")`` to two delta-rs nodes in
  processes of their own (their start untimed), the partitions' Arrow batches as they are;
- ``deltaflow-rows``: the same through the row path (each row a dict of msgpack values, as
  a receiver's stream goes), into a table of its own.

It prints rows/s, the ratio of deltaflow to each, and whether the table deltaflow made has the
DataFrame's column types (``decimal(12,2)`` stays). Usage: ``python bench/dataframe.py
[--rows N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def make_frame(spark: Any, rows: int) -> Any:
    from pyspark.sql import functions as F

    df = spark.range(rows, numPartitions=4).select(
        F.col("id"),
        F.concat(F.lit("name-"), F.col("id").cast("string")).alias("name"),
        (F.col("id") % 100_000 / 100).cast("decimal(12,2)").alias("amount"),
        F.timestamp_seconds(F.col("id") + 1_700_000_000).alias("at"),
    )
    return df  # not cached: Delta's MERGE refuses a cached source, and range() costs little


def timed(what: str, run: Any) -> float:
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    print(f"  {what:<14} {seconds:6.2f}s", flush=True)
    return seconds


async def start_nodes(warehouse: Path) -> list[Any]:
    from deltaflow.testing import NodeProcess, free_port

    ports = [free_port() for _ in range(2)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    nodes = [
        NodeProcess(
            f"node-{i}",
            warehouse,
            port=port,
            peers=[a for a in addresses if not a.endswith(f":{port}")],
            extra=["--engine", "delta-rs"],
        )
        for i, port in enumerate(ports, start=1)
    ]
    await nodes[0].start()
    await nodes[1].start()
    return nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300_000, help="rows of the DataFrame")
    args = parser.parse_args()

    import pyarrow as pa
    from deltalake import DeltaTable

    from deltaflow.spark_integration import SparkConfig, get_spark, stream_dataframe
    from deltaflow.spark_integration.dataframe import PartitionStreamer
    from deltaflow.testing import wait_for_members

    root = Path(tempfile.mkdtemp(prefix="deltaflow-bench-df-"))
    warehouse = root / "warehouse"
    warehouse.mkdir()
    spark = get_spark(SparkConfig(master="local[*]", shuffle_partitions=4))
    df = make_frame(spark, args.rows)
    print(f"stream_dataframe against Spark's own writes: {args.rows:,} rows, 4 partitions")
    make_frame(spark, 1000).write.format("delta").save(str(root / "warm_up"))  # JIT, untimed

    seconds: dict[str, float] = {}
    seconds["spark-append"] = timed(
        "spark-append",
        lambda: df.write.format("delta").mode("append").save(str(root / "spark_append")),
    )

    def merge() -> None:
        from delta.tables import DeltaTable as SparkDelta

        target = str(root / "spark_merge")
        df.limit(0).write.format("delta").save(target)
        started = time.perf_counter()
        (
            SparkDelta.forPath(spark, target)
            .alias("t")
            .merge(df.alias("s"), "t.id = s.id")
            .whenMatchedUpdateAll()
            .whenNotMatchedInsertAll()
            .execute()
        )
        merge.seconds = time.perf_counter() - started  # type: ignore[attr-defined]

    timed("spark-merge", merge)
    seconds["spark-merge"] = merge.seconds  # type: ignore[attr-defined]

    loop = asyncio.new_event_loop()
    nodes = loop.run_until_complete(start_nodes(warehouse))
    try:
        loop.run_until_complete(wait_for_members([n.address for n in nodes]))
        summary: list[Any] = []
        addresses = [n.address for n in nodes]
        seconds["deltaflow"] = timed(
            "deltaflow",
            lambda: summary.append(stream_dataframe(df, nodes=addresses, table="events", key="id")),
        )
        # The path before the Arrow batches: each row made a dict of msgpack values.
        columnar = PartitionStreamer.columnar
        PartitionStreamer.columnar = property(lambda self: False)  # type: ignore[method-assign,assignment]
        try:
            seconds["deltaflow-rows"] = timed(
                "deltaflow-rows",
                lambda: stream_dataframe(df, nodes=addresses, table="events_rows", key="id"),
            )
        finally:
            PartitionStreamer.columnar = columnar  # type: ignore[method-assign]
    finally:
        for node in nodes:
            loop.run_until_complete(node.stop())
        loop.close()
    applied = summary[0].items_applied
    table = DeltaTable(str(warehouse / "events"))
    types = {f.name: f.type for f in pa.schema(table.schema().to_arrow())}
    exact = types["amount"] == pa.decimal128(12, 2) and types["at"] == pa.timestamp("us", "UTC")
    print()
    for name, value in seconds.items():
        print(f"  {name:<14} {args.rows / value:>10,.0f} rows/s")
    for name in ("spark-append", "spark-merge", "deltaflow-rows"):
        print(f"  deltaflow / {name}: {seconds[name] / seconds['deltaflow']:.2f}x")
    print(f"  rows applied {applied:,} of {args.rows:,}; types exact: {exact} ({types['amount']})")


if __name__ == "__main__":
    main()
