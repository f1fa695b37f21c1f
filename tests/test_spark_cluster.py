"""A Spark standalone cluster as the table engine: a real master and worker started from the
installed pyspark on 127.0.0.1, shared by two node processes, each with a bounded share."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import deltaflow
from deltaflow.testing import NodeProcess, free_port, wait_for_members

from .support import read_delta

pytestmark = pytest.mark.slow


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _status(web: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{web}/json/", timeout=5) as resp:
        return dict(json.load(resp))


class SparkCluster:
    """One master and one worker (2 cores, 2 GiB), stopped by pid."""

    def __init__(self, tmp: Path) -> None:
        self.port, self.web_port, self.worker_port = free_port(), free_port(), free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.web = f"http://127.0.0.1:{self.web_port}"
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def _start(self, name: str, *args: str) -> None:
        env = {**os.environ, "SPARK_HOME": str(_spark_home()), "SPARK_LOCAL_IP": "127.0.0.1"}
        env["SPARK_WORKER_DIR"] = str(self.tmp / "work")
        log = open(self.tmp / f"{name}.log", "wb")
        self.procs.append(
            subprocess.Popen(
                [str(_spark_home() / "bin" / "spark-class"), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )

    def start(self) -> SparkCluster:
        self._start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--webui-port", str(self.web_port),
        )  # fmt: skip
        self._until(lambda s: True, "the master's status page")
        self._start(
            "worker",
            "org.apache.spark.deploy.worker.Worker",
            "--host", "127.0.0.1",
            "--webui-port", str(self.worker_port),
            "--cores", "2",
            "--memory", "2g",
            self.url,
        )  # fmt: skip
        self._until(lambda s: s.get("aliveworkers") == 1, "a live worker")
        return self

    def _until(self, ready: Any, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + 90
        while True:
            try:
                status = _status(self.web)
                if ready(status):
                    return status
            except OSError:
                pass
            if time.monotonic() > deadline:
                logs = [(self.tmp / f"{n}.log").read_text()[-2000:] for n in ("master", "worker")]
                raise AssertionError(f"no {what} within 90 s: {logs}")
            time.sleep(0.2)

    def status(self) -> dict[str, Any]:
        return _status(self.web)

    def worker_status(self) -> dict[str, Any]:
        return _status(f"http://127.0.0.1:{self.worker_port}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    cluster = SparkCluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _node(cluster: SparkCluster, node_id: str, warehouse: Path, peers: list[str], port: int,
          *extra: str) -> NodeProcess:  # fmt: skip
    return NodeProcess(
        node_id,
        warehouse,
        peers=peers,
        port=port,
        spark_master=cluster.url,
        extra=[
            "--engine", "spark",
            "--spark-writer", "sql",  # every group a MERGE: a Spark job on the executors
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
    nodes = [
        _node(spark_cluster, f"node-{i}", warehouse, [a for a in addresses if a != own], port)
        for i, (port, own) in enumerate(zip(ports, addresses, strict=True), 1)
    ]
    try:
        await asyncio.gather(*(n.start(timeout=180) for n in nodes))
        await wait_for_members(addresses)
        status = spark_cluster.status()
        granted = {app["name"]: app["cores"] for app in status["activeapps"]}
        assert granted == {"deltaflow-node-1": 1, "deltaflow-node-2": 1}, "a bounded share each"

        rows = [{"id": i, "v": float(i)} for i in range(2000)]
        async with deltaflow.connect(addresses) as client:
            summary = await client.stream_data(rows, table="t", key="id")
        assert (summary.items_acked, summary.items_failed) == (2000, 0)
        # The groups were MERGEs: Spark jobs, which a standalone driver runs on its executors
        # only; the worker runs one for each node's application.
        apps = {app["id"] for app in status["activeapps"]}
        running = spark_cluster.worker_status()["executors"]
        assert sorted(e["appid"] for e in running) == sorted(apps)
        table = read_delta(warehouse / "t")
        assert {k: r["v"] for k, r in table.items()} == {i: float(i) for i in range(2000)}
        # The worker's two cores are both granted: a third node gets no executor, and its
        # start fails with an error saying why instead of waiting forever.
        third = _node(spark_cluster, "node-3", tmp_path / "other", [], free_port(),
                      "--spark-executor-wait", "5")  # fmt: skip
        with pytest.raises(RuntimeError, match="gave this node no executor within 5 s"):
            await third.start(timeout=120)
        await third.stop()
    finally:
        for node in nodes:
            await node.stop()
