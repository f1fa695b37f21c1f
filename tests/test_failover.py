"""A cluster of node processes on 127.0.0.1 losing nodes to SIGKILL: nothing lost, nothing
applied twice, per-key order kept, killed nodes rejoin."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from deltalake import DeltaTable

import deltaflow
from deltaflow.testing.changes import Change, change_feed

from .support import FAILOVER_OPTIONS as OPTIONS
from .support import (
    NODE_FLAGS,
    Cluster,
    FailoverWatch,
    KillAt,
    assert_appended_once,
    commit_writers,
    read_delta,
    read_spark,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(900),  # three JVMs on two cores: cluster start-up counts in the first
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("failover") / "warehouse")
    await c.start_all()
    yield c
    await c.stop()


def read_rows(path: Path) -> list[dict[str, Any]]:
    return DeltaTable(str(path)).to_pyarrow_table().to_pylist()


def lost_answers(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The client's warnings of batches left without an answer until their ack timeout (20 s
    here). A failover loses none; each was a stall only the timeout ended (a batch waiting at
    a new owner for one the old owner had acked, say)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "deltaflow.client.connection" and r.getMessage().startswith("no answer")
    ]


async def test_upserts_survive_a_sigkilled_node_with_last_values(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="deltaflow.client.connection")
    n = 300_000
    rows = [{"id": i % 100_000, "v": i} for i in range(n)]
    client = await cluster.wait_members(3)
    watch = FailoverWatch(cluster.nodes["node-2"], n // 3, client.partition_map, grace=0.5)
    async with client:
        summary = await client.stream_data(
            rows, table="upserts", key="id", on_ack=watch, options=OPTIONS
        )
    assert summary.items_acked == n
    assert lost_answers(caplog) == []  # no batch waited for its ack timeout
    table = {r["id"]: r["v"] for r in read_rows(cluster.warehouse / "upserts")}
    assert len(table) == 100_000
    assert table == {k: 200_000 + k for k in range(100_000)}  # the last write of every key
    failover = watch.failover
    print(f"\nfailover: kill to first batch acked by a new owner = {failover:.2f}s")  # noqa: T201
    assert failover < 30


async def test_a_killed_node_rejoins_and_takes_partitions_again(cluster: Cluster) -> None:
    await cluster.nodes["node-2"].stop()
    await cluster.start("node-2")
    client = await cluster.wait_members(3)
    async with client:
        summary = await client.stream_data(
            [{"id": i, "v": -i} for i in range(30_000)],
            table="rejoin",
            key="id",
            options=OPTIONS,
        )
    assert set(summary.per_node) == {"node-1", "node-2", "node-3"}
    assert len(read_rows(cluster.warehouse / "rejoin")) == 30_000


async def test_appends_through_a_sigkill_land_exactly_once(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="deltaflow.client.connection")
    n = 300_000
    rows = [{"id": i, "v": i * 2} for i in range(n)]
    client = await cluster.wait_members(3)
    async with client:
        summary = await client.stream_data(
            rows,
            key="id",
            receiver="deltaflow.testing.AppendRows",
            receiver_args={"table": "appends"},
            options=OPTIONS,
            on_ack=KillAt(cluster.nodes["node-3"], n // 3),
        )
    assert summary.items_acked == n
    assert lost_answers(caplog) == []  # no batch waited for its ack timeout
    ids = [r["id"] for r in read_rows(cluster.warehouse / "appends")]
    assert len(ids) == n and set(ids) == set(range(n))


async def test_a_crash_between_commit_and_ack_is_not_applied_twice(cluster: Cluster) -> None:
    crashing = await cluster.restart("node-3", env={"DELTAFLOW_FAULT_KILL_AFTER_COMMIT": "1"})
    n = 60_000
    summary = await cluster.append_ids("crash", n, OPTIONS)
    assert summary.items_acked == n
    # It did crash, right after its commit (it must have exited by now).
    assert await asyncio.wait_for(crashing.wait(), 30) == -9
    assert_appended_once(cluster.warehouse / "crash", n, committed_by="node-3")
    await cluster.start("node-3")  # heal for the next test


async def test_the_bootstrap_node_dying_does_not_stop_the_stream(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="deltaflow.client.connection")
    await cluster.wait_members(3)
    n = 60_000
    async with deltaflow.connect([cluster.nodes["node-1"].address]) as client:
        summary = await client.stream_data(
            [{"id": i, "v": 1} for i in range(n)],
            table="bootstrap",
            key="id",
            options=OPTIONS,
            on_ack=KillAt(cluster.nodes["node-1"], n // 4),
        )
    assert summary.items_acked == n
    assert lost_answers(caplog) == []  # no batch waited for its ack timeout
    assert len(read_rows(cluster.warehouse / "bootstrap")) == n


async def test_a_change_feed_through_a_sigkill_ends_at_the_source(tmp_path: Path) -> None:
    """Two delta-rs nodes take a change feed into two ``sequence_by`` tables, one last-wins
    and one of partial updates (per-column sequences); one node is SIGKILLed in the middle of
    the newer half. The survivor takes its partitions with what the dead node recorded (each
    key's and each column's sequence, its deletes), so the older half, streamed afterwards,
    changes only what is newer than the table holds, and both tables end as the source's."""
    flags = (*NODE_FLAGS[2:6], "--engine", "delta-rs")
    c = Cluster(tmp_path / "warehouse", count=2, flags=flags)
    await asyncio.gather(*(c.start(n) for n in c.ports))
    feed = change_feed(keys=300, changes=6_000, deletes=0.05, seed=11)
    partial = feed.partial(seed=12)
    schema = "id:long,lsn:long,name:string,amount:long"
    for table, merge in (("last", "last"), ("patched", "partial")):
        await asyncio.to_thread(
            deltaflow.create_table,
            c.warehouse,
            table,
            schema=schema,
            key="id",
            sequence_by="lsn",
            merge=merge,
        )
    half = len(feed.changes) // 2
    rng = random.Random(13)

    def shuffled(changes: list[Change]) -> list[Any]:
        items = [change.as_item() for change in changes]
        rng.shuffle(items)
        return items

    options = dataclasses.replace(OPTIONS, page_size=50, max_in_flight=8)
    kill = KillAt(c.nodes["node-2"], half)  # of the newer halves' 2 x 3,000 changes
    try:
        client = await c.wait_members(2)
        async with client:
            for part, on_ack in ((slice(half, None), kill), (slice(None, half), None)):
                summaries = await asyncio.gather(
                    *(
                        client.stream_data(
                            shuffled(source.changes[part]),
                            table=table,
                            key="id",
                            on_ack=on_ack,
                            options=options,
                        )
                        for table, source in (("last", feed), ("patched", partial))
                    )
                )
                assert [s.items_failed for s in summaries] == [0, 0]
    finally:
        await asyncio.gather(*(node.stop() for node in c.nodes.values()))
    assert kill.killed_at is not None

    def rows(table: str) -> dict[int, dict[str, Any]]:
        columns = ("id", "lsn", "name", "amount")
        return {
            k: {col: r[col] for col in columns if r[col] is not None}
            for k, r in read_delta(c.warehouse / table).items()
        }

    assert rows("last") == feed.final()
    assert rows("patched") == partial.final_partial()
    # The dead node wrote both before the kill, the survivor after it.
    assert {"node-1", "node-2"} <= set(commit_writers(c.warehouse / "patched"))


