"""Shared fixtures: one SparkSession per run, real nodes on 127.0.0.1, waiting helpers. Plain
helpers (table readers, engine names, the table tests' workload) are in ``support.py``, which
test modules import; nothing imports this file."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from blockbuster import blockbuster_ctx

from deltaflow.server import Node, NodeConfig, start_local_nodes
from deltaflow.spark_integration import SparkConfig, get_spark
from deltaflow.storage.paths import Location, location
from deltaflow.testing.object_store import S3Server
from deltaflow.testing.spark_servers import ConnectServer, SparkCluster

from .support import (
    ON_S3,
    SPARK_SERVERS,
    TEST_RECEIVERS,
    TEST_SPARK,
    Eventually,
    StartCluster,
    T,
    Within,
    engine_options,
)

#: The Connect server's share of ``spark_cluster``: the cluster tests' nodes take the rest.
CONNECT_SHARE = {
    "spark.cores.max": "1",
    "spark.executor.cores": "1",
    "spark.executor.memory": "1g",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``DELTAFLOW_TEST_ENGINES=spark,spark-sql``: only the tests run on those engines (the
    table tests again on a standalone cluster, see ``test_spark_cluster.py``)."""
    engines = os.environ.get("DELTAFLOW_TEST_ENGINES")
    if not engines:
        return
    wanted = set(engines.split(","))
    keep, drop = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        on = params.params.get("engine") if params is not None else None
        (keep if on in wanted else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.fixture
def within() -> Within[Any]:
    """``await within(awaitable, seconds, what)``: the awaitable's result, or a test failure
    naming ``what`` if it takes longer than ``seconds`` (never the suite's global timeout)."""

    async def within(awaitable: Awaitable[T], seconds: float, what: str) -> T:
        try:
            async with asyncio.timeout(seconds):
                return await awaitable
        except TimeoutError:
            pytest.fail(f"not within {seconds} s: {what}")

    return within


@pytest.fixture
def eventually() -> Eventually:
    """``await eventually(condition, what)``: until ``condition()`` holds (checked every 10
    ms, for state that sets no event), or a test failure naming ``what`` after 10 s."""

    async def eventually(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"not within {seconds} s: {what}")
            await asyncio.sleep(0.01)

    return eventually


@pytest.fixture(scope="session")
def spark() -> Any:
    return get_spark(TEST_SPARK)


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """A standalone Spark master and one worker (4 cores, 4 GiB) on 127.0.0.1, for the run:
    the Spark Connect server's jobs and the cluster tests' nodes share it."""
    with SparkCluster(tmp_path_factory.mktemp("spark-cluster"), cores=4, memory="4g") as cluster:
        yield cluster.start()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The S3-compatible server ``make setup`` installs (versitygw), on 127.0.0.1, for the
    run; each test gets a fresh bucket from ``bucket``."""
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        yield server.start()


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    """A fresh bucket on ``s3_server``: its ``s3://`` URI."""
    return s3_server.create_bucket(f"t-{uuid.uuid4().hex[:16]}")


@pytest.fixture(scope="session")
def connect_server(
    spark: Any, spark_cluster: SparkCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConnectServer]:
    """A Spark Connect server with Delta on 127.0.0.1, its jobs on ``spark_cluster`` (one
    core of it), for the run; the ``spark-connect`` engine's settings point at it. After the
    classic session (``spark``): a Connect client's gRPC in a process keeps a classic driver
    from starting after it."""
    directory = tmp_path_factory.mktemp("spark-connect")
    with ConnectServer(directory, master=spark_cluster.url, settings=CONNECT_SHARE) as server:
        server.start()
        SPARK_SERVERS["connect"] = SparkConfig(master=server.url, shuffle_partitions=2)
        yield server
        SPARK_SERVERS.pop("connect")


@pytest.fixture
def warehouse(tmp_path: Path, request: pytest.FixtureRequest) -> Location:
    """The test's warehouse: a fresh directory, or for an engine of ``support.ON_S3`` a
    prefix in a fresh bucket of the S3 server."""
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("engine") in ON_S3:
        server: S3Server = request.getfixturevalue("s3_server")
        return location(f"{request.getfixturevalue('bucket')}/warehouse", server.storage_options)
    return tmp_path / "warehouse"


@pytest.fixture
def engine() -> str:
    """The table engine of the ``cluster`` nodes; a module overrides it to run on both."""
    return "spark"


@pytest.fixture
async def start_cluster() -> AsyncIterator[StartCluster]:
    """``await start_cluster(warehouse, count=2, **config)``: ``count`` nodes on 127.0.0.1,
    each seeing all the others before it returns (``engine`` may be any name
    :func:`support.engine_options` knows). A test may stop them itself; whatever it left
    running is stopped after it."""
    started: list[Node] = []

    async def start_cluster(warehouse: Path, count: int = 2, **config: Any) -> list[Node]:
        config.setdefault("receivers", TEST_RECEIVERS)
        config.update(engine_options(config.pop("engine", "spark")))
        base = NodeConfig(
            node_id="node-1",
            warehouse=warehouse,
            port=0,
            heartbeat_interval=0.2,
            # Generous: in-process nodes share the test's event loop with Spark-heavy work,
            # and a stall must not look like a dead peer (failover has its own tests with
            # processes).
            failure_timeout=10.0,
            **config,
        )
        nodes = await start_local_nodes(count, base)
        started.extend(nodes)
        return nodes

    yield start_cluster
    for node in reversed(started):
        await node.stop()  # a no-op for a node the test stopped


@pytest.fixture
async def cluster(
    spark: Any, warehouse: Path, engine: str, start_cluster: StartCluster
) -> AsyncIterator[list[Node]]:
    """Two real nodes sharing one warehouse."""
    nodes = await start_cluster(warehouse, engine=engine)
    yield nodes
    for node in reversed(nodes):
        await node.stop()


@pytest.fixture(autouse=True)
def no_blocking_calls_on_the_event_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test when deltaflow's code makes a blocking call (file or socket I/O, a sleep,
    a lock wait) on a running event loop, where it would stall every stream of the process.
    Blocking work belongs in a worker thread. Code of the tests themselves is not watched."""
    with blockbuster_ctx("deltaflow", excluded_modules=["deltaflow.testing"]) as watch:
        for function in watch.functions.values():
            # The classes an operator names are imported once, as a node is built.
            function.can_block_in("deltaflow/receivers/registry.py", "register_names")
            # TLS settings name their files as they are made (one stat each).
            function.can_block_in("deltaflow/security.py", "_readable")
            function.can_block_in("deltaflow/server/side_inputs/loading.py", "load_side_inputs")
            # A test changing a side input's source from a stream's callback, on purpose.
            function.can_block_in("tests/test_side_inputs.py", "replace_file")
            # Spark reading a table on the S3 server for a test, after its stream.
            function.can_block_in("tests/support.py", "read_spark")
        yield
