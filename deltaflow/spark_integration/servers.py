"""Spark's own servers, started from the installed pyspark: a standalone master and worker, and
a Spark Connect server with Delta.

The pyspark wheel has no ``sbin/start-*.sh`` scripts, but it has ``bin/spark-class`` and
``bin/spark-submit`` and the jars these servers are made of (``spark-connect_2.13`` among
them). These functions build their command lines; ``deltaflow spark-connect`` runs the last,
and :mod:`deltaflow.testing.spark_servers` starts all three for the tests and the benchmark.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from .jars import ensure_jars
from .session import CONNECT_DEFAULT_PORT, LOCAL_FILE_SETTINGS, SQL_SETTINGS

__all__ = [
    "CONNECT_SERVER_CLASS",
    "connect_server_command",
    "master_command",
    "spark_env",
    "spark_home",
    "worker_command",
]

CONNECT_SERVER_CLASS: Final = "org.apache.spark.sql.connect.service.SparkConnectServer"


def spark_home() -> Path:
    """The installed pyspark's directory, which is a Spark home (``bin``, ``jars``)."""
    import pyspark

    return Path(pyspark.__file__).parent


def spark_env(host: str = "127.0.0.1") -> dict[str, str]:
    """The environment Spark's launch scripts want: its home, and the address to bind."""
    return {**os.environ, "SPARK_HOME": str(spark_home()), "SPARK_LOCAL_IP": host}


def master_command(*, host: str, port: int, web_port: int) -> list[str]:
    """A standalone master on ``host:port``, its status page (``/json/``) on ``web_port``."""
    return [
        str(spark_home() / "bin" / "spark-class"),
        "org.apache.spark.deploy.master.Master",
        "--host", host,
        "--port", str(port),
        "--webui-port", str(web_port),
    ]  # fmt: skip


def worker_command(master: str, *, host: str, web_port: int, cores: int, memory: str) -> list[str]:
    """A standalone worker offering ``cores`` and ``memory`` to the applications of
    ``master`` (``spark://HOST:PORT``)."""
    return [
        str(spark_home() / "bin" / "spark-class"),
        "org.apache.spark.deploy.worker.Worker",
        "--host", host,
        "--webui-port", str(web_port),
        "--cores", str(cores),
        "--memory", memory,
        master,
    ]  # fmt: skip


def connect_server_command(
    *,
    host: str = "127.0.0.1",
    port: int = CONNECT_DEFAULT_PORT,
    master: str = "local[*]",
    driver_memory: str = "2g",
    settings: Mapping[str, str] | None = None,
) -> list[str]:
    """A Spark Connect server with Delta on ``host:port``, its jobs run by ``master``.

    The server is a Spark driver: Delta's jars on its class path, Delta's SQL extension and
    catalog, deltaflow's SQL settings as defaults for every client session, and the fast
    ``file:`` settings (safe because deltaflow's nodes hold the table's commit atomicity around
    every commit). It reads the nodes' staging files and the warehouse by the paths the nodes
    give, so it must see them at the same paths (docs/spark.md).
    """
    jars = [*ensure_jars(), *sorted((spark_home() / "jars").glob("spark-connect_*.jar"))]
    conf: dict[str, str] = {
        "spark.connect.grpc.binding.address": host,
        "spark.connect.grpc.binding.port": str(port),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.ui.enabled": "false",
        "spark.driver.host": host,
        "spark.driver.bindAddress": host,
        **SQL_SETTINGS,
        **LOCAL_FILE_SETTINGS,
        **(settings or {}),
    }
    command = [
        str(spark_home() / "bin" / "spark-submit"),
        "--class", CONNECT_SERVER_CLASS,
        "--master", master,
        "--driver-memory", driver_memory,
        "--jars", ",".join(str(j) for j in jars),
    ]  # fmt: skip
    for name, value in conf.items():
        command += ["--conf", f"{name}={value}"]
    return [*command, "spark-internal"]
