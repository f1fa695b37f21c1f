"""Shared fixtures: one SparkSession per run, real nodes on 127.0.0.1, two table readers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from blockbuster import blockbuster_ctx

from deltaflow.server import Node, NodeConfig, start_local_nodes
from deltaflow.spark_integration import SparkConfig, get_spark

T = TypeVar("T")

TEST_SPARK = SparkConfig(master="local[2]", shuffle_partitions=2, driver_memory="2g")
TEST_RECEIVERS = (
    "deltaflow.testing.Echo",
    "deltaflow.testing.EchoStream",
    "deltaflow.testing.FailOn",
    "deltaflow.testing.AppendRows",
    "deltaflow.testing.Validate",
    "deltaflow.testing.Flaky",
    "deltaflow.testing.Concurrency",
    "deltaflow.testing.Gated",
    "deltaflow.testing.RecordOrder",
    "deltaflow.testing.TwoTables",
    "deltaflow.testing.Unconstructible",
)


Within = Callable[[Awaitable[T], float, str], Awaitable[T]]
Eventually = Callable[[Callable[[], bool], str], Awaitable[None]]


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


@pytest.fixture
def warehouse(tmp_path: Path) -> Path:
    return tmp_path / "warehouse"


def engine_options(engine: str) -> dict[str, Any]:
    """A node's settings for an engine as tests name them: ``spark`` (its direct writer),
    ``spark-sql`` (the Spark engine MERGEing every group), ``delta-rs``, or ``spark-dv`` and
    ``delta-rs-dv`` (on tables with deletion vectors: merge-on-read)."""
    if engine == "spark-sql":
        return {"engine": "spark", "spark_writer": "sql"}
    if engine.endswith("-dv"):
        return {"engine": engine.removesuffix("-dv"), "deletion_vectors": True}
    return {"engine": engine}


async def start_cluster(warehouse: Path, count: int = 2, **config: Any) -> list[Node]:
    """``count`` nodes on 127.0.0.1, each seeing all the others before this returns
    (``engine`` may be any name :func:`engine_options` knows)."""
    config.setdefault("receivers", TEST_RECEIVERS)
    config.update(engine_options(config.pop("engine", "spark")))
    base = NodeConfig(
        node_id="node-1",
        warehouse=warehouse,
        port=0,
        spark=TEST_SPARK,
        heartbeat_interval=0.2,
        # Generous: in-process nodes share the test's event loop with Spark-heavy work, and a
        # stall must not look like a dead peer (failover has its own tests with processes).
        failure_timeout=10.0,
        **config,
    )
    return await start_local_nodes(count, base)


@pytest.fixture
def engine() -> str:
    """The table engine of the ``cluster`` nodes; a module overrides it to run on both."""
    return "spark"


@pytest.fixture
async def cluster(spark: Any, warehouse: Path, engine: str) -> AsyncIterator[list[Node]]:
    """Two real nodes sharing one warehouse."""
    nodes = await start_cluster(warehouse, engine=engine)
    yield nodes
    for node in reversed(nodes):
        await node.stop()


async def echo_stream(
    address: str, items: list[Any], options: Any, connection_factory: Any = None
) -> tuple[Any, list[Any]]:
    """Stream ``items`` (each its own key) through the Echo receiver; summary and results."""
    import deltaflow

    results: list[Any] = []
    async with deltaflow.connect([address], connection_factory=connection_factory) as client:
        summary = await client.stream_data(
            items,
            key=lambda x: x,
            receiver="deltaflow.testing.Echo",
            on_result=results.append,
            options=options,
        )
    return summary, results


def read_delta(path: Path, key: str = "id") -> dict[Any, dict[str, Any]]:
    """The table as {key: row}, read by delta-rs (independent of Spark), through its query
    engine, which applies deletion vectors."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    reader = QueryBuilder().register("t", DeltaTable(str(path))).execute("SELECT * FROM t")
    rows = pa.table(reader.read_all()).to_pylist()
    table = {row[key]: row for row in rows}
    assert len(table) == len(rows), "duplicate keys in the table"
    return table


def read_spark(spark: Any, path: Path, key: str = "id") -> dict[Any, dict[str, Any]]:
    rows = [r.asDict() for r in spark.read.format("delta").load(str(path)).collect()]
    table = {row[key]: row for row in rows}
    assert len(table) == len(rows), "duplicate keys in the table"
    return table


@pytest.fixture(autouse=True)
def no_blocking_calls_on_the_event_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test when deltaflow's code makes a blocking call (file or socket I/O, a sleep,
    a lock wait) on a running event loop, where it would stall every stream of the process.
    Blocking work belongs in a worker thread. Code of the tests themselves is not watched."""
    with blockbuster_ctx("deltaflow", excluded_modules=["deltaflow.testing"]) as watch:
        for function in watch.functions.values():
            # The classes an operator names are imported once, as a node is built.
            function.can_block_in("deltaflow/receivers/registry.py", "register_names")
            function.can_block_in("deltaflow/server/side_inputs/loading.py", "load_side_inputs")
            # A test changing a side input's source from a stream's callback, on purpose.
            function.can_block_in("tests/test_side_inputs.py", "replace_file")
        yield
