"""One committer per table across node processes: the partition owners prepare their groups
and the table's committer commits them. The committer SIGKILLed mid-stream (the next one,
named by ``cluster status --json``, takes over: keys exact, appends once), the committer
paused past the failure timeout (its late commit does not land), a writer killed between
preparing and sending (its files are referenced by nothing and ``vacuum`` removes them), and
Spark and delta-rs nodes writing one table through one committer."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from deltaflow import StreamerOptions
from deltaflow.engines import create_table
from deltaflow.partitioning import PartitionMap, partition_of
from deltaflow.storage.paths import Location, location
from deltaflow.tables import maintenance
from deltaflow.testing.object_store import S3Server

from .support import (
    FAILOVER_OPTIONS,
    NODE_FLAGS,
    Cluster,
    KillAt,
    append_ids,
    metric,
    open_table,
    process_state,
    read_all,
    read_delta,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FLAGS = (*NODE_FLAGS[:6], "--engine", "delta-rs")
#: Small pages, several in flight: many small groups from every writer.
SMALL = StreamerOptions(
    page_size=50,
    per_partition_in_flight=2,
    auto_flush_interval=0.05,
    retry_initial_backoff=0.05,
    retry_max_backoff=1.0,
    retry_limit=40,
    ack_timeout=20.0,
)


@pytest.fixture
async def clusters(tmp_path: Path) -> AsyncIterator[list[Cluster]]:
    """The clusters a test starts, stopped at its end; each node's log in ``<node>.log``."""
    started: list[Cluster] = []
    yield started
    for cluster in started:
        for node in cluster.nodes.values():  # a paused node cannot stop
            if node.proc is not None and node.proc.returncode is None:
                node.proc.send_signal(signal.SIGCONT)
        await cluster.stop()
        for node_id, node in cluster.nodes.items():
            await asyncio.to_thread((tmp_path / f"{node_id}.log").write_text, "".join(node.output))


def committed_by(cluster: Cluster, table: str) -> str:
    """The node that commits ``table`` while all of ``cluster``'s nodes are live."""
    pmap = PartitionMap.build(1, dict(zip(cluster.ports, cluster.addresses(), strict=True)), 64)
    return pmap.committer(table)


def a_table_committed_by(cluster: Cluster, node_id: str, prefix: str) -> str:
    """A table name whose committer is ``node_id``."""
    return next(
        f"{prefix}{i}" for i in range(1000) if committed_by(cluster, f"{prefix}{i}") == node_id
    )


def status(address: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "deltaflow.cli", "cluster", "status", "--json", "--node", address],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


def history(path: Location) -> list[dict[str, Any]]:
    """Each commit's deltaflow record (committer, writers, lanes), oldest first."""
    return [
        json.loads(h["userMetadata"])["deltaflow"]
        for h in reversed(open_table(path).history())
        if h.get("userMetadata")
    ]


