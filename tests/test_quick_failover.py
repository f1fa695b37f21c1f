"""A SIGKILLed node is noticed at once, not at the next heartbeat: a failed call to it (a
client that could not reach it, a commit call to it as a table's committer) makes its peers
poll it now. The nodes here poll every 20 s, so only that makes the stream end in seconds."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from deltaflow.partitioning import partition_of
from deltaflow.testing import wait_for_members

from .support import FAILOVER_OPTIONS, Cluster, read_delta

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

#: Polls 20 s apart: without a hint a dead peer stays a member for 20 s or more.
FLAGS = (
    "--engine",
    "delta-rs",
    "--receiver",
    "deltaflow.testing.AppendRows",
    "--heartbeat-interval",
    "20",
    "--failure-timeout",
    "40",
)
#: Seconds from the SIGKILL to the stream's end; a heartbeat's detection takes 20 or more.
NOTICED_WITHIN = 8.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nodes(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("quick") / "warehouse", count=2, flags=FLAGS)
    # One after the other: node-2's first poll finds node-1 up, and node-1 polls it back at
    # once (started together, both may poll before the other listens, and wait 20 s).
    await c.start("node-1")
    yield c
    await c.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def cluster(nodes: Cluster) -> Cluster:
    """Both nodes up, each counting the other (node-2 started again after a test killed it:
    its first poll makes node-1 poll it back)."""
    if "node-2" in nodes.nodes:
        await nodes.nodes["node-2"].stop()
    await nodes.start("node-2")
    await wait_for_members(nodes.addresses())
    return nodes


def table_committed_by(pmap: Any, node: str, prefix: str) -> str:
    """A table name whose committer is ``node`` in ``pmap``."""
    return next(f"{prefix}{i}" for i in range(100) if pmap.committer(f"{prefix}{i}") == node)


async def stream_after_killing_node_2(
    cluster: Cluster, client: Any, ids: list[int], table: str
) -> tuple[Any, float]:
    """SIGKILL node-2, then stream ``ids``: the summary, and seconds from the kill to its end."""
    cluster.nodes["node-2"].kill()
    killed = time.monotonic()
    rows = [{"id": i} for i in ids]
    summary = await client.stream_data(rows, table=table, key="id", options=FAILOVER_OPTIONS)
    return summary, time.monotonic() - killed


async def test_a_client_that_cannot_reach_a_killed_node_makes_its_peer_take_over(
    cluster: Cluster,
) -> None:
    client = await cluster.wait_members(2)
    async with client:
        pmap = client.partition_map
        # A table node-1 commits: no commit call goes to node-2; only the client's calls do.
        table = table_committed_by(pmap, "node-1", "hinted")
        # Rows of both nodes' partitions: those of node-2 find nothing listening.
        summary, took = await stream_after_killing_node_2(cluster, client, list(range(200)), table)
    assert {pmap.owners[partition_of(i, pmap.partitions)] for i in range(200)} == {
        "node-1",
        "node-2",
    }
    assert summary.items_acked == 200 and set(summary.per_node) == {"node-1"}
    assert took < NOTICED_WITHIN, f"node-2's partitions moved {took:.1f}s after its SIGKILL"
    assert sorted(read_delta(cluster.warehouse / table)) == list(range(200))


async def test_a_failed_commit_call_makes_the_writer_take_over_from_a_killed_committer(
    cluster: Cluster,
) -> None:
    client = await cluster.wait_members(2)
    async with client:
        pmap = client.partition_map
        table = table_committed_by(pmap, "node-2", "committed")
        # Only node-1's rows: the client never calls node-2; node-1's commit call does.
        ids = [i for i in range(2000) if pmap.owners[partition_of(i, pmap.partitions)] == "node-1"]
        await client.stream_data([{"id": ids[0]}], table=table, key="id", options=FAILOVER_OPTIONS)
        summary, took = await stream_after_killing_node_2(cluster, client, ids[1:], table)
    assert summary.items_acked == len(ids) - 1
    assert took < NOTICED_WITHIN, f"the committer's table moved {took:.1f}s after its SIGKILL"
    assert sorted(read_delta(cluster.warehouse / table)) == ids
