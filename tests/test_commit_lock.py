"""Two node processes committing to one Delta table at the same time: no commit is lost.

Each node runs with no peers and one partition, so it owns everything and applies every
batch it gets; with one batch in flight per stream every batch is its own commit, racing the
other process's commits to the same table: 2 x 100 appends through two Spark JVMs (about two
minutes here) and 2 x 150 merges through delta-rs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

import deltaflow
from deltaflow import StreamerOptions
from deltaflow.spark_integration.lock import others_waiting, table_lock, table_lock_path
from deltaflow.testing import NodeProcess

from .conftest import read_delta

APPEND_RECEIVER = "deltaflow.testing.AppendRows"


async def race(
    warehouse: Path,
    engine: str,
    batches: int,
    rows: int,
    *,
    append: bool,
    keys: int | None = None,
    extra: tuple[str, ...] = (),
) -> float:
    """Both nodes stream ``batches`` one-batch commits of ``rows`` rows; returns the seconds the
    two streams took. Merges into a keyed table, or appends to a keyless one. With ``keys``,
    each node's rows cycle through that many ids, so every batch after the first few updates
    rows of the node's earlier commits."""
    extra = ("--partitions", "1", "--engine", engine, *extra)
    if append:
        extra += ("--receiver", APPEND_RECEIVER)
    total = batches * rows
    distinct = keys or total
    nodes = [NodeProcess(f"{engine}-{i}", warehouse, extra=extra) for i in (1, 2)]
    await asyncio.gather(*(n.start() for n in nodes))
    opts = StreamerOptions(page_size=rows, max_in_flight=1, auto_flush_interval=0)

    async def stream(node: NodeProcess, offset: int) -> deltaflow.StreamSummary:
        data = [{"id": offset + i % distinct, "writer": node.node_id, "n": i} for i in range(total)]
        async with deltaflow.connect([node.address]) as client:
            if append:
                return await client.stream_data(
                    data,
                    key=lambda row: row["id"],
                    receiver=APPEND_RECEIVER,
                    receiver_args={"table": "shared"},
                    options=opts,
                )
            return await client.stream_data(data, table="shared", key="id", options=opts)

    started = time.monotonic()
    try:
        summaries = await asyncio.gather(stream(nodes[0], 0), stream(nodes[1], 1_000_000))
    finally:
        elapsed = time.monotonic() - started
        await asyncio.gather(*(n.stop() for n in nodes))
    assert all(s.items_acked == batches * rows for s in summaries)
    path = warehouse / "shared"
    table = DeltaTable(str(path))
    # Every version is there, none overwritten: the table's creation, then one commit per
    # batch, each carrying its writer's lane marks.
    versions = sorted(h["version"] for h in table.history(10_000))
    assert versions == list(range(2 * batches + 1))
    writers = [_writer(path, v) for v in versions]
    assert writers[0] == ""  # the creation (a commit of its own, without rows)
    assert sorted(writers[1:]) == sorted([n.node_id for n in nodes] * batches)
    data = {k: (r["writer"], r["n"]) for k, r in read_delta(path).items()}
    # Each id holds its last write: n is the last of its cycle.
    assert data == {
        offset + k: (node.node_id, last)
        for node, offset in ((nodes[0], 0), (nodes[1], 1_000_000))
        for k in range(distinct)
        for last in [max(i for i in range(total) if i % distinct == k)]
    }
    return elapsed


def _writer(path: Path, version: int) -> str:
    """The node recorded in a commit's lane marks ('' for a commit without them)."""
    for line in (path / "_delta_log" / f"{version:020d}.json").read_text().splitlines():
        info = json.loads(line).get("commitInfo")
        if info is not None:
            meta = json.loads(info.get("userMetadata") or "{}")
            return str(meta.get("deltaflow", {}).get("node", ""))
    return ""


@pytest.mark.slow
async def test_hammer_200_appends_from_two_spark_processes(warehouse: Path) -> None:
    # Spark's HDFSLogStore is the log store whose put-if-absent is atomic only inside one JVM:
    # two JVMs, 200 commits, none may be lost. Appends (about 0.3-0.6 s each here) rather than
    # MERGEs (1-3 s each): the commit path and its lock are the same, and 200 fit in about
    # two minutes on this 2-core machine.
    await race(warehouse, "spark", batches=100, rows=4, append=True)


@pytest.mark.slow
async def test_hammer_300_commits_from_two_delta_rs_processes(warehouse: Path) -> None:
    await race(warehouse, "delta-rs", batches=150, rows=4, append=False)


@pytest.mark.slow
async def test_hammer_300_merge_on_read_commits_from_two_delta_rs_processes(
    warehouse: Path,
) -> None:
    # Tables with deletion vectors are committed by deltaflow's own log writer (delta-rs's
    # transactions take no deletion vectors): every batch replaces rows of earlier commits.
    await race(
        warehouse,
        "delta-rs",
        batches=150,
        rows=4,
        append=False,
        keys=20,
        extra=("--deletion-vectors",),
    )


def test_a_waiter_killed_while_waiting_stops_counting_as_waiting(tmp_path: Path) -> None:
    """A process SIGKILLed while it waits for a table's lock cannot remove its marker; left
    there, it would make every holder step aside after each release for good."""
    lock_path = table_lock_path(tmp_path, "t")
    script = (
        "import sys; from pathlib import Path; "
        "from deltaflow.spark_integration.lock import table_lock; "
        "table_lock(Path(sys.argv[1]), 't').__enter__()"
    )
    with table_lock(tmp_path, "t"):
        waiter = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)])
        try:
            deadline = time.monotonic() + 60
            while not others_waiting(lock_path):  # the waiter's marker, once it found the lock held
                assert waiter.poll() is None and time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            waiter.kill()
            waiter.wait()
        assert not others_waiting(lock_path)
    assert not any(lock_path.parent.glob("*.waiting/*"))
