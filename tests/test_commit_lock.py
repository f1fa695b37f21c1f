"""Two node processes committing to one Delta table at the same time: no commit is lost.

Each node runs with no peers and one partition, so it owns everything and applies every
batch it gets; with one batch in flight per stream every batch is its own commit, racing the
other process's commits to the same table.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from deltalake import DeltaTable

import deltaflow
from deltaflow import StreamerOptions

from .procs import NodeProcess


async def race(warehouse: Path, engine: str, batches: int, rows: int) -> None:
    nodes = [
        NodeProcess(f"{engine}-{i}", warehouse, extra=["--partitions", "1", "--engine", engine])
        for i in (1, 2)
    ]
    await asyncio.gather(*(n.start() for n in nodes))
    opts = StreamerOptions(page_size=rows, max_in_flight=1, auto_flush_interval=0)

    async def stream(node: NodeProcess, offset: int) -> deltaflow.StreamSummary:
        data = [{"id": offset + i, "writer": node.node_id} for i in range(batches * rows)]
        async with deltaflow.connect([node.address]) as client:
            return await client.stream_data(data, table="shared", key="id", options=opts)

    try:
        summaries = await asyncio.gather(stream(nodes[0], 0), stream(nodes[1], 1_000_000))
    finally:
        await asyncio.gather(*(n.stop() for n in nodes))
    assert all(s.items_acked == batches * rows for s in summaries)
    table = DeltaTable(str(warehouse / "shared"))
    # Every batch is one commit and every commit is a version: none lost or overwritten.
    assert sorted(h["version"] for h in table.history(10_000)) == list(range(2 * batches))
    data = table.to_pyarrow_table().to_pylist()
    assert len(data) == 2 * batches * rows == len({r["id"] for r in data})
    assert {r["writer"] for r in data} == {n.node_id for n in nodes}


@pytest.mark.slow
async def test_two_spark_processes_committing_concurrently_lose_no_commit(warehouse: Path) -> None:
    await race(warehouse, "spark", batches=8, rows=25)  # two JVMs: a MERGE costs ~1-2 s


@pytest.mark.slow
async def test_hammer_300_commits_from_two_delta_rs_processes(warehouse: Path) -> None:
    await race(warehouse, "delta-rs", batches=150, rows=4)
