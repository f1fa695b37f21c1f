"""How fast a dead node's partitions move, and that a slow one is not taken for dead: three
delta-rs node processes on 127.0.0.1 with the default heartbeat (0.5 s) and failure timeout
(3 s)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from deltaflow.client.router import fetch_cluster

from .support import FAILOVER_OPTIONS, Cluster, FailoverWatch, read_delta

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

FLAGS = ("--engine", "delta-rs", "--heartbeat-interval", "0.5", "--failure-timeout", "3.0")
DOWN = "is down: connections refused"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("detection") / "warehouse", flags=FLAGS)
    await c.start_all()
    yield c
    await c.stop()


def logged(cluster: Cluster, node_id: str, text: str) -> list[str]:
    return [line for line in cluster.nodes[node_id].output if text in line]


async def test_a_paused_node_is_suspected_but_not_taken_for_dead(cluster: Cluster) -> None:
    """A node too busy to answer (here: SIGSTOPped for half the failure timeout) keeps its
    partitions: its kernel still accepts connections, so nothing confirms the suspicion."""
    client = await cluster.wait_members(3)
    await client.close()
    paused = cluster.nodes["node-3"]
    assert paused.proc is not None
    os.kill(paused.proc.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(1.5)  # the pause under test, not a synchronisation
        for other in ("node-1", "node-2"):
            body = await fetch_cluster(cluster.nodes[other].address, None, 5.0, None)
            assert set(body["map"]["owners"]) == {"node-1", "node-2", "node-3"}, other
    finally:
        os.kill(paused.proc.pid, signal.SIGCONT)
    for survivor in ("node-1", "node-2"):
        assert not logged(cluster, survivor, DOWN), f"{survivor} took the paused node for dead"


async def test_a_killed_owner_is_replaced_well_within_the_failure_timeout(
    cluster: Cluster,
) -> None:
    n = 200_000
    rows = [{"id": i % 50_000, "v": i} for i in range(n)]
    client = await cluster.wait_members(3)
    watch = FailoverWatch(cluster.nodes["node-2"], n // 5, client.partition_map, grace=0.2)
    async with client:
        summary = await client.stream_data(
            rows, table="detected", key="id", on_ack=watch, options=FAILOVER_OPTIONS
        )
    assert summary.items_acked == n and summary.items_failed == 0
    table = read_delta(Path(str(cluster.warehouse)) / "detected")
    assert {k: r["v"] for k, r in table.items()} == {k: 150_000 + k for k in range(50_000)}
    failover = watch.failover
    print(f"\nfailover: SIGKILL to first ack by a new owner = {failover:.2f}s")  # noqa: T201
    # Both survivors confirmed the death by refused connections, not by the 3 s timeout.
    for survivor in ("node-1", "node-3"):
        assert logged(cluster, survivor, f"peer node-2 at {cluster.nodes['node-2'].address} {DOWN}")
    await cluster.start("node-2")  # back, for whatever runs after
    client = await cluster.wait_members(3)
    await client.close()
