"""Real Spark servers for tests and benchmarks, started from the installed pyspark on
127.0.0.1 and stopped by pid: a standalone cluster (a master and one worker) and a Spark
Connect server with Delta (:mod:`deltaflow.spark_integration.servers` builds their commands).

Blocking calls: start them from a fixture or a thread, not on an event loop.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .processes import free_port
from .servers import ServerProcesses, listening

__all__ = ["ConnectServer", "SparkCluster"]

_HOST = "127.0.0.1"


def _json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return dict(json.load(resp))


def _answers(read: Callable[[], object]) -> bool:
    try:
        return bool(read())
    except OSError:
        return False


class SparkCluster(ServerProcesses):
    """A standalone master and one worker offering ``cores`` and ``memory``.

    ``url`` is the master (``spark://127.0.0.1:PORT``); :meth:`status` and
    :meth:`worker_status` read their JSON status pages (applications, executors, cores used).
    """

    def __init__(self, directory: Path, *, cores: int = 2, memory: str = "2g") -> None:
        super().__init__(directory)
        self.cores, self.memory = cores, memory
        self.port, self.web_port, self.worker_port = free_port(), free_port(), free_port()
        self.url = f"spark://{_HOST}:{self.port}"
        self.web = f"http://{_HOST}:{self.web_port}"

    def start(self) -> SparkCluster:
        from ..spark_integration.servers import master_command, spark_env, worker_command

        env = {**spark_env(_HOST), "SPARK_WORKER_DIR": str(self.directory / "work")}
        self._start(
            "master", master_command(host=_HOST, port=self.port, web_port=self.web_port), env
        )
        self._until(lambda: _answers(self.status), "master status page")
        worker = worker_command(
            self.url, host=_HOST, web_port=self.worker_port, cores=self.cores, memory=self.memory
        )
        self._start("worker", worker, env)
        self._until(lambda: _answers(lambda: self.status().get("aliveworkers") == 1), "worker")
        return self

    def status(self) -> dict[str, Any]:
        return _json(f"{self.web}/json/")

    def worker_status(self) -> dict[str, Any]:
        return _json(f"http://{_HOST}:{self.worker_port}/json/")


class ConnectServer(ServerProcesses):
    """A Spark Connect server with Delta, by ``deltaflow spark-connect``; ``url`` is
    ``sc://127.0.0.1:PORT``. Its jobs run on ``master`` (``local[2]``, or a
    :class:`SparkCluster`'s ``url``)."""

    def __init__(
        self,
        directory: Path,
        *,
        master: str = "local[2]",
        driver_memory: str = "1g",
        settings: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(directory)
        self.master, self.driver_memory = master, driver_memory
        self.settings = dict(settings or {})
        self.port = free_port()
        self.url = f"sc://{_HOST}:{self.port}"

    def start(self) -> ConnectServer:
        command = [
            sys.executable, "-m", "deltaflow.cli", "spark-connect",
            "--host", _HOST,
            "--port", str(self.port),
            "--master", self.master,
            "--driver-memory", self.driver_memory,
        ]  # fmt: skip
        for name, value in self.settings.items():
            command += ["--conf", f"{name}={value}"]
        self._start("connect", command, dict(os.environ))
        self._until(lambda: listening(_HOST, self.port), "Spark Connect server")
        return self
