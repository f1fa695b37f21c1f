"""Buckets that grow with the table against every bucket from the first row.

Streams a small and a large keyed table through in-process delta-rs nodes on 127.0.0.1 (1 and
3 of them), once with the tables' layout growing (``table_bucket_rows``, the default) and
once with every one of the 64 buckets from the start (``table_bucket_rows=0``), and prints
per run: the table's live files, rows/s of the first write and of the updates, the time to
table (p50 and p99 of every batch, from the nodes' statistics), the groups the committer sent
back, and the ratios of the growing layout to the fixed one.

    make bench-layout, or python bench/layout.py [--large-rows N] [--updates N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass
class Run:
    table: str
    nodes: int
    layout: str
    files: int
    insert_rate: float
    update_rate: float
    p50: float
    p99: float
    sent_back: int


def _rows(ids: list[int], tag: str) -> Any:
    import pyarrow as pa

    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([f"{tag}-{i}" for i in ids]),
            "value": pa.array([float(i) for i in ids]),
        }
    )


async def run(
    table: str, rows: int, updates: int, rounds: int, count: int, bucket_rows: int, tmp: Path
) -> Run:
    import deltaflow
    from deltaflow.server import NodeConfig, start_local_nodes
    from deltaflow.tables.statistics import Histogram

    warehouse = tmp / f"{table}-{count}-{bucket_rows}"
    nodes = await start_local_nodes(
        count,
        NodeConfig(
            node_id="node-1",
            warehouse=warehouse,
            port=0,
            engine="delta-rs",
            table_bucket_rows=bucket_rows,
        ),
    )
    rng = random.Random(1)
    try:
        async with deltaflow.connect([nodes[0].address]) as client:
            started = time.perf_counter()
            await client.stream_data(_rows(list(range(rows)), "new"), table=table, key="id")
            insert = time.perf_counter() - started
            started = time.perf_counter()
            for round_ in range(rounds):
                ids = sorted(rng.sample(range(rows), min(updates, rows)))
                await client.stream_data(_rows(ids, f"r{round_}"), table=table, key="id")
            update = time.perf_counter() - started
        stats = [n.statistics().engine for n in nodes]
    finally:
        for node in reversed(nodes):
            await node.stop()
    first = stats[0].batch_durable_seconds_histogram
    per_node = [s.batch_durable_seconds_histogram.counts for s in stats]
    counts = [sum(c) for c in zip(*per_node, strict=True)]
    durable = Histogram(first.bounds, tuple(counts))
    files = await asyncio.to_thread(_live_files, warehouse / table, rows)
    return Run(
        table,
        count,
        "growing" if bucket_rows else "fixed",
        files,
        rows / insert,
        min(updates, rows) * rounds / update,
        durable.quantile(0.5) or 0.0,
        durable.quantile(0.99) or 0.0,
        sum(s.groups_sent_back for s in stats),
    )


def _live_files(path: Path, rows: int) -> int:
    """The table's live files, after checking that it holds every key once (by delta-rs)."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    table = DeltaTable(str(path))
    reader = (
        QueryBuilder()
        .register("t", table)
        .execute("SELECT count(*) n, count(DISTINCT id) k FROM t")
    )
    counted = pa.table(reader.read_all()).to_pylist()[0]
    assert counted == {"n": rows, "k": rows}, counted
    return int(pa.table(table.get_add_actions(flatten=True)).num_rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-rows", type=int, default=300)
    parser.add_argument("--large-rows", type=int, default=1_000_000)
    parser.add_argument("--updates", type=int, default=100_000, help="keys per update round")
    parser.add_argument("--rounds", type=int, default=2, help="update rounds")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args(argv)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="deltaflow-layout-") as tmp:
        # Imports and first-use costs land in a run that is not measured.
        asyncio.run(run("warm", 300, 300, 1, 1, 0, Path(tmp)))
        for table, rows in (("small", args.small_rows), ("large", args.large_rows)):
            for count in args.nodes:
                for bucket_rows in (0, 4096):
                    done = asyncio.run(
                        run(table, rows, args.updates, args.rounds, count, bucket_rows, Path(tmp))
                    )
                    runs.append(done)
                    print(
                        f"{done.table:5} {done.nodes} node(s) {done.layout:7}: "
                        f"{done.files:5} files, insert {done.insert_rate:9,.0f} rows/s, "
                        f"update {done.update_rate:9,.0f} rows/s, time to table p50 "
                        f"{done.p50:.3f}s p99 {done.p99:.3f}s, sent back {done.sent_back}",
                        flush=True,
                    )
    print("\n| table | nodes | layout | files | insert rows/s | update rows/s | "
          "time to table p50 / p99 | groups sent back |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r.table} | {r.nodes} | {r.layout} | {r.files} | {r.insert_rate:,.0f} | "
            f"{r.update_rate:,.0f} | {r.p50:.3f} s / {r.p99:.3f} s | {r.sent_back} |"
        )
    print("\nratios, growing / fixed (files; insert and update rows/s):")
    for fixed, growing in zip(runs[::2], runs[1::2], strict=True):
        print(
            f"  {fixed.table} {fixed.nodes} node(s): files {growing.files / fixed.files:.2f}, "
            f"insert {growing.insert_rate / fixed.insert_rate:.2f}, "
            f"update {growing.update_rate / fixed.update_rate:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
