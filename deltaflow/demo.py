"""``make demo``: two local nodes, a stream of upserts and deletes into a Delta table."""

from __future__ import annotations

import asyncio
import datetime
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["demo_rows", "run_demo"]

#: When the demo's first order was placed (each later one a second after).
START = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def demo_rows(count: int, *, seed: int = 7) -> Iterator[Any]:
    """Synthetic orders: 75% new ids, then updates of earlier ids, with ~1% deletes."""
    from .client import Delete

    rng = random.Random(seed)
    fresh = int(count * 0.75)
    for i in range(count):
        if i < fresh:
            order_id = i
        else:
            order_id = rng.randrange(fresh)
            if rng.random() < 0.04:
                yield Delete({"id": order_id})
                continue
        yield {
            "id": order_id,
            "customer": f"c{rng.randrange(5000):05d}",
            "amount": round(rng.uniform(1, 500), 2),
            "ts": START + datetime.timedelta(seconds=i),
            "note": "x" * 40,
        }


@dataclass(frozen=True, slots=True)
class Expected:
    """What the demo's changes leave in the table, counted from the changes themselves."""

    created: int
    updates: int
    deleted: int

    @property
    def rows(self) -> int:
        return self.created - self.deleted

    @classmethod
    def of(cls, count: int) -> Expected:
        from .client import Delete

        live: set[int] = set()
        created = updates = deleted = 0
        for row in demo_rows(count):
            if isinstance(row, Delete):
                deleted += row.item["id"] in live
                live.discard(row.item["id"])
            elif row["id"] in live:
                updates += 1
            else:
                created += 1
                live.add(row["id"])
        return cls(created, updates, deleted)


def run_demo(
    *, rows: int = 200_000, warehouse: str | None = None, engine: str = "spark", keep: bool = False
) -> int:
    """Stream ``rows`` changes into the table ``orders`` under ``warehouse`` (a temporary
    directory, removed at the end unless ``keep``), read it back and check its rows."""
    from tqdm import tqdm

    import deltaflow
    from deltaflow.cli_output import print_table, readable
    from deltaflow.server import NodeConfig, start_local_nodes
    from deltaflow.spark_integration import get_spark

    tmp = None if warehouse else tempfile.mkdtemp(prefix="deltaflow-demo-")
    wh = Path(warehouse or tmp or ".")

    async def main() -> tuple[deltaflow.StreamSummary, float]:
        print(f"starting two nodes on 127.0.0.1 ({engine} engine) ...", flush=True)
        # Both nodes see each other before the stream starts.
        n1, n2 = await start_local_nodes(
            2, NodeConfig(node_id="node-1", warehouse=wh, port=0, engine=engine)
        )
        print(
            f"nodes up: {n1.address} ({n1.statistics().owned_partitions} partitions), "
            f"{n2.address} ({n2.statistics().owned_partitions} partitions)",
            flush=True,
        )
        try:
            with tqdm(total=rows, unit="rows", desc="streaming", smoothing=0.1) as bar:
                started = time.monotonic()
                async with deltaflow.connect([n1.address]) as client:
                    summary = await client.stream_data(
                        demo_rows(rows),
                        table="orders",
                        key="id",
                        on_ack=lambda items: bar.update(len(items)),
                    )
                elapsed = time.monotonic() - started
            for node in (n1, n2):
                eng = node.statistics().engine
                if eng.commits:
                    print(
                        f"  {node.node_id}: {eng.commits} commits, "
                        f"largest {eng.largest_group_rows:,} rows, "
                        f"mean commit {eng.commit_seconds / eng.commits:.2f}s"
                    )
        finally:
            await n2.stop()
            await n1.stop()
        return summary, elapsed

    try:
        summary, elapsed = asyncio.run(main())
        print(
            f"\nstreamed {summary.items_acked:,} rows in {elapsed:.1f}s = "
            f"{summary.items_acked / elapsed:,.0f} rows/s "
            f"(retried batches: {summary.batches_retried}, failed items: {summary.items_failed})"
        )
        for node_id, stats in sorted(summary.per_node.items()):
            print(f"  {node_id}: {stats.items_acked:,} rows in {stats.batches_acked} batches")
        spark = get_spark()
        path = wh / "orders"
        count = spark.sql(f"SELECT COUNT(*) AS n FROM delta.`{path}`").collect()[0]["n"]
        want = Expected.of(rows)
        expected = want.rows
        columns = "id, customer, amount, ts, note"  # not deltaflow's own bucket column
        sample = spark.sql(f"SELECT {columns} FROM delta.`{path}` ORDER BY id LIMIT 5").collect()
        print(f"\nDelta table {path}, its first rows (read back through Spark):")
        print_table(columns.split(", "), ([readable(v) for v in row] for row in sample))
        versions = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").count()
        verdict = "as the changes leave it" if count == expected else f"NOT {expected:,}"
        print(
            f"\n{'OK' if count == expected else 'WRONG'}: {summary.items_acked:,} changes "
            f"streamed by 2 nodes in {elapsed:.1f} s ({summary.items_acked / elapsed:,.0f}/s); "
            f"table orders holds {count:,} rows, {verdict} ({want.created:,} orders created, "
            f"{want.updates:,} updates, {want.deleted:,} deleted), in {versions} versions"
        )
        if keep or warehouse:
            print(f"the table stays at {path} (read it with Spark, or deltalake.QueryBuilder)")
        return 0 if count == expected else 1
    finally:
        if tmp and not keep:
            shutil.rmtree(tmp, ignore_errors=True)
