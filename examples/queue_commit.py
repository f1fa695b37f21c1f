"""Consume a queue that commits cumulatively (like Kafka offsets) and commit only what is safe.

deltaflow acknowledges batches out of order (partitions progress independently). Committing
the offset of every acknowledged item would let a crash skip items that were not applied yet.
``on_commit`` reports the end of the contiguous prefix of settled items instead: committing
that offset never skips anything.

Run a node first:  deltaflow serve --node-id n1 --port 7700 --warehouse /tmp/wh
Then:              python examples/queue_commit.py
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import deltaflow


class OffsetQueue:
    """A stand-in for a Kafka partition: messages with offsets and a committed offset."""

    def __init__(self, messages: int) -> None:
        self.log = [{"offset": o, "id": o % 1000, "amount": o * 0.5} for o in range(messages)]
        self.committed = -1  # a restarted consumer resumes at committed + 1

    async def consume(self) -> AsyncIterator[dict[str, Any]]:
        for message in self.log[self.committed + 1 :]:
            yield message

    def commit(self, offset: int) -> None:
        assert offset >= self.committed, "commits only move forward"
        self.committed = offset


async def main(nodes: list[str] | None = None, messages: int = 50_000) -> OffsetQueue:
    queue = OffsetQueue(messages)

    def on_commit(position: deltaflow.CommitPosition) -> None:
        queue.commit(position.last["offset"])

    async with deltaflow.connect(nodes or ["127.0.0.1:7700"]) as client:
        summary = await client.stream_data(
            queue.consume(), table="payments", key="id", on_commit=on_commit
        )
    print(f"applied {summary.items_acked} messages; committed offset {queue.committed}")
    return queue


if __name__ == "__main__":
    asyncio.run(main())
