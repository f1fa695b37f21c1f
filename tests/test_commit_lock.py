"""Two node processes (two JVMs) committing to one Delta table: no commit is lost."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from deltalake import DeltaTable

import deltaflow
from deltaflow import StreamerOptions

from .procs import NodeProcess

BATCHES = 8
ROWS = 25


@pytest.mark.slow
async def test_concurrent_commits_from_two_processes_all_land(warehouse: Path) -> None:
    # No peers: each node owns every partition, so both commit every batch they get, to the
    # same table, at the same time.
    # One partition: each stream's batches go out one by one, in order.
    nodes = [NodeProcess(f"solo-{i}", warehouse, extra=["--partitions", "1"]) for i in (1, 2)]
    await asyncio.gather(*(n.start() for n in nodes))
    try:
        # One batch in flight per stream: every batch is its own commit, racing the other
        # process's commits.
        opts = StreamerOptions(page_size=ROWS, max_in_flight=1, auto_flush_interval=0)

        async def stream(node: NodeProcess, offset: int) -> deltaflow.StreamSummary:
            rows = [{"id": offset + i, "writer": node.node_id} for i in range(BATCHES * ROWS)]
            async with deltaflow.connect([node.address]) as client:
                return await client.stream_data(rows, table="shared", key="id", options=opts)

        summaries = await asyncio.gather(stream(nodes[0], 0), stream(nodes[1], 100_000))
    finally:
        await asyncio.gather(*(n.stop() for n in nodes))
    assert all(s.items_acked == BATCHES * ROWS for s in summaries)
    table = DeltaTable(str(warehouse / "shared"))
    history = table.history()
    versions = sorted(h["version"] for h in history)
    # Every batch is one commit and every commit is a version: none overwritten.
    assert versions == list(range(2 * BATCHES))
    rows = table.to_pyarrow_table().to_pylist()
    assert len(rows) == 2 * BATCHES * ROWS
    assert {r["writer"] for r in rows} == {"solo-1", "solo-2"}


@pytest.mark.slow
async def test_hammer_hundreds_of_commits_from_two_delta_rs_processes(warehouse: Path) -> None:
    batches, rows = 150, 4
    nodes = [
        NodeProcess(f"rs-{i}", warehouse, extra=["--partitions", "1", "--engine", "delta-rs"])
        for i in (1, 2)
    ]
    await asyncio.gather(*(n.start() for n in nodes))
    try:
        opts = StreamerOptions(page_size=rows, max_in_flight=1, auto_flush_interval=0)

        async def stream(node: NodeProcess, offset: int) -> deltaflow.StreamSummary:
            data = [{"id": offset + i, "writer": node.node_id} for i in range(batches * rows)]
            async with deltaflow.connect([node.address]) as client:
                return await client.stream_data(data, table="hammer", key="id", options=opts)

        summaries = await asyncio.gather(stream(nodes[0], 0), stream(nodes[1], 1_000_000))
    finally:
        await asyncio.gather(*(n.stop() for n in nodes))
    assert all(s.items_acked == batches * rows for s in summaries)
    table = DeltaTable(str(warehouse / "hammer"))
    versions = sorted(h["version"] for h in table.history(1000))
    assert versions == list(range(2 * batches))  # 300 commits, none lost or overwritten
    data = table.to_pyarrow_table().to_pylist()
    assert len(data) == 2 * batches * rows
    assert len({r["id"] for r in data}) == len(data)