async def test_merge_on_read_through_a_sigkill(tmp_path: Path, spark: Any) -> None:
    """Two delta-rs nodes on a table with deletion vectors, one SIGKILLed mid-stream: the
    survivor takes its partitions and marks rows in the files the dead node wrote (their key
    columns read from disk), resent batches whose commit had landed are skipped, and every key
    ends with its last value, once."""
    flags = (*NODE_FLAGS[2:6], "--engine", "delta-rs", "--deletion-vectors")
    dv = Cluster(tmp_path / "warehouse", count=2, flags=flags)
    await asyncio.gather(*(dv.start(n) for n in dv.ports))
    # Small pages and a small window: many small commits, each replacing part of its files.
    options = dataclasses.replace(OPTIONS, page_size=100, max_in_flight=8)
    try:
        client = await dv.wait_members(2)
        n, keys = 60_000, 20_000  # every key written three times
        kill = KillAt(dv.nodes["node-2"], n // 2)
        async with client:
            summary = await client.stream_data(
                [{"id": i % keys, "v": i} for i in range(n)],
                table="marked",
                key="id",
                on_ack=kill,
                options=options,
            )
    finally:
        await asyncio.gather(*(node.stop() for node in dv.nodes.values()))
    assert summary.items_acked == n and kill.killed_at is not None
    path = dv.warehouse / "marked"
    want = {k: n - keys + k for k in range(keys)}  # the last write of every key
    assert {k: r["v"] for k, r in read_delta(path).items()} == want
    assert {k: r["v"] for k, r in read_spark(spark, path).items()} == want
    # The survivor marked rows in files the dead node had written.
    written_by: dict[str, str] = {}
    marked_by: set[tuple[str, str]] = set()
    for commit in sorted((path / "_delta_log").glob("*.json")):
        actions = [json.loads(line) for line in commit.read_text().splitlines()]
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        node = json.loads(info.get("userMetadata") or "{}").get("deltaflow", {}).get("node", "")
        for add in (a["add"] for a in actions if "add" in a):
            if add.get("deletionVector"):
                marked_by.add((add["path"], node))
            else:
                written_by[add["path"]] = node
    assert any(written_by.get(file) == "node-2" for file, node in marked_by if node == "node-1")
