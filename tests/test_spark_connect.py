"""Spark Connect as the table engine, with nodes in processes of their own: a node with no JVM
(``deltaflow[connect]`` only) commits through a real Connect server, and a node that crashes
between a commit and its ack does not get the commit applied twice. The table tests run on
the Connect engine too (``spark-connect`` in ``support.EVERY_ENGINE``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

import deltaflow
from deltaflow import StreamerOptions
from deltaflow.testing import NodeProcess, free_port, wait_for_members
from deltaflow.testing.spark_servers import ConnectServer

from .support import append_ids, assert_appended_once, commit_writers

pytestmark = pytest.mark.slow

#: The environment ``make setup`` builds with ``pip install -e '.[connect]'``: pyspark-client,
#: no pyspark jars, no JVM needed.
CONNECT_PYTHON = Path(__file__).parent.parent / ".venv-connect" / "bin" / "python"
FLAGS = ["--engine", "spark", "--receiver", "deltaflow.testing.AppendRows",
         "--heartbeat-interval", "0.3", "--failure-timeout", "3.0"]  # fmt: skip
OPTIONS = StreamerOptions(retry_initial_backoff=0.05, retry_max_backoff=1.0, retry_limit=40)


def _without_java() -> dict[str, str]:
    """The environment minus every way to a JVM: no ``java`` on PATH, no JAVA_HOME."""
    path = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "java").exists()]
    return {"PATH": os.pathsep.join(path), "JAVA_HOME": "/nonexistent", "SPARK_HOME": ""}


def _nodes(server: ConnectServer, warehouse: Path, count: int, **each: Any) -> list[NodeProcess]:
    ports = [free_port() for _ in range(count)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    return [
        NodeProcess(
            f"node-{i}",
            warehouse,
            peers=[a for a in addresses if a != own],
            port=port,
            spark_master=server.url,
            extra=FLAGS,
            **each.get(f"node-{i}", {}),
        )
        for i, (port, own) in enumerate(zip(ports, addresses, strict=True), 1)
    ]


async def test_a_node_without_a_jvm_commits_through_the_connect_server(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    if not CONNECT_PYTHON.exists():
        pytest.fail(f"{CONNECT_PYTHON} is missing: `make setup` builds it")
    warehouse = tmp_path / "warehouse"
    jvm_less = {"python": str(CONNECT_PYTHON), "env": _without_java()}
    nodes = _nodes(connect_server, warehouse, 2, **{"node-1": jvm_less})
    try:
        await asyncio.gather(*(n.start(timeout=120) for n in nodes))
        await wait_for_members([n.address for n in nodes])
        rows = [{"id": i, "v": float(i)} for i in range(3000)]
        async with deltaflow.connect([nodes[0].address]) as client:
            first = await client.stream_data(rows, table="t", key="id", options=OPTIONS)
            again = [{"id": i, "v": -1.0} for i in range(0, 3000, 3)]
            second = await client.stream_data(again, table="t", key="id", options=OPTIONS)
    finally:
        for node in nodes:
            await node.stop()
    assert (first.items_acked, second.items_acked) == (3000, 1000)
    table = {
        r["id"]: r["v"] for r in DeltaTable(str(warehouse / "t")).to_pyarrow_table().to_pylist()
    }
    assert table == {i: (-1.0 if i % 3 == 0 else float(i)) for i in range(3000)}
    # Both nodes' groups were committed by the server's Spark, the JVM-less one's included.
    writers = commit_writers(warehouse / "t")
    assert set(writers) == {"node-1", "node-2"}
    assert all(info.startswith("Apache-Spark/4") for info in writers.values()), writers


async def test_a_crash_between_commit_and_ack_on_connect_is_not_applied_twice(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    warehouse = tmp_path / "warehouse"
    crash = {"env": {"DELTAFLOW_FAULT_KILL_AFTER_COMMIT": "1"}}
    nodes = _nodes(connect_server, warehouse, 2, **{"node-2": crash})
    n = 20_000
    try:
        await asyncio.gather(*(node.start(timeout=120) for node in nodes))
        await wait_for_members([node.address for node in nodes])
        async with deltaflow.connect([nodes[0].address]) as client:
            summary = await append_ids(client, "crash", n, OPTIONS)
        # It did crash, right after its commit.
        assert await asyncio.wait_for(nodes[1].wait(), 30) == -9
    finally:
        for node in nodes:
            await node.stop()
    assert summary.items_acked == n
    assert_appended_once(warehouse / "crash", n, committed_by="node-2")
