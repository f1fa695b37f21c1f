"""Replay a file of Debezium change events into a Delta table, as a Kafka consumer would.

Each line is one message value: a Debezium envelope (``before``, ``after``, ``op``,
``source``, ``ts_ms``) or ``null`` (Kafka's tombstone after a delete). The table orders the
changes to each key by the source's log sequence number (``sequence_by="lsn"``, read from each
event's ``source`` block), so the file may be shuffled, replayed or merged from several
connector tasks: the table ends at the source database's rows. ``on_commit`` gives the offset
a consumer may commit: every line before it is applied.

Run a node first:  deltaflow serve --node-id n1 --port 7700 --warehouse /tmp/wh
Then:              python examples/cdc_debezium.py events.jsonl --table customers

Or, with the sample events (two connector tasks' messages, one after the other, so out of
order; redeliveries; deletes and their tombstones) and a node started here, checking that the
table ends at the source's rows (``make demo-cdc``):

    python examples/cdc_debezium.py examples/data/customers.jsonl --local \
        --expect examples/data/customers.expected.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import deltaflow


def consume(path: Path, offsets: list[int]) -> Iterator[Any]:
    """The file's message values; the offset of each change (not tombstones) is noted."""
    with path.open(encoding="utf-8") as lines:
        for offset, line in enumerate(lines):
            event = json.loads(line)
            if event is not None:
                offsets.append(offset)
            yield event


async def main(path: Path, nodes: list[str], table: str) -> None:
    offsets: list[int] = []
    committed = -1

    def on_commit(position: deltaflow.CommitPosition) -> None:
        nonlocal committed
        committed = offsets[position.count - 1]  # a consumer would commit this offset

    async with deltaflow.connect(nodes) as client:
        summary = await client.stream_data(
            consume(path, offsets),
            table=table,
            key="id",
            sequence_by="lsn",
            changelog="debezium",
            on_commit=on_commit,
        )
    print(f"{summary.items_acked} changes applied; committed offset {committed}")


def run_locally(path: Path, table: str, expect: Path | None) -> int:
    """Start one node (delta-rs, a temporary warehouse), replay the file, read the table back
    with deltalake and compare it with ``expect`` (rows by id)."""
    import tempfile

    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    from deltaflow.server import NodeConfig, start_local_nodes

    warehouse = Path(tempfile.mkdtemp(prefix="deltaflow-cdc-"))

    async def replay() -> None:
        [node] = await start_local_nodes(
            1, NodeConfig(node_id="n1", warehouse=warehouse, port=0, engine="delta-rs")
        )
        try:
            await main(path, [node.address], table)
        finally:
            await node.stop()

    asyncio.run(replay())
    found = DeltaTable(str(warehouse / table))
    rows = pa.table(QueryBuilder().register("t", found).execute("SELECT * FROM t").read_all())
    held = {r["id"]: {c: r[c] for c in ("id", "name", "amount")} for r in rows.to_pylist()}
    print(f"table {table} at {warehouse / table}: {len(held)} rows")
    if expect is None:
        return 0
    want = {
        int(k): {c: r[c] for c in ("id", "name", "amount")}
        for k, r in json.loads(expect.read_text()).items()
    }
    same = held == want
    print(f"{'OK' if same else 'WRONG'}: the table {'holds' if same else 'does not hold'} the "
          f"source's {len(want)} rows, whatever order the changes came in")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path, help="a file of Debezium events, one per line")
    parser.add_argument("--nodes", default="127.0.0.1:7700", help="node addresses, comma-separated")
    parser.add_argument("--table", default="customers")
    parser.add_argument(
        "--local", action="store_true", help="start a node here, in a temporary directory"
    )
    parser.add_argument("--expect", type=Path, help="with --local: the rows the table must hold")
    args = parser.parse_args()
    if args.local:
        raise SystemExit(run_locally(args.file, args.table, args.expect))
    asyncio.run(main(args.file, args.nodes.split(","), args.table))