async def test_a_sigkilled_committer_is_replaced_and_no_key_is_lost(
    tmp_path: Path, clusters: list[Cluster]
) -> None:
    cluster = Cluster(tmp_path / "warehouse", flags=FLAGS)
    clusters.append(cluster)
    await cluster.start_all()
    client = await cluster.wait_members(3)
    victim = a_table_committer = "node-2"
    kept = a_table_committed_by(cluster, a_table_committer, "kept")
    appended = a_table_committed_by(cluster, a_table_committer, "appended")
    n, keys = 24_000, 8_000
    kill = KillAt(cluster.nodes[victim], n // 3)
    async with client:
        upserts, appends = await asyncio.gather(
            client.stream_data(
                [{"id": i % keys, "v": i} for i in range(n)],
                table=kept,
                key="id",
                options=SMALL,
                on_ack=kill,
            ),
            append_ids(client, appended, n, SMALL),
        )
    assert kill.killed_at is not None
    assert upserts.items_acked == appends.items_acked == n
    warehouse = cluster.warehouse
    assert isinstance(warehouse, Path)
    assert {k: r["v"] for k, r in read_delta(warehouse / kept).items()} == {
        k: n - keys + k for k in range(keys)
    }
    ids = [r["id"] for r in read_all(warehouse / appended)]
    assert len(ids) == n and set(ids) == set(range(n))
    # The groups were committed by the victim, then by its successor, for every writer.
    records = history(warehouse / kept)
    committers = [r["node"] for r in records]
    assert victim in committers
    successor = committers[-1]
    assert successor != victim
    # Writers' groups were committed by the committer, not by the writers themselves.
    assert any(set(r.get("writers", [])) - {r["node"]} for r in records)
    # The survivors name the successor as the table's committer.
    seen = await asyncio.to_thread(status, cluster.nodes["node-1"].address)
    assert seen["tables"][kept]["committer"] == successor
    assert victim not in {m["node"] for m in seen["members"] if m["live"]}


@pytest.mark.timeout(300)
async def test_a_paused_committer_s_late_commit_does_not_land(
    s3_server: S3Server, bucket: str, tmp_path: Path, clusters: list[Cluster]
) -> None:
    """node-3 commits the table; it stops itself (SIGSTOP) in its first combined commit, its
    marks read and its version chosen. The others find it dead, the writers resend their
    groups to the next committer, the stream completes. Then node-3 resumes: the version it
    chose is taken; it reads the marks again and answers ``applied``: nothing lands twice."""
    warehouse = f"{bucket}/warehouse"
    cluster = Cluster(
        warehouse, flags=FLAGS, env=s3_server.storage_options, scratch=tmp_path / "scratch"
    )
    clusters.append(cluster)
    await cluster.start_all()
    name = a_table_committed_by(cluster, "node-3", "paused")
    # Created first, so every group goes to node-3, and its first combined commit pauses it.
    await asyncio.to_thread(
        create_table, location(warehouse, s3_server.storage_options), name, schema="id:long"
    )
    paused = await cluster.restart(
        "node-3", env={"DELTAFLOW_FAULT_STOP_BEFORE_COMBINED_COMMIT": "1"}
    )
    n = 20_000
    # The client gives up on the paused node's own batches after 10 s and sends them to the
    # partitions' new owners.
    options = dataclasses.replace(FAILOVER_OPTIONS, ack_timeout=10.0, page_size=100)
    summary = await cluster.append_ids(name, n, options)
    assert summary.items_acked == n
    assert process_state(paused) == "T", "node-3 never paused: the test proved nothing"
    path = location(f"{warehouse}/{name}", s3_server.storage_options)
    before = await asyncio.to_thread(history, path)
    assert paused.proc is not None
    paused.proc.send_signal(signal.SIGCONT)
    # Its late commit: refused (the version it chose is taken), or in doubt when the pause
    # caught its write in flight; either way the marks decide, and nothing lands twice. (Its
    # store client may first wait out its retries on a connection the pause broke: up to the
    # store client's 3-minute retry window.)
    for _ in range(900):
        if await late_attempts(paused) >= 1:
            break
        await asyncio.sleep(0.2)
    assert await late_attempts(paused) >= 1, "node-3 never tried its late commit:\n" + "".join(
        paused.output[-40:]
    )
    ids = [r["id"] for r in read_all(path)]
    assert len(ids) == n and set(ids) == set(range(n))
    assert await asyncio.to_thread(history, path) == before


async def test_a_writer_killed_between_prepare_and_commit_leaves_only_files_vacuum_removes(
    tmp_path: Path, clusters: list[Cluster]
) -> None:
    """node-2 writes its second group's files and dies before sending them to the committer
    (node-1). The client resends node-2's batches to the new owners; every id lands once, and
    the files node-2 wrote are referenced by no version: ``vacuum`` deletes them."""
    cluster = Cluster(tmp_path / "warehouse", flags=FLAGS)
    clusters.append(cluster)
    await cluster.start_all()
    name = a_table_committed_by(cluster, "node-1", "orphans")
    dying = await cluster.restart("node-2", env={"DELTAFLOW_FAULT_KILL_COMMIT_PREPARED": "2"})
    n = 12_000
    summary = await cluster.append_ids(name, n, SMALL)
    assert summary.items_acked == n
    assert await asyncio.wait_for(dying.wait(), 30) == -9
    path = tmp_path / "warehouse" / name
    ids = [r["id"] for r in read_all(path)]
    assert len(ids) == n and set(ids) == set(range(n))
    orphans = await asyncio.to_thread(_unreferenced, path)
    assert orphans, "node-2 left no files: it died elsewhere"
    doomed = await asyncio.to_thread(
        maintenance.vacuum,
        tmp_path / "warehouse",
        name,
        retention_hours=0,
        dry_run=False,
        force=True,
    )
    assert orphans <= set(doomed)
    assert await asyncio.to_thread(_unreferenced, path) == set()
    ids = [r["id"] for r in read_all(path)]
    assert len(ids) == n and set(ids) == set(range(n))


async def test_a_writer_that_cannot_reach_the_committer_commits_its_groups_itself(
    tmp_path: Path, clusters: list[Cluster]
) -> None:
    """node-2's commit calls to node-1, the table's committer, go unanswered while node-1
    stays a live member (a one-way cut). After the failure timeout node-2 commits its groups
    itself, beside node-1's commits of its own: every key at its last value, the stream
    whole, and versions committed by each node."""
    cluster = Cluster(tmp_path / "warehouse", count=2, flags=FLAGS)
    clusters.append(cluster)
    first = await cluster.start("node-1")
    await cluster.start("node-2", env={"DELTAFLOW_FAULT_UNREACHABLE_COMMITS": first.address})
    client = await cluster.wait_members(2)
    name = a_table_committed_by(cluster, "node-1", "cut")
    n, keys = 4_000, 1_000
    async with client:
        # node-1 creates the table, so every group of node-2's goes to the committer (a
        # group that creates a table commits it where it was written).
        pmap = client._router._map
        first_key = next(
            k for k in range(keys) if pmap.owners[partition_of(k, pmap.partitions)] == "node-1"
        )
        await client.stream_data([{"id": first_key, "v": -1}], table=name, key="id")
        summary = await client.stream_data(
            [{"id": i % keys, "v": i} for i in range(n)], table=name, key="id", options=SMALL
        )
    assert summary.items_acked == n
    path = tmp_path / "warehouse" / name
    assert {k: r["v"] for k, r in read_delta(path).items()} == {
        k: n - keys + k for k in range(keys)
    }
    committers = {r["node"] for r in await asyncio.to_thread(history, path)}
    assert committers == {"node-1", "node-2"}, committers
    assert any("unreachable for" in line for line in cluster.nodes["node-2"].output)


def _unreferenced(path: Path) -> set[str]:
    """The table's data files no commit of its log adds."""
    referenced = {
        json.loads(line)["add"]["path"]
        for commit in (path / "_delta_log").glob("*.json")
        for line in commit.read_text().splitlines()
        if line.startswith('{"add"')
    }
    return {str(f.relative_to(path)) for f in path.rglob("*.parquet")} - referenced


async def test_spark_and_delta_rs_nodes_write_one_table_through_one_committer(
    s3_server: S3Server, bucket: str, tmp_path: Path, clusters: list[Cluster]
) -> None:
    warehouse = f"{bucket}/warehouse"
    cluster = Cluster(
        warehouse,
        count=2,
        flags=NODE_FLAGS[:6],
        env=s3_server.storage_options,
        scratch=tmp_path / "scratch",
    )
    clusters.append(cluster)
    cluster.flags = [*NODE_FLAGS[:6], "--engine", "delta-rs"]
    await cluster.start("node-1")
    cluster.flags = [*NODE_FLAGS, "--engine", "spark"]
    await cluster.start("node-2")
    client = await cluster.wait_members(2)
    name = a_table_committed_by(cluster, "node-1", "mixed")
    n, keys = 6_000, 2_000
    async with client:
        await client.stream_data(
            [{"id": i % keys, "v": i} for i in range(n)], table=name, key="id", options=SMALL
        )
    path = location(f"{warehouse}/{name}", s3_server.storage_options)
    assert {k: r["v"] for k, r in read_delta(path).items()} == {
        k: n - keys + k for k in range(keys)
    }
    records = await asyncio.to_thread(history, path)
    combined = [r for r in records if "writers" in r]
    assert combined and {r["node"] for r in combined} == {"node-1"}
    assert {w for r in combined for w in r["writers"]} == {"node-1", "node-2"}


async def late_attempts(node: Any) -> float:
    return await metric(node, "deltaflow_commit_conflicts_total") + await metric(
        node, "deltaflow_combined_commits_in_doubt_total"
    )
