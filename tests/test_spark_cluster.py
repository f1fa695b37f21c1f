"""A Spark standalone cluster as the table engine: a real master and worker started from the
installed pyspark on 127.0.0.1 (the ``spark_cluster`` fixture), shared by two node processes,
each with a bounded share."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import deltaflow
from deltaflow.testing import NodeProcess, free_port, wait_for_members
from deltaflow.testing.spark_servers import SparkCluster

from .support import commit_writers, read_delta

pytestmark = pytest.mark.slow


def _node(cluster: SparkCluster, node_id: str, warehouse: Path, peers: list[str], port: int,
          *extra: str, writer: str = "sql") -> NodeProcess:  # fmt: skip
    return NodeProcess(
        node_id,
        warehouse,
        peers=peers,
        port=port,
        spark_master=cluster.url,
        extra=[
            "--engine", "spark",
            "--spark-writer", writer,  # sql: every group a MERGE, a Spark job on the executors
            "--spark-max-cores", "1",
            "--spark-executor-memory", "512m",
            "--driver-memory", "1g",
            *extra,
        ],
    )  # fmt: skip


async def test_two_nodes_share_a_standalone_cluster_and_a_third_is_refused_clearly(
    spark_cluster: SparkCluster, tmp_path: Path
) -> None:
    warehouse = tmp_path / "warehouse"
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    # node-1 MERGEs by Spark SQL; node-2 has the direct writer, which commits in its driver.
    nodes = [
        _node(spark_cluster, f"node-{i}", warehouse, [a for a in addresses if a != own], port,
              writer=writer)
        for i, (port, own, writer) in enumerate(
            zip(ports, addresses, ("sql", "direct"), strict=True), 1
        )
    ]  # fmt: skip
    try:
        await asyncio.gather(*(n.start(timeout=180) for n in nodes))
        await wait_for_members(addresses)
        status = spark_cluster.status()
        ours = [app for app in status["activeapps"] if app["name"].startswith("deltaflow-node")]
        granted = {app["name"]: app["cores"] for app in ours}
        assert granted == {"deltaflow-node-1": 1, "deltaflow-node-2": 1}, "a bounded share each"

        rows = [{"id": i, "v": float(i)} for i in range(2000)]
        async with deltaflow.connect(addresses) as client:
            summary = await client.stream_data(rows, table="t", key="id")
        assert (summary.items_acked, summary.items_failed) == (2000, 0)
        # node-1's groups were MERGEs: Spark jobs, which a standalone driver runs on its
        # executors only; the worker runs one for each node's application.
        apps = sorted(app["id"] for app in ours)
        running = spark_cluster.worker_status()["executors"]
        assert sorted(e["appid"] for e in running if e["appid"] in apps) == apps
        [merging] = [app["id"] for app in ours if app["name"] == "deltaflow-node-1"]
        logs = (spark_cluster.directory / "work" / merging).glob("*/stderr")
        assert sum(log.read_text().count("Finished task") for log in logs) > 0
        table = read_delta(warehouse / "t")
        assert set(commit_writers(warehouse / "t")) == {"node-1", "node-2"}  # both committed
        assert {k: r["v"] for k, r in table.items()} == {i: float(i) for i in range(2000)}
        # The worker's four cores: two granted to the nodes (and one to the Connect server if it
        # runs): a third node asking for three gets no executor, and its start fails with an
        # error saying why instead of waiting forever.
        third = _node(spark_cluster, "node-3", tmp_path / "other", [], free_port(),
                      "--spark-executor-wait", "5", "--spark-max-cores", "3")  # fmt: skip
        with pytest.raises(RuntimeError, match="gave this node no executor within 5 s"):
            await third.start(timeout=120)
        await third.stop()
    finally:
        for node in nodes:
            await node.stop()


#: The upsert tests (run on every engine of ``support.EVERY_ENGINE``; the source kinds and the
#: blocking facade, which differ on the client only, on delta-rs only); the other table test
#: modules add nothing the cluster changes, at a Spark job per group.
TABLE_TESTS = ["tests/test_table_upserts.py"]


def test_the_table_tests_pass_with_the_spark_engine_on_the_cluster(
    spark_cluster: SparkCluster, tmp_path: Path
) -> None:
    """The upsert tests of the Spark engine's SQL writer again, with the run's Spark on the
    standalone cluster (one core of it): in a pytest of their own, as a process has one
    classic Spark. Its MERGEs run on the cluster's executor. (The direct writer does its file
    work in the node and commits in the driver, as on ``local[*]``: the two-node test above
    runs it on the cluster.)"""
    root = Path(__file__).parent.parent
    env = {
        **os.environ,
        "DELTAFLOW_TEST_SPARK_MASTER": spark_cluster.url,
        "DELTAFLOW_TEST_ENGINES": "spark-sql",
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--basetemp={tmp_path / 'run'}", *TABLE_TESTS],
        cwd=root, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 4, summary
    assert "skipped" not in summary, summary
    # Its Spark application ran on the cluster, and the executor ran the MERGEs' tasks.
    status = spark_cluster.status()  # finished now, or about to be
    apps = status["activeapps"] + status["completedapps"]
    [app] = [a for a in apps if a["name"] == "deltaflow-tests"]
    logs = (spark_cluster.directory / "work" / app["id"]).glob("*/stderr")
    assert sum(log.read_text().count("Finished task") for log in logs) > 0
