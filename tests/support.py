"""Plain helpers shared by the test modules and ``conftest.py``: the test Spark settings, the
receivers test nodes run, engine names, table readers, and the table tests' workload and
table engine. Fixtures (nodes, Spark, the warehouse) are in ``conftest.py``; test modules
import helpers from here, never from ``conftest.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

import deltaflow
from deltaflow import Delete, StreamerOptions
from deltaflow.engines import DeltaRsOptions, EngineOptions, SparkOptions, new_engine
from deltaflow.partitioning import partition_of
from deltaflow.server import Node
from deltaflow.spark_integration import SparkConfig
from deltaflow.spark_integration.s3a import configure_bucket
from deltaflow.storage.paths import Location, StorePath, storage_options
from deltaflow.tables.engine import TableEngine
from deltaflow.testing import NodeProcess, free_port

T = TypeVar("T")

#: The classic Spark of the run: ``local[2]``, or the standalone cluster named by
#: ``DELTAFLOW_TEST_SPARK_MASTER`` (``test_spark_cluster.py`` runs the table tests so, one core).
TEST_SPARK = SparkConfig(
    master=os.environ.get("DELTAFLOW_TEST_SPARK_MASTER", "local[2]"),
    shuffle_partitions=2,
    driver_memory="2g",
    max_cores=1,
    executor_memory="1g",
    app_name="deltaflow-tests",
    # The spark-s3 legs write tables on the S3 server (not run on a cluster: its executors
    # would fetch S3A's 690 MB of jars).
    object_store="DELTAFLOW_TEST_SPARK_MASTER" not in os.environ,
)
TEST_RECEIVERS = (
    "deltaflow.testing.Echo",
    "deltaflow.testing.EchoStream",
    "deltaflow.testing.FailOn",
    "deltaflow.testing.AppendRows",
    "deltaflow.testing.Validate",
    "deltaflow.testing.Flaky",
    "deltaflow.testing.Concurrency",
    "deltaflow.testing.Gated",
    "deltaflow.testing.Lookup",
    "deltaflow.testing.RecordOrder",
    "deltaflow.testing.TwoTables",
    "deltaflow.testing.Unconstructible",
)
#: Every engine as tests name them (:func:`engine_options`): a table test module runs on all
#: of them by overriding the ``engine`` fixture with these as its parameters.
EVERY_ENGINE = (
    "spark",
    "spark-sql",
    "delta-rs",
    "spark-dv",
    "delta-rs-dv",
    "spark-connect",
    "spark-sql-dv",
    "delta-rs-s3",
    "delta-rs-s3-dv",
    "spark-s3",
)
#: Every engine but Spark Connect, for table tests whose SQL path ``spark-sql`` (and
#: ``spark-sql-dv``) already runs: a Connect node's MERGE is the SQL writer's over another
#: transport. Connect's own table tests: ``test_table_upserts.py``, the cheap ones of
#: ``test_table_merges.py`` and ``test_table_settings.py``, and ``test_spark_connect.py``.
LOCAL_ENGINES = tuple(e for e in EVERY_ENGINE if e != "spark-connect")
#: One engine per write path of deltaflow's own: :data:`LOCAL_ENGINES` without ``spark-sql-dv``,
#: whose MERGE is ``spark-sql``'s on tables with deletion vectors (only Delta's MERGE treats
#: them differently; ``test_merge_on_read.py`` and the upsert tests run it).
WRITE_PATHS = tuple(e for e in LOCAL_ENGINES if e != "spark-sql-dv")
#: The engines whose warehouse is a bucket on the S3 server (the ``warehouse`` fixture). (Spark
#: on tables with deletion vectors there differs from ``spark-s3`` only in the files the node
#: writes, which ``delta-rs-s3-dv`` covers: left out for the suite's time.)
ON_S3 = frozenset({"delta-rs-s3", "delta-rs-s3-dv", "spark-s3"})
#: The engines whose SQL MERGE (or INSERT) cannot add ``txn`` actions: each group's lane marks
#: follow it in a commit of their own (``SparkTableEngine._carry_marks``), so a group that
#: writes rows is two versions there.
MARKS_FOLLOW = frozenset({"spark-sql", "spark-sql-dv", "spark-connect"})
#: The Spark settings of engines on servers the tests start (``"connect"``: the Spark Connect
#: server), filled in by the fixtures that start them.
SPARK_SERVERS: dict[str, SparkConfig] = {}

#: The ``within`` fixture: ``await within(awaitable, seconds, what)``.
Within = Callable[[Awaitable[T], float, str], Awaitable[T]]
#: The ``eventually`` fixture: ``await eventually(condition, what)``.
Eventually = Callable[[Callable[[], bool], str], Awaitable[None]]
#: The ``start_cluster`` fixture: ``await start_cluster(warehouse, count=2, **config)``.
StartCluster = Callable[..., Awaitable[list[Node]]]


def engine_options(engine: str) -> dict[str, Any]:
    """A node's settings for an engine as tests name them (``engine``: its options, Spark's on
    :data:`TEST_SPARK`; ``deletion_vectors``): ``spark`` (its direct writer),
    ``spark-sql`` (the Spark engine MERGEing every group), ``delta-rs``, ``spark-dv`` and
    ``delta-rs-dv`` (on tables with deletion vectors: merge-on-read), ``spark-connect`` (the
    Spark engine on the ``connect_server`` fixture's server: SQL MERGE/INSERT),
    ``spark-sql-dv`` (the SQL writer's MERGE on tables with deletion vectors), and
    ``delta-rs-s3``, ``delta-rs-s3-dv`` and ``spark-s3`` (an engine on a warehouse in a bucket
    of the S3 server: optimistic commits; Spark's through deltaflow's S3 log store)."""
    if engine.endswith("-dv"):
        return {**engine_options(engine.removesuffix("-dv")), "deletion_vectors": True}
    if engine == "spark-connect":
        assert "connect" in SPARK_SERVERS, "spark-connect needs the connect_server fixture"
        return {"engine": SparkOptions(config=SPARK_SERVERS["connect"])}
    if engine == "spark-sql":
        return {"engine": SparkOptions(config=TEST_SPARK, writer="sql")}
    if engine.removesuffix("-s3") == "spark":
        return {"engine": SparkOptions(config=TEST_SPARK)}
    if engine.removesuffix("-s3") == "delta-rs":
        return {"engine": DeltaRsOptions()}
    return {"engine": engine}  # not an engine: NodeConfig says so


def creating_engine(engine: str) -> EngineOptions:
    """The engine a table test on ``engine`` (a name :func:`engine_options` knows) creates its
    table with: the same kind, Spark's on the classic :data:`TEST_SPARK`."""
    return DeltaRsOptions() if engine.startswith("delta-rs") else SparkOptions(config=TEST_SPARK)


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


# -- reading tables --------------------------------------------------------------------------


def open_table(path: Location, version: int | None = None) -> Any:
    """The ``deltalake`` reader's table at ``path`` (a directory, or a place on the S3 server)."""
    from deltalake import DeltaTable

    return DeltaTable(str(path), version=version, storage_options=storage_options(path))


def read_delta(path: Location, key: str = "id") -> dict[Any, dict[str, Any]]:
    """The table as {key: row}, read by delta-rs (independent of Spark), through its query
    engine, which applies deletion vectors."""
    import pyarrow as pa
    from deltalake import QueryBuilder

    reader = QueryBuilder().register("t", open_table(path)).execute("SELECT * FROM t")
    rows = pa.table(reader.read_all()).to_pylist()
    table = {row[key]: row for row in rows}
    assert len(table) == len(rows), "duplicate keys in the table"
    return table


def read_spark(spark: Any, path: Location, key: str = "id") -> dict[Any, dict[str, Any]]:
    """The table as {key: row}, read by Spark (on the S3 server through S3A)."""
    if isinstance(path, StorePath):
        configure_bucket(spark, str(path), path.storage_options)
    rows = [r.asDict() for r in spark.read.format("delta").load(str(path)).collect()]
    table = {row[key]: row for row in rows}
    assert len(table) == len(rows), "duplicate keys in the table"
    return table


def read_all(path: Path) -> list[dict[str, Any]]:
    """Every row through delta-rs's query engine, which applies deletion vectors (its
    ``to_pyarrow_table`` refuses tables that have them)."""
    import pyarrow as pa
    from deltalake import QueryBuilder

    reader = QueryBuilder().register("t", open_table(path)).execute("SELECT * FROM t")
    return sorted(pa.table(reader.read_all()).to_pylist(), key=lambda r: r["id"])


def commit_actions(path: Path, version: int) -> tuple[list[str], list[dict[str, Any]]]:
    """The nodes whose groups a commit holds (from its lane marks: the writers a committer
    combined, else the node that made it; empty without marks) and its add and remove
    actions."""
    nodes: list[str] = []
    files: list[dict[str, Any]] = []
    for line in (path / "_delta_log" / f"{version:020d}.json").read_text().splitlines():
        action = json.loads(line)
        if "commitInfo" in action:
            meta = action["commitInfo"].get("userMetadata") or "{}"
            record = json.loads(meta).get("deltaflow", {})
            nodes = record.get("writers") or ([record["node"]] if record.get("node") else [])
        files += [action[k] for k in ("add", "remove") if k in action]
    return nodes, files


def commit_writers(path: Path) -> dict[str, str]:
    """The nodes whose groups the table's commits hold: each commit's committer and the
    writers whose prepared groups it combined (from its lane marks) -> the engine that
    committed it (Delta's ``engineInfo``), by the ``deltalake`` reader."""
    writers: dict[str, str] = {}
    for h in open_table(path).history():
        if h.get("userMetadata"):
            record = json.loads(h["userMetadata"])["deltaflow"]
            for node in record.get("writers", [record["node"]]):
                writers[node] = h.get("engineInfo", "")
    return writers


async def append_ids(client: Any, table: str, n: int, options: StreamerOptions) -> Any:
    """Stream ids ``0..n-1`` through the AppendRows receiver: a duplicate would show."""
    return await client.stream_data(
        [{"id": i} for i in range(n)],
        key="id",
        receiver="deltaflow.testing.AppendRows",
        receiver_args={"table": table},
        options=options,
    )


def assert_appended_once(path: Path, n: int, *, committed_by: str) -> None:
    """Ids ``0..n-1`` each in the table once, and ``committed_by`` made a commit of it (a node
    that crashed after its commit and before its ack)."""

    assert committed_by in commit_writers(path)
    ids = [r["id"] for r in open_table(path).to_pyarrow_table().to_pylist()]
    assert len(ids) == n and set(ids) == set(range(n))


# -- the table tests' workload ---------------------------------------------------------------

#: The client options of the table tests: small pages, several batches of a partition in flight.
OPTIONS = StreamerOptions(page_size=150, per_partition_in_flight=4, auto_flush_interval=0.5)


def workload(n_keys: int = 600, rounds: int = 3) -> list[Any]:
    """Every key written ``rounds`` times, then every 10th deleted, then some re-inserted."""
    items: list[Any] = [
        {"id": k, "name": f"r{r}-k{k}", "value": float(r * n_keys + k)}
        for r in range(rounds)
        for k in range(n_keys)
    ]
    items += [Delete({"id": k}) for k in range(0, n_keys, 10)]
    items += [{"id": k, "name": "back", "value": -1.0} for k in range(0, n_keys, 20)]
    return items


def expected(items: list[Any]) -> dict[int, dict[str, Any]]:
    state: dict[int, dict[str, Any]] = {}
    for item in items:
        if isinstance(item, Delete):
            state.pop(item.item["id"], None)
        else:
            state[item["id"]] = item
    return state


def assert_table(spark: Any, path: Location, want: dict[int, dict[str, Any]]) -> None:
    """The table holds ``want``, as delta-rs and Spark read it."""
    for reader in (read_delta(path), read_spark(spark, path)):
        assert set(reader) == set(want)
        for k, row in want.items():
            assert reader[k]["name"] == row["name"], k
            assert reader[k]["value"] == row["value"], k


# -- a node's table engine alone -------------------------------------------------------------


@contextlib.asynccontextmanager
async def table_engine(
    engine: str, warehouse: Path, node_id: str = "t1", **kwargs: Any
) -> AsyncIterator[TableEngine]:
    """A node's table engine alone (no server): staging and commits, as a node runs them."""
    options = engine_options(engine)
    kwargs = {"deletion_vectors": options.get("deletion_vectors", False), **kwargs}
    eng = new_engine(options["engine"], warehouse, node_id=node_id, **kwargs)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


async def upsert(
    eng: TableEngine, table: str, rows: list[Any], deletes: frozenset[int] = frozenset()
) -> None:
    await (await eng.stage(table, ["id"], rows, deletes))


@contextlib.asynccontextmanager
async def holding(warehouse: Path, table: str) -> AsyncIterator[None]:
    """The table's commit lock held by the test (as another writer would), taken off the
    event loop; released when the block ends. A warehouse on a store has no lock: the test is
    skipped there (commits on a store are optimistic)."""
    if isinstance(warehouse, StorePath):
        pytest.skip("a warehouse on object storage has no commit lock (optimistic commits)")
    from deltaflow.tables.flock import table_lock

    lock = table_lock(warehouse, table)
    await asyncio.to_thread(lock.__enter__)
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


@pytest.fixture(params=EVERY_ENGINE, name="engine")
def every_engine(request: pytest.FixtureRequest) -> str:
    """Every table test runs against both engines, the Spark engine's two writers, and both
    engines' merge-on-read (tables with deletion vectors): their semantics must be
    identical. A table test module imports it to override conftest's one-engine default."""
    if str(request.param).startswith("spark-connect"):
        request.getfixturevalue("connect_server")  # started once, on first use
    return str(request.param)


# -- node processes ---------------------------------------------------------------------------

#: Flags of the failover tests' node processes: fast failure detection, the AppendRows receiver.
NODE_FLAGS = (
    "--receiver",
    "deltaflow.testing.AppendRows",
    "--heartbeat-interval",
    "0.3",
    "--failure-timeout",
    "3.0",
    "--driver-memory",
    "1g",
)
#: Client options of the failover tests: quick, patient retries. A lost ack is resent after
#: 20 s rather than the default 120 s, so a stall shows as a slow test, not a stuck suite.
FAILOVER_OPTIONS = StreamerOptions(
    retry_initial_backoff=0.05, retry_max_backoff=1.0, retry_limit=40, ack_timeout=20.0
)


class Cluster:
    """Node processes (:class:`deltaflow.testing.NodeProcess`) on 127.0.0.1 sharing one
    warehouse: a directory, or an ``s3://`` URI with the store's settings in ``env``.

    Args:
        env: environment of every node; ``scratch``: a directory under which each node gets
            its own ``TMPDIR`` and Spark local directory (nodes then share no local path).
    """

    def __init__(
        self,
        warehouse: Path | str,
        count: int = 3,
        flags: Sequence[str] = NODE_FLAGS,
        *,
        env: dict[str, str] | None = None,
        scratch: Path | None = None,
    ) -> None:
        self.warehouse = warehouse
        self.flags = list(flags)
        self.env = dict(env or {})
        self.scratch = scratch
        self.ports = {f"node-{i}": free_port() for i in range(1, count + 1)}
        self.nodes: dict[str, NodeProcess] = {}

    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports.values()]

    async def start(self, node_id: str, env: dict[str, str] | None = None) -> NodeProcess:
        peers = [a for n, a in zip(self.ports, self.addresses(), strict=True) if n != node_id]
        environment = {**self.env, **(env or {})}
        if self.scratch is not None:
            own = self.scratch / node_id
            own.mkdir(parents=True, exist_ok=True)
            environment["TMPDIR"] = environment["SPARK_LOCAL_DIRS"] = str(own)
        node = NodeProcess(
            node_id,
            self.warehouse,  # type: ignore[arg-type]
            peers=peers,
            port=self.ports[node_id],
            extra=self.flags,
            env=environment,
        )
        self.nodes[node_id] = node
        return await node.start()

    async def restart(self, node_id: str, env: dict[str, str]) -> NodeProcess:
        """Stop ``node_id`` and start it again with ``env`` added (a fault to inject)."""
        await self.nodes[node_id].stop()
        return await self.start(node_id, env=env)

    async def append_ids(self, table: str, n: int, options: StreamerOptions) -> Any:
        """Once every node is a member: ids ``0..n-1`` through AppendRows; the summary."""
        client = await self.wait_members(len(self.ports))
        async with client:
            return await append_ids(client, table, n, options)

    async def start_all(self) -> Cluster:
        await asyncio.gather(*(self.start(n) for n in self.ports))
        return self

    async def stop(self) -> None:
        await asyncio.gather(*(n.stop() for n in self.nodes.values()))

    async def wait_members(self, count: int, via: str = "node-1") -> deltaflow.Client:
        """A client whose map shows ``count`` live nodes (polls: the nodes are other processes)."""
        deadline = time.monotonic() + 60
        while True:
            client = deltaflow.connect([self.nodes[via].address])
            await client.start()
            if len(set(client.partition_map.owners)) == count:
                return client
            await client.close()
            assert time.monotonic() < deadline, f"cluster never reached {count} members"
            await asyncio.sleep(0.2)


class FailoverWatch:
    """An ``on_ack`` hook: SIGKILLs ``victim`` once ``at`` items are acknowledged, then notes
    the first ack, ``grace`` seconds or more after the kill, of a batch of a partition the
    victim owned in ``partition_map`` (acks the victim sent before dying arrive within
    milliseconds; a later one is a new owner's). :attr:`failover`: seconds from the kill."""

    def __init__(
        self, victim: NodeProcess, at: int, partition_map: Any, *, grace: float, key: str = "id"
    ) -> None:
        self.kill = KillAt(victim, at)
        self.owners, self.partitions = partition_map.owners, partition_map.partitions
        self.victim, self.grace, self.key = victim.node_id, grace, key
        self.first_new_owner_ack: float | None = None

    def __call__(self, items: list[Any]) -> None:
        now, killed = time.monotonic(), self.kill.killed_at
        if killed is not None and self.first_new_owner_ack is None and now > killed + self.grace:
            if self.owners[partition_of(items[0][self.key], self.partitions)] == self.victim:
                self.first_new_owner_ack = now
        self.kill(items)

    @property
    def failover(self) -> float:
        assert self.kill.killed_at is not None, "the victim was never killed"
        assert self.first_new_owner_ack is not None, "no batch of its partitions acked after"
        return self.first_new_owner_ack - self.kill.killed_at


class KillAt:
    """An ``on_ack`` hook that SIGKILLs ``victim`` once ``at`` items are acknowledged."""

    def __init__(self, victim: NodeProcess, at: int) -> None:
        self.victim, self.at, self.acked = victim, at, 0
        self.killed_at: float | None = None

    def __call__(self, items: list[Any]) -> None:
        self.acked += len(items)
        if self.killed_at is None and self.acked >= self.at:
            self.victim.kill()
            self.killed_at = time.monotonic()


@contextlib.contextmanager
def allocation_peak() -> Iterator[list[int]]:
    """The most memory Python allocated inside the block, in bytes (appended on exit)."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


async def metric(node: Any, name: str) -> float:
    """A node's Prometheus counter, summed over its labels."""
    import aiohttp

    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{node.address}/metrics") as response,
    ):
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def process_state(node: Any) -> str:
    """The process state letter of a node process (``T``: stopped)."""
    assert node.proc is not None
    with open(f"/proc/{node.proc.pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


class HealthWatch:
    """Times ``GET /healthz`` on a node every 50 ms (from 127.0.0.1) while a block runs; a
    probe that fails fails the test, and the node must answer once more after the block."""

    def __init__(self, address: str) -> None:
        self.url = f"http://{address}/healthz"
        self.seconds: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _poll(self, session: aiohttp.ClientSession) -> None:
        for _ in range(1200):  # a minute at most
            started = time.monotonic()
            async with session.get(self.url) as answer:
                assert answer.status == 200
            self.seconds.append(time.monotonic() - started)
            await asyncio.sleep(0.05)

    async def __aenter__(self) -> HealthWatch:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self._task = asyncio.create_task(self._poll(self._session))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None and self._session is not None
        async with self._session:
            if self._task.done():
                self._task.result()  # a failed probe fails the test
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            async with self._session.get(self.url) as answer:  # and after
                assert answer.status == 200
        assert self.seconds, "no /healthz answer at all"


def memory_mib(pid: int, field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) of a process, in MiB."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith(f"{field}:"))
    return int(line.split()[1]) / 1024


def reset_peak(pid: int) -> None:
    """Start a new peak of ``memory_mib(pid, "VmHWM")`` from now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


async def echo_node_process(
    tmp_path: Path, token: str, *extra: str, prefix: tuple[str, ...] = ()
) -> NodeProcess:
    """A ``deltaflow serve`` process (delta-rs, the Echo receiver) whose clients must hold
    ``token``; ``extra`` flags, and ``prefix`` before the command (``prlimit ...``)."""
    (tmp_path / "token").write_text(token)
    return await NodeProcess(
        "n1",
        tmp_path / "warehouse",
        prefix=prefix,
        extra=[
            "--engine",
            "delta-rs",
            "--token-file",
            str(tmp_path / "token"),
            "--receiver",
            "deltaflow.testing.Echo",
            *extra,
        ],
    ).start()
