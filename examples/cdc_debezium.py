"""Replay a file of Debezium change events into a Delta table, as a Kafka consumer would.

Each line is one message value: a Debezium envelope (``before``, ``after``, ``op``,
``source``, ``ts_ms``) or ``null`` (Kafka's tombstone after a delete). The table orders the
changes to each key by the source's log sequence number (``sequence_by="lsn"``, read from each
event's ``source`` block), so the file may be shuffled, replayed or merged from several
connector tasks: the table ends at the source database's rows. ``on_commit`` gives the offset
a consumer may commit: every line before it is applied.

Run a node first:  deltaflow serve --node-id n1 --port 7700 --warehouse /tmp/wh
Then:              python examples/cdc_debezium.py events.jsonl --table customers
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path, help="a file of Debezium events, one per line")
    parser.add_argument("--nodes", default="127.0.0.1:7700", help="node addresses, comma-separated")
    parser.add_argument("--table", default="customers")
    args = parser.parse_args()
    asyncio.run(main(args.file, args.nodes.split(","), args.table))
