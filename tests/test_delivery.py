"""Delivery across a dropped connection, and what the operator sees of the cluster."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import deltaflow
from deltaflow import StreamerOptions
from deltaflow.server import Node
from deltaflow.testing import ConnectionDropper

from .support import Eventually, StartCluster, echo_stream, read_delta


async def test_lost_ack_is_resent_and_not_applied_twice(cluster: list[Node]) -> None:
    dropper = ConnectionDropper(after_batches=3, limit=2)
    items = list(range(3000))
    opts = StreamerOptions(page_size=100, retry_initial_backoff=0.01)
    summary, results = await echo_stream(cluster[0].address, items, opts, dropper)
    assert dropper.dropped == 2
    assert summary.items_acked == len(items)
    assert summary.batches_retried >= 2
    stats = [n.statistics().dispatcher for n in cluster]
    # Every item applied exactly once; the resends were recognised as duplicates.
    assert sum(s.items_applied for s in stats) == len(items)
    assert sum(s.duplicates for s in stats) >= 1
    assert set(results) == set(items)


async def test_table_stream_survives_dropped_connections(
    cluster: list[Node], warehouse: Path
) -> None:
    dropper = ConnectionDropper(after_batches=2, limit=3)
    rows = [{"id": i % 500, "v": i} for i in range(2000)]
    async with deltaflow.connect([cluster[1].address], connection_factory=dropper) as client:
        summary = await client.stream_data(
            rows,
            table="dropped",
            key="id",
            options=StreamerOptions(page_size=100, retry_initial_backoff=0.01),
        )
    assert summary.items_acked == 2000
    table = read_delta(warehouse / "dropped")
    assert {k: r["v"] for k, r in table.items()} == {k: 1500 + k for k in range(500)}


async def test_cluster_status_shows_members_and_partition_map(cluster: list[Node]) -> None:
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "deltaflow.cli", "cluster", "status", "--node", cluster[1].address],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "64 partitions" in out
    for node in cluster:
        assert node.node_id in out and node.address in out
        owned = node.statistics().owned_partitions
        assert f"partitions={owned}" in out
    assert "live" in out and "DEAD" not in out
    assert sum(n.statistics().owned_partitions for n in cluster) == 64


def test_public_modules_declare_their_exports() -> None:
    import importlib

    for name in (
        "deltaflow",
        "deltaflow.client",
        "deltaflow.server",
        "deltaflow.receivers",
        "deltaflow.errors",
        "deltaflow.protocol",
        "deltaflow.partitioning",
        "deltaflow.spark_integration",
        "deltaflow.tables",
        "deltaflow.engines",
        "deltaflow.engines.options",
        "deltaflow.testing",
    ):
        module = importlib.import_module(name)
        assert module.__all__, name
        for export in module.__all__:
            assert hasattr(module, export), f"{name}.{export}"
    assert (Path(deltaflow.__file__).parent / "py.typed").exists()


def test_importing_the_client_does_not_import_spark() -> None:
    code = (
        "import sys, deltaflow, deltaflow.client; "
        "assert 'pyspark' not in sys.modules, 'pyspark imported'; "
        "assert 'deltaflow.server' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_table_cli_compacts_and_shows_history(cluster: list[Node], warehouse: Path) -> None:
    async with deltaflow.connect([cluster[0].address]) as client:
        for round_ in range(3):  # three streams of new keys: new files in every bucket
            await client.stream_data(
                [{"id": round_ * 200 + i, "v": round_} for i in range(200)],
                table="small",
                key="id",
            )

    async def cli(*args: str) -> str:
        done = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "deltaflow.cli",
                "table",
                *args,
                "--warehouse",
                str(warehouse),
                "--table",
                "small",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    history = await cli("history")
    assert history.splitlines()[0].split()[:4] == ["VERSION", "TIME", "OPERATION", "NODE"]
    assert "node-1" in history or "node-2" in history
    before = read_delta(warehouse / "small")
    out = await cli("optimize")
    # Compaction works per bucket: at most one file per bucket the rows fall in remains.
    compacted = re.search(r"(\d+) files compacted into (\d+)", out)
    assert compacted is not None, out
    assert int(compacted[1]) > int(compacted[2]) >= 1
    assert read_delta(warehouse / "small") == before
    assert "table small: 600 rows" in await cli("show")


async def test_a_draining_node_tells_its_clients_where_its_partitions_went(
    warehouse: Path, start_cluster: StartCluster, eventually: Eventually
) -> None:
    nodes = await start_cluster(warehouse, 3, engine="delta-rs")
    echo = {"key": lambda i: i, "receiver": "deltaflow.testing.Echo"}
    async with deltaflow.connect([nodes[0].address]) as client:
        await client.stream_data(range(600), **echo)  # connected to all three
        assert "node-2" in client.partition_map.addresses
        await nodes[1].drain()
        # Pushed to the client as the node drained: it sent nothing to learn it.
        await eventually(
            lambda: "node-2" not in client.partition_map.addresses, "the drained node's map"
        )
        summary = await client.stream_data(range(600, 1200), **echo)
    assert summary.batches_retried == 0  # no batch went to node-2 to be redirected
    assert set(summary.per_node) == {"node-1", "node-3"}
    assert nodes[1].statistics().state == "stopped"
