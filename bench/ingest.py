"""Ingest benchmark: deltaflow against naive, micro-batch and bulk Delta MERGEs.

One run generates the same deterministic data for every variant and measures, per variant,
rows/s, peak RSS and p50/p99 latency from a row being produced to it being durable in its
Delta table (for deltaflow: the ack). Each variant runs in its own subprocess, so its peak
RSS (and its JVM) is its own::

    .venv/bin/python bench/ingest.py                  # all variants, 1,000,000 rows
    .venv/bin/python bench/ingest.py --rows 100000    # smaller
    .venv/bin/python bench/ingest.py --variant bulk-spark --rows 1000 --warehouse /tmp/wh \\
        --out /tmp/bulk.json                           # one variant (what the parent runs)

Results go to ``bench/out/ingest.json`` and ``bench/out/ingest.png``; see ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from array import array
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any, Final

DEFAULT_ROWS: Final = 1_000_000
CHUNK_ROWS: Final = 1_000  # generation unit, and the naive loop's batch
NAIVE_ROWS: Final = 20_000  # the naive loop's rate is flat, so it runs on a prefix only
MICRO_BATCH_ROWS: Final = 100_000
WARMUP_MERGES: Final = 5  # untimed MERGEs that bring a fresh JVM to speed (see warm_up_spark)
WARMUP_ROWS: Final = 50_000
DELETE_FRACTION: Final = 0.01
SEED: Final = 20_240_601
TS_BASE: Final = 1_700_000_000.0  # ts of row i is TS_BASE + i / 1000
COLUMNS: Final = ("id", "key", "ts", "value", "payload")
#: Rows per record batch of the Arrow-source variants (10 generated chunks).
ARROW_BATCH_ROWS: Final = 10_000
OUT_DIR: Final = Path(__file__).resolve().parent / "out"
STAMP_LINE: Final = "-" * 133


# -- data ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Chunk:
    """Consecutive generated rows.

    Attributes:
        start: index of the first row in the whole data set.
        table: the rows as an Arrow table: ``id`` (int64; ``id = i % (N // 2)``, so the second
            half updates), ``key`` (string), ``ts`` and ``value`` (float), ``payload`` (100
            characters) and ``is_delete`` (whether the row deletes its id; about 1%).
    """

    start: int
    table: Any

    def __len__(self) -> int:
        return int(self.table.num_rows)


#: Rows generated at a time (a block, cut into chunks of ``CHUNK_ROWS``).
BLOCK_ROWS: Final = 10 * CHUNK_ROWS


def generate(total: int, limit: int | None = None) -> Iterator[Chunk]:
    """The benchmark data, in chunks of ``CHUNK_ROWS`` rows, made column by column (numpy,
    Arrow compute), so that producing rows costs the timed runs about 0.4 s per 1,000,000:
    what is measured is the ingest, not a Python loop that makes the data.

    The data depend only on ``total`` (and ``SEED``): every variant and every process sees the
    same rows, and a prefix (``limit``) is the prefix of the full data.

    Args:
        total: N, the size of the whole data set; ids are ``i % (N // 2)``.
        limit: generate only the first ``limit`` rows.

    Yields:
        Chunks of consecutive rows.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    distinct = max(1, total // 2)
    stop = total if limit is None else min(limit, total)
    for block in range(0, stop, BLOCK_ROWS):
        rng = np.random.default_rng([SEED, block // BLOCK_ROWS])
        i = np.arange(block, min(block + BLOCK_ROWS, total), dtype=np.int64)
        n = len(i)
        ids = pa.array(i % distinct, pa.int64())
        # payload: the row's index in 12 digits, then 44 random bytes in hex (100 characters)
        digits = pc.utf8_lpad(pa.array(i).cast(pa.string()), 12, "0").buffers()[2]
        payload = np.empty((n, 100), np.uint8)
        payload[:, :12] = np.frombuffer(digits, np.uint8, 12 * n).reshape(n, 12)
        payload[:, 12:] = np.frombuffer(rng.bytes(44 * n).hex().encode(), np.uint8).reshape(n, 88)
        offsets = np.arange(0, 100 * (n + 1), 100, dtype=np.int32)
        table = pa.table(
            {
                "id": ids,
                "key": pc.binary_join_element_wise("key-", ids.cast(pa.string()), ""),
                "ts": pa.array(TS_BASE + i / 1000, pa.float64()),
                "value": pa.array(rng.random(n) * 1000, pa.float64()),
                "payload": pa.StringArray.from_buffers(
                    n, pa.py_buffer(offsets), pa.py_buffer(payload)
                ),
                "is_delete": pa.array(rng.random(n) < DELETE_FRACTION, pa.bool_()),
            }
        )
        for start in range(block, min(block + BLOCK_ROWS, stop), CHUNK_ROWS):
            yield Chunk(start, table.slice(start - block, min(CHUNK_ROWS, stop - start)))


def rows_of(chunk: Chunk) -> Iterator[Any]:
    """The chunk as deltaflow items: row dicts, and ``Delete({"id": ...})`` for deletes."""
    from deltaflow import Delete

    columns = [  # through numpy: pyarrow's to_pylist costs ten times as much per value
        chunk.table.column(name).to_numpy(zero_copy_only=False).tolist()
        for name in (*COLUMNS, "is_delete")
    ]
    for row_id, key, ts, value, payload, delete in zip(*columns, strict=True):
        if delete:
            yield Delete({"id": row_id})
        else:
            yield {"id": row_id, "key": key, "ts": ts, "value": value, "payload": payload}


def arrow_of(chunks: list[Chunk]) -> Any:
    """The chunks as one Arrow table with the table's columns plus ``is_delete``."""
    import pyarrow as pa

    return pa.concat_tables([c.table for c in chunks]).combine_chunks()


def _last_of_each_id(ids: Any) -> Any:
    """Indexes of the last occurrence of each id in ``ids`` (a numpy array), ascending."""
    import numpy as np

    _, first_from_end = np.unique(ids[::-1], return_index=True)
    return np.sort(len(ids) - 1 - first_from_end)


def last_per_id(table: Any) -> Any:
    """Keep the last row of each id (as deltaflow's group commit does); MERGE needs it."""
    last = _last_of_each_id(table.column("id").to_numpy())
    if len(last) == table.num_rows:
        return table
    return table.take(last)


def expected_rows(total: int, limit: int | None = None) -> int:
    """Rows the table must hold after applying the (first ``limit``) rows in order."""
    data = arrow_of(list(generate(total, limit)))
    last = _last_of_each_id(data.column("id").to_numpy())
    return int(len(last) - data.column("is_delete").to_numpy()[last].sum())


# -- measurement --------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    """What one variant measured (before RSS and quantiles are added).

    Attributes:
        rows: source rows processed.
        seconds: wall time from the first row produced to the last commit durable.
        latencies: per row, seconds from being produced to being durable (acked).
        commits: Delta commits made.
        commit_seconds: time spent in those commits.
        note: anything worth printing next to the numbers.
        ack: deltaflow's ack latency (a batch's send to its ack, the client's
            :class:`~deltaflow.client.AckLatency`); None for the baselines.
        races: commits that lost the race for a table version and were tried again (the
            nodes' ``deltaflow_commit_conflicts``).
        sent_back: prepared groups a table's committer sent back to be prepared again.
    """

    rows: int
    seconds: float
    latencies: array[float]
    commits: int
    commit_seconds: float
    note: str = ""
    ack: Any = None
    races: int = 0
    sent_back: int = 0
    client_cpu_s: float = float("nan")  # deltaflow's client, the bench's source excluded
    nodes_cpu_s: float = float("nan")


@dataclass(frozen=True, slots=True)
class Result:
    """One variant's row of the results table (also its JSON)."""

    variant: str
    rows: int
    seconds: float
    rows_per_s: float
    p50_s: float
    p95_s: float
    p99_s: float
    commits: int
    mean_commit_s: float
    rss_self_mib: float
    rss_children_mib: float
    note: str
    ack_p50_s: float = float("nan")  # a batch's send to its ack (deltaflow only)
    ack_p99_s: float = float("nan")
    races: int = 0
    sent_back: int = 0
    client_cpu_s: float = float("nan")
    nodes_cpu_s: float = float("nan")
    table_rows: int | None = None
    expected_rows: int | None = None
    #: Versions of the table (the parent reads its log).
    versions: int | None = None
    check: str = "n/a"


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _peak_rss_kib(pid: int | str) -> int:
    """A process's peak RSS (``VmHWM``), KiB; 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


class BenchCpu:
    """CPU seconds this process spent on the bench's own work (making the source's rows,
    watching RSS), counted by the threads doing it, so the client's figure is deltaflow's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds


BENCH_CPU: Final = BenchCpu()


class PeakRss:
    """The peak RSS of this process and of each process it started (Spark's JVM, node
    processes and their JVMs), read from ``/proc`` (``VmHWM``) every 0.1 s by a thread.

    Not ``ru_maxrss``: Linux carries a parent's RSS at ``fork`` over ``exec`` into it, so a
    small variant started by a large parent would report the parent's size; nor
    ``RUSAGE_CHILDREN``, which is the largest child, not the sum of them.
    """

    def __init__(self) -> None:
        self._peaks: dict[int, int] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="peak-rss", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(0.1):
            began = time.thread_time()
            for pid in _descendants(os.getpid()):
                self._peaks[pid] = max(self._peaks.get(pid, 0), _peak_rss_kib(pid))
            BENCH_CPU.add(time.thread_time() - began)

    def stop(self) -> tuple[float, float]:
        """This process's peak and the sum of its descendants' peaks, MiB."""
        self._done.set()
        self._thread.join()
        return _peak_rss_kib("self") / 1024, sum(self._peaks.values()) / 1024


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children = [int(child) for child in path.read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def stop_spark() -> None:
    """Stop the SparkSession and wait for its JVM to exit (closing its stdin makes the
    gateway exit), so that a variant leaves no process behind."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if SparkContext._active_spark_context is not None:
        SparkContext._active_spark_context.stop()
    if gateway is not None:
        gateway.shutdown()
    if proc is not None:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=120)


# -- variants -----------------------------------------------------------------------------


def warm_up_spark(warehouse: Path, java_options: str | None = None) -> Any:
    """Start this process's SparkSession and run a few untimed MERGEs.

    The first MERGE in a fresh JVM pays for class loading and code generation (about ten
    seconds on a small machine), and the JIT compiler needs a few more before MERGEs reach the
    speed of a node that has been running a while (measured: a 140,000-row MERGE took 6.2,
    3.9, 3.4, 2.9 and 2.6 s, one after the other). Every Spark variant, deltaflow's included,
    pays this here, outside the timed part, like the rest of the startup:
    ``WARMUP_MERGES`` MERGEs of 50,000 rows, half of them updates from the second on.

    Args:
        java_options: the driver JVM's options (``SparkConfig.java_options``): what the nodes
            sharing this process would start it with.

    Returns:
        The SparkSession.
    """
    import pyarrow.parquet as pq

    from deltaflow.spark_integration import SparkConfig, get_spark

    spark = get_spark(SparkConfig(master="local[*]", java_options=java_options))
    scratch = warehouse / ".bench-warmup" / uuid.uuid4().hex
    scratch.mkdir(parents=True)
    _create_spark_table(spark, scratch / "table")
    chunks = list(generate(2 * WARMUP_ROWS))  # ids repeat after WARMUP_ROWS rows
    halves = [arrow_of(chunks[: len(chunks) // 2]), arrow_of(chunks[len(chunks) // 2 :])]
    for i in range(WARMUP_MERGES):
        staged = scratch / f"rows-{i}.parquet"
        pq.write_table(halves[i % 2], staged)
        spark.sql(_spark_merge_sql(scratch / "table", staged))
    shutil.rmtree(scratch, ignore_errors=True)
    return spark


def _create_spark_table(spark: Any, path: Path) -> None:
    spark.sql(
        f"CREATE TABLE delta.`{path}` (id BIGINT, key STRING, ts DOUBLE, value DOUBLE, "
        "payload STRING) USING DELTA"
    )


#: The client's pages and window for the other unpaced variants: 4,000-row pages, 32 batches
#: in flight (Spark; delta-rs 16, below), 2 per partition. For Spark that is the defaults'
#: 128,000 rows in flight (1,000-row pages, 128 and 4) in a quarter of the batches: a node
#: spends about 1.5 ms of CPU per batch (its frame, decoding and checking the page, and a file
#: per page's bucket in the commit), so on 2 cores the defaults measured 315,000 rows/s
#: (delta-rs) and 208,000 (Spark) from an Arrow source, these 375,000 and 258,000, with acks
#: 25-40% sooner once sent; a row waits longer in its partition's buffer before, so time to
#: table grows (see StreamerOptions, docs/reference/client.md). Their first pages are staggered
#: (``stagger_pages``) so that pages leave evenly spread.
#: delta-rs keeps half the window: its commits take 15-20 ms, Spark's direct writer's 85-120
#: ms (Spark with 16: 200,000 rows/s against 300,000 with 32). For delta-rs the larger window
#: only added queueing: 526,000-532,000 rows/s with acks p99 159-183 ms, against
#: 511,000-522,000 and 105-109 ms with 16 (session 15, two pairs).
BULK_PAGE_SIZE: Final = 4000
BULK_WINDOW_BATCHES: Final = {"spark": 32, "delta-rs": 16}
BULK_WINDOW_PER_PARTITION: Final = 2


def _window(engine: str) -> int:
    """Batches in flight per node (the window grows with the nodes, as their capacity does):
    ``--window``, else the engine's :data:`BULK_WINDOW_BATCHES`."""
    return int(os.environ.get("BENCH_WINDOW_PER_NODE") or BULK_WINDOW_BATCHES[engine])


#: The client's window for the Spark SQL writer's variant: up to 512 batches (512,000 rows) in
#: flight, 16 per partition. Under load a node's group commit is what arrived during the
#: previous commits, so a larger window makes larger groups that amortise Spark's MERGE fixed
#: cost of seconds (see StreamerOptions); the defaults (128 and 4) measure about 40%
#: lower with it. The other variants (delta-rs, and Spark's direct writer) keep 64,000 and
#: 128,000 rows in flight (above): their commits take a fraction of a second, and a larger
#: window only adds queueing.
#: ``BENCH_SPARK_WINDOW=sql`` gives every Spark variant the large window.
SPARK_WINDOW_BATCHES: Final = 512
SPARK_WINDOW_PER_PARTITION: Final = 16
#: The paced variants' source rate (rows/s): the rate at which the issue asks for time to
#: table (p50 <= 2 s, p95 <= 5 s with the Spark engine; Zerobus publishes 15,000 rows/s).
PACED_RATE: Final = 50_000
#: Their ``auto_flush_interval``: at 50,000 rows/s over 64 partitions a 1,000-row page takes
#: 1.3 s to fill, which a latency-minded stream does not wait for.
PACED_FLUSH_INTERVAL: Final = 0.25
PACED_WINDOW_BATCHES: Final = 4096
PACED_WINDOW_PER_PARTITION: Final = 64


def run_deltaflow(
    warehouse: Path,
    total: int,
    engine: str,
    *,
    table: str,
    buckets: int | None = None,
    layout: str = "shared",
    rate: float | None = None,
    arrow: bool = False,
    writer: str = "direct",
    vectors: bool = False,
    spark: str = "local",
    nodes: int = 2,
) -> Run:
    """One client streaming all rows to ``nodes`` nodes (two by default).

    Args:
        spark: where the node processes' Spark runs (``layout="process"`` only): ``local``
            (``local[*]`` in each node), ``cluster`` (a standalone master and 2-core worker
            started for the run, one core per node) or ``connect`` (a Spark Connect server
            started for the run on ``local[*]``; the nodes have no JVM and apply every group
            by SQL).
        vectors: the table gets deletion vectors (merge-on-read with the delta-rs engine).
        writer: the Spark engine's writer (``direct`` or ``sql``: a Spark MERGE per group).
        arrow: the source yields Arrow record batches of ``ARROW_BATCH_ROWS`` rows (the form
            the baselines get their rows in) instead of one dict per row; deltaflow routes
            them by key column and sends Arrow pages.
        rate: rows per second the source produces at most (None: as fast as the stream
            takes them). A paced stream measures time to table at a sustained rate, as a
            service would see it; its client flushes partly filled pages after
            ``PACED_FLUSH_INTERVAL`` seconds instead of Ignite's 5.
        buckets: the table layout's bucket count (None: the node's default, one bucket per
            partition; 0: no bucket column).
        layout: ``shared``: the nodes run in this process, as in ``deltaflow/demo.py`` (client,
            nodes and the Spark driver share one Python process); ``process``: each node is a
            ``deltaflow serve`` process of its own, as deployed (with its own Spark driver).
    """
    import deltaflow

    produced: dict[int, float] = {}  # id(item) -> time it was produced, until acked
    latencies: array[float] = array("d")

    # The sources count their own CPU (BENCH_CPU) between their yields: the thread that
    # resumes a generator may differ from the one it yielded in, so each span starts anew.
    def source() -> Iterator[Any]:
        began = time.monotonic()
        spent = time.thread_time()
        for chunk in generate(total):
            if rate is not None:  # the source thread waits: nothing else is held up
                time.sleep(max(0.0, began + chunk.start / rate - time.monotonic()))
            items = list(rows_of(chunk))
            now = time.monotonic()
            for item in items:
                produced[id(item)] = now
            BENCH_CPU.add(time.thread_time() - spent)
            yield from items
            spent = time.thread_time()

    import numpy as np

    # Arrow source: when each chunk was produced, by chunk number (read back vectorised in
    # on_ack, so measuring costs the client no Python per row).
    chunk_produced = np.zeros(total // CHUNK_ROWS + 1)

    def arrow_source() -> Iterator[Any]:
        from deltaflow import DELETE_COLUMN

        began = time.monotonic()
        spent = time.thread_time()
        pending: list[Chunk] = []
        for chunk in generate(total):
            if rate is not None:
                time.sleep(max(0.0, began + chunk.start / rate - time.monotonic()))
            chunk_produced[chunk.start // CHUNK_ROWS] = time.monotonic()
            pending.append(chunk)
            if len(pending) * CHUNK_ROWS >= ARROW_BATCH_ROWS or rate is not None:
                batch = arrow_of(pending).rename_columns([*COLUMNS, DELETE_COLUMN])
                pending = []
                BENCH_CPU.add(time.thread_time() - spent)
                yield batch
                spent = time.thread_time()
        if pending:
            yield arrow_of(pending).rename_columns([*COLUMNS, DELETE_COLUMN])

    def on_ack(items: Any) -> None:
        now = time.monotonic()
        spent = time.thread_time()  # the bench's measuring, not the client's work
        if arrow:  # a row's index is in its ts (see generate); its chunk's time is kept
            ts = items.table.column("ts").to_numpy()
            chunks = np.rint((ts - TS_BASE) * 1000).astype(np.int64) // CHUNK_ROWS
            latencies.frombytes((now - chunk_produced[chunks]).tobytes())
        else:
            latencies.extend(now - produced.pop(id(item)) for item in items)
        BENCH_CPU.add(time.thread_time() - spent)

    options = (
        deltaflow.StreamerOptions(
            max_in_flight=SPARK_WINDOW_BATCHES, per_partition_in_flight=SPARK_WINDOW_PER_PARTITION
        )
        if engine == "spark" and os.environ.get("BENCH_SPARK_WINDOW", writer) == "sql"
        else deltaflow.StreamerOptions(
            page_size=BULK_PAGE_SIZE,
            max_in_flight=_window(engine) * nodes,
            per_partition_in_flight=BULK_WINDOW_PER_PARTITION,
            stagger_pages=True,
        )
    )
    if rate is not None:
        # Pages flushed after a quarter second hold ~200 rows, so the window (counted in
        # batches) must hold more of them to keep a few seconds of rows in flight.
        options = deltaflow.StreamerOptions(
            auto_flush_interval=PACED_FLUSH_INTERVAL,
            max_in_flight=PACED_WINDOW_BATCHES,
            per_partition_in_flight=PACED_WINDOW_PER_PARTITION,
        )

    async def main() -> Run:
        address, statistics, stop = await _start_nodes(
            warehouse, engine, buckets, layout, writer, vectors, spark, nodes
        )
        try:
            if layout == "process":  # the nodes' JVMs come to speed untimed, as above
                async with deltaflow.connect([address]) as client:
                    for _ in range(WARMUP_MERGES):
                        await client.stream_data(
                            [{"id": i, "payload": "warm-up"} for i in range(WARMUP_ROWS)],
                            table=f"{table}_warmup",
                            key="id",
                        )
            before = await statistics()
            cpu_before = Cpu.now()
            started = time.monotonic()
            async with deltaflow.connect([address]) as client:
                summary = await client.stream_data(
                    arrow_source() if arrow else source(),
                    table=table,
                    key="id",
                    on_ack=on_ack,
                    options=options,
                )
            seconds = time.monotonic() - started
            cpu = Cpu.now().since(cpu_before)
            counts = (await statistics()).since(before)
        finally:
            await stop()
        return Run(
            rows=summary.items_acked,
            seconds=seconds,
            latencies=latencies,
            commits=counts.commits,
            commit_seconds=counts.commit_seconds,
            ack=summary.ack_latency,
            races=counts.races,
            sent_back=counts.sent_back,
            note=(
                f"largest group {counts.largest:,} rows; retried batches "
                f"{summary.batches_retried}; on the nodes, staged to durable: p50 "
                f"{_fmt_s(counts.durable_quantile(0.5))}, p99 "
                f"{_fmt_s(counts.durable_quantile(0.99))} (p99 by stage: "
                f"{counts.stage_quantiles(0.99)}); {cpu.describe()}"
            ),
            client_cpu_s=cpu.client - cpu.bench,
            nodes_cpu_s=cpu.nodes,
        )

    if engine == "spark" and layout == "shared":
        from deltaflow.spark_integration.session import DIRECT_WRITER_JAVA_OPTIONS

        # The session the nodes will share, with the JVM options their engine would choose.
        warm_up_spark(warehouse, DIRECT_WRITER_JAVA_OPTIONS if writer == "direct" else None)
    # Handed over outside asyncio.run: on Python 3.11 its SIGINT handling builds the repr of
    # the task's result twice on the way out (an enum lookup of the handler fails and formats
    # it), about 1 s for a Run holding 1,000,000 latencies.
    runs: list[Run] = []

    async def measured() -> None:
        runs.append(await main())

    asyncio.run(measured())
    run = runs[0]
    if engine == "spark" and layout == "shared":
        stop_spark()
    return run


def _process_ticks(pid: int | str) -> int:
    """CPU time (user + system) a live process used so far, clock ticks; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


@dataclass(frozen=True, slots=True)
class Cpu:
    """CPU seconds so far: the machine's busy and total (all cores, ``/proc/stat``), this
    process's (the client and the bench's own work, ``bench``) and its descendants' (the
    nodes and their JVMs)."""

    busy: float
    total: float
    client: float
    bench: float
    nodes: float

    @classmethod
    def now(cls) -> Cpu:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        idle = ticks[3] + ticks[4]  # idle and iowait
        nodes = sum(_process_ticks(pid) for pid in _descendants(os.getpid()))
        tick = os.sysconf("SC_CLK_TCK")
        return cls(
            (sum(ticks) - idle) / tick,
            sum(ticks) / tick,
            _process_ticks("self") / tick,
            BENCH_CPU.seconds,
            nodes / tick,
        )

    def since(self, before: Cpu) -> Cpu:
        return Cpu(*(a - b for a, b in zip(astuple(self), astuple(before), strict=True)))

    def describe(self) -> str:
        """The share of all cores busy (near 100%: the run was bound by this machine's CPU),
        and the busy core-seconds of the client, the nodes and the rest (the S3 server, the
        proxy, the system)."""
        rest = self.busy - self.client - self.nodes  # /proc/stat counts every core's ticks
        return (
            f"the machine's cores busy {self.busy / self.total:.0%} of the stream "
            f"(core-seconds: client {self.client - self.bench:.1f} and the bench's source "
            f"{self.bench:.1f}, nodes {self.nodes:.1f}, the rest {rest:.1f})"
            if self.total
            else "no CPU figures"
        )


@dataclass(frozen=True, slots=True)
class NodeCounts:
    """What the two nodes report, summed: commits, their seconds, the largest group, and
    the staged-to-durable histogram of their batches (cumulative count per upper bound), and
    those of the stages a batch passes on a node (``deltaflow_batch_stage_seconds``)."""

    commits: int
    commit_seconds: float
    largest: int
    durable: dict[float, float]
    races: int = 0
    sent_back: int = 0
    stages: dict[str, dict[float, float]] = field(default_factory=dict)

    def since(self, before: NodeCounts) -> NodeCounts:
        return NodeCounts(
            self.commits - before.commits,
            self.commit_seconds - before.commit_seconds,
            self.largest,
            _minus(self.durable, before.durable),
            self.races - before.races,
            self.sent_back - before.sent_back,
            {k: _minus(v, before.stages.get(k, {})) for k, v in self.stages.items()},
        )

    def durable_quantile(self, q: float) -> float:
        """The q-quantile of the batches' node-side wait (staged to durable)."""
        return _histogram_quantile(self.durable, q)

    def stage_quantiles(self, q: float) -> str:
        """The q-quantile of each stage, as text."""
        parts = sorted(self.stages.items())
        return ", ".join(f"{k} {_fmt_s(_histogram_quantile(v, q))}" for k, v in parts)


def _minus(after: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    return {le: n - before.get(le, 0.0) for le, n in after.items()}


def _histogram_quantile(cumulative: dict[float, float], q: float) -> float:
    """The q-quantile of a histogram (cumulative count per upper bound), interpolated within
    its bucket (as Prometheus's ``histogram_quantile``)."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if not total:
        return float("nan")
    low, below = 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= q * total:
            if le == float("inf"):
                return low
            return low + (le - low) * (q * total - below) / max(count - below, 1e-9)
        low, below = le, count
    return low


def _add_histogram(into: dict[float, float], histogram: Any) -> None:
    """Add a :class:`~deltaflow.tables.statistics.Histogram` to cumulative counts by bound."""
    cumulative = itertools.accumulate(histogram.counts)
    for le, count in zip([*histogram.bounds, float("inf")], cumulative, strict=True):
        into[le] = into.get(le, 0.0) + count


def _start_spark(warehouse: Path, spark: str) -> tuple[str, list[str], Any]:
    """Blocking: the nodes' ``--spark-master``, their further flags, and the servers started
    for them (None for ``local``), their logs beside the warehouse."""
    from deltaflow.testing.spark_servers import ConnectServer, SparkCluster

    directory = warehouse.parent / f"{warehouse.name}-spark"
    if spark == "cluster":
        cluster = SparkCluster(directory, cores=2, memory="4g").start()
        return cluster.url, ["--spark-max-cores", "1", "--spark-executor-memory", "1g"], cluster
    if spark == "connect":
        server = ConnectServer(directory, master="local[*]", driver_memory="2g").start()
        return server.url, [], server
    return "local[*]", [], None


async def _start_nodes(
    warehouse: Path,
    engine: str,
    buckets: int | None,
    layout: str,
    writer: str,
    vectors: bool,
    spark: str = "local",
    count: int = 2,
) -> tuple[str, Callable[[], Awaitable[NodeCounts]], Callable[[], Awaitable[None]]]:
    """``count`` nodes: the first one's address, how to read (commits, commit seconds,
    largest group rows) summed over them, and how to stop them."""
    if layout == "process":
        from deltaflow.testing import NodeProcess, free_port, wait_for_members

        master, extra, servers = await asyncio.to_thread(_start_spark, warehouse, spark)
        extra += ["--engine", engine, "--spark-writer", writer]
        if vectors:
            extra.append("--deletion-vectors")
        if buckets is not None:
            extra += ["--table-buckets", str(buckets)]
        # Every node is told all the others: membership does not spread by gossip.
        ports = [free_port() for _ in range(count)]
        addresses = [f"127.0.0.1:{port}" for port in ports]
        first, *others = [
            NodeProcess(
                f"node-{i}",
                warehouse,
                port=port,
                peers=[a for a in addresses if not a.endswith(f":{port}")],
                extra=extra,
                spark_master=master,
            )
            for i, port in enumerate(ports, start=1)
        ]
        await first.start()
        procs = [first, *await asyncio.gather(*(proc.start() for proc in others))]

        async def scraped() -> NodeCounts:
            samples = [await _scrape(proc.address) for proc in procs]
            durable: dict[float, float] = {}
            for sample in samples:
                for le, count in sample.items():
                    if isinstance(le, float):
                        durable[le] = durable.get(le, 0.0) + count
            stages: dict[str, dict[float, float]] = {}
            for sample in samples:
                for key, count in sample.items():
                    if isinstance(key, tuple):
                        stage = stages.setdefault(key[0], {})
                        stage[key[1]] = stage.get(key[1], 0.0) + count
            return NodeCounts(
                int(sum(s.get("deltaflow_commits_total", 0) for s in samples)),
                sum(s.get("deltaflow_commit_seconds_sum", 0.0) for s in samples),
                int(max(s.get("deltaflow_largest_group_rows", 0) for s in samples)),
                durable,
                int(sum(s.get("deltaflow_commit_conflicts_total", 0) for s in samples)),
                int(sum(s.get("deltaflow_groups_sent_back_total", 0) for s in samples)),
                stages,
            )

        async def stop_procs() -> None:
            for proc in reversed(procs):
                await proc.stop()
            if servers is not None:
                await asyncio.to_thread(servers.stop)

        try:
            await wait_for_members([proc.address for proc in procs])
        except BaseException:  # a cluster that never formed: its processes must not linger
            await stop_procs()
            raise
        return first.address, scraped, stop_procs

    from deltaflow.engines import SparkOptions
    from deltaflow.server import NodeConfig, start_local_nodes
    from deltaflow.spark_integration import SparkConfig

    nodes = await start_local_nodes(
        count,
        NodeConfig(
            node_id="node-1",
            warehouse=warehouse,
            port=0,
            engine=(
                SparkOptions(config=SparkConfig(master="local[*]"), writer=writer)
                if engine == SparkOptions.name
                else engine
            ),
            table_buckets=buckets,
            deletion_vectors=vectors,
        ),
    )

    async def counted() -> NodeCounts:
        snapshots = [n.statistics() for n in nodes]
        stats = [snapshot.engine for snapshot in snapshots]
        durable: dict[float, float] = {}
        stages: dict[str, dict[float, float]] = {"queued": {}, "committing": {}, "node": {}}
        for snapshot, s in zip(snapshots, stats, strict=True):
            _add_histogram(durable, s.batch_durable_seconds_histogram)
            _add_histogram(stages["queued"], s.batch_queued_seconds_histogram)
            _add_histogram(stages["committing"], s.batch_committing_seconds_histogram)
            _add_histogram(stages["node"], snapshot.dispatcher.batch_seconds_histogram)
        return NodeCounts(
            sum(s.commits for s in stats),
            sum(s.commit_seconds for s in stats),
            max(s.largest_group_rows for s in stats),
            durable,
            sum(s.commit_conflicts for s in stats),
            sum(s.groups_sent_back for s in stats),
            stages,
        )

    async def stop_nodes() -> None:
        for node in reversed(nodes):
            await node.stop()

    return nodes[0].address, counted, stop_nodes


async def _scrape(address: str) -> dict[Any, float]:
    """A node's ``/metrics``: sample name -> value (one node, so no label is needed), and the
    buckets of its staged-to-durable histogram: upper bound (a float) -> cumulative count."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session, session.get(f"http://{address}/metrics") as r:
        text = await r.text()
    out: dict[Any, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels.keys() - {"node"}:
                out[sample.name] = sample.value
            elif sample.name == "deltaflow_batch_durable_seconds_bucket":
                out[float(sample.labels["le"])] = sample.value  # keyed by its bound
            elif sample.name == "deltaflow_batch_stage_seconds_bucket":
                out[(sample.labels["stage"], float(sample.labels["le"]))] = sample.value
    return out


def _spark_merge_sql(path: Path, staging: Path) -> str:
    cols = ["id", "key", "ts", "value", "payload"]
    return (
        f"MERGE INTO delta.`{path}` AS t USING parquet.`{staging}` AS s ON t.id = s.id "
        "WHEN MATCHED AND s.is_delete THEN DELETE "
        f"WHEN MATCHED THEN UPDATE SET {', '.join(f't.{c} = s.{c}' for c in cols)} "
        f"WHEN NOT MATCHED AND NOT s.is_delete THEN INSERT ({', '.join(cols)}) "
        f"VALUES ({', '.join(f's.{c}' for c in cols)})"
    )


def run_spark_batches(
    warehouse: Path, total: int, *, table: str, batch_rows: int, limit: int | None = None
) -> Run:
    """Spark MERGE of each ``batch_rows``-row batch as it fills (one commit per batch).

    The batch is deduplicated by id (last wins), staged as Parquet and merged with
    ``MERGE INTO ... WHEN MATCHED AND s.is_delete THEN DELETE``, like deltaflow's Spark engine.
    A row's latency runs from its chunk being produced to its batch's MERGE returning.
    """
    import pyarrow.parquet as pq

    spark = warm_up_spark(warehouse)
    path = warehouse / table
    staging_dir = warehouse / ".bench-staging" / table
    staging_dir.mkdir(parents=True, exist_ok=True)
    _create_spark_table(spark, path)
    latencies: array[float] = array("d")
    commits, commit_seconds, rows = 0, 0.0, 0
    started = time.monotonic()
    pending: list[tuple[Chunk, float]] = []

    def merge() -> None:
        nonlocal commits, commit_seconds, rows
        began = time.monotonic()
        data = last_per_id(arrow_of([c for c, _ in pending]))
        staging = staging_dir / f"{uuid.uuid4().hex}.parquet"
        pq.write_table(data, staging)
        spark.sql(_spark_merge_sql(path, staging))
        staging.unlink()
        done = time.monotonic()
        commits += 1
        commit_seconds += done - began
        for chunk, produced in pending:
            latencies.extend(itertools.repeat(done - produced, len(chunk)))
            rows += len(chunk)
        pending.clear()

    buffered = 0
    for chunk in generate(total, limit):
        pending.append((chunk, time.monotonic()))
        buffered += len(chunk)
        if buffered >= batch_rows:
            merge()
            buffered = 0
    if pending:
        merge()
    seconds = time.monotonic() - started
    stop_spark()
    note = f"{batch_rows:,}-row batches"
    return Run(rows, seconds, latencies, commits, commit_seconds, note=note)


def run_deltars_bulk(warehouse: Path, total: int) -> Run:
    """One delta-rs MERGE of all rows at once into an empty, existing table."""
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    path = str(warehouse / "bulk_delta_rs")
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("key", pa.string()),
            ("ts", pa.float64()),
            ("value", pa.float64()),
            ("payload", pa.string()),
        ]
    )
    write_deltalake(path, schema.empty_table(), mode="append")
    started = time.monotonic()
    pending = [(chunk, time.monotonic()) for chunk in generate(total)]
    began = time.monotonic()
    data = last_per_id(arrow_of([c for c, _ in pending]))
    values = {c: f"s.{c}" for c in schema.names}
    (
        DeltaTable(path)
        .merge(
            data,
            predicate="t.id = s.id",
            source_alias="s",
            target_alias="t",
            streamed_exec=False,
        )
        .when_matched_delete(predicate="s.is_delete")
        .when_matched_update(updates=values)
        .when_not_matched_insert(updates=values, predicate="NOT s.is_delete")
        .execute()
    )
    done = time.monotonic()
    latencies: array[float] = array("d")
    for chunk, produced in pending:
        latencies.extend(itertools.repeat(done - produced, len(chunk)))
    return Run(total, done - started, latencies, 1, done - began, note="one MERGE")


@dataclass(frozen=True, slots=True)
class Variant:
    """A benchmarked way of getting the rows into a Delta table.

    Attributes:
        name: the ``--variant`` name.
        table: the table it writes, under the warehouse.
        run: runs it: ``run(warehouse, total_rows)``.
        limit: rows it processes, given the total (the naive loop runs on a prefix).
    """

    name: str
    table: str
    run: Callable[[Path, int], Run]
    limit: Callable[[int], int | None] = lambda _total: None


def _procs_variant(engine: str, kind: str, **options: Any) -> Variant:
    """Nodes as processes, with ``options`` of :func:`run_deltaflow`:
    ``deltaflow-<engine>-<kind>``."""
    name = f"deltaflow-{engine}-{kind}"
    table = name.replace("-", "_")
    options["layout"] = "process"
    return Variant(name, table, lambda w, n: run_deltaflow(w, n, engine, table=table, **options))


def _dv_variant(engine: str, kind: str, **options: Any) -> Variant:
    """A table with deletion vectors (merge-on-read): ``deltaflow-<engine>-<kind>-dv``."""
    return _procs_variant(engine, f"{kind}-dv", vectors=True, **options)


def _spark_variant(kind: str, **options: Any) -> Variant:
    """The Spark engine with the Arrow source (``writer``, ``spark``):
    ``deltaflow-spark-<kind>``."""
    return _procs_variant("spark", kind, arrow=True, **options)


VARIANTS: Final = (
    Variant(
        "deltaflow-spark",
        "deltaflow_spark",
        lambda w, n: run_deltaflow(w, n, "spark", table="deltaflow_spark"),
    ),
    Variant(
        "deltaflow-spark-sql",
        "deltaflow_spark_sql",
        lambda w, n: run_deltaflow(w, n, "spark", table="deltaflow_spark_sql", writer="sql"),
    ),
    Variant(
        "deltaflow-spark-flat",
        "deltaflow_spark_flat",
        lambda w, n: run_deltaflow(w, n, "spark", table="deltaflow_spark_flat", buckets=0),
    ),
    Variant(
        "deltaflow-delta-rs",
        "deltaflow_delta_rs",
        lambda w, n: run_deltaflow(w, n, "delta-rs", table="deltaflow_delta_rs"),
    ),
    Variant(
        "deltaflow-spark-procs",
        "deltaflow_spark_procs",
        lambda w, n: run_deltaflow(w, n, "spark", table="deltaflow_spark_procs", layout="process"),
    ),
    Variant(
        "deltaflow-delta-rs-procs",
        "deltaflow_delta_rs_procs",
        lambda w, n: run_deltaflow(
            w, n, "delta-rs", table="deltaflow_delta_rs_procs", layout="process"
        ),
    ),
    Variant(
        "deltaflow-spark-arrow",
        "deltaflow_spark_arrow",
        lambda w, n: run_deltaflow(w, n, "spark", table="deltaflow_spark_arrow", arrow=True),
    ),
    Variant(
        "deltaflow-spark-arrow-procs",
        "deltaflow_spark_arrow_procs",
        lambda w, n: run_deltaflow(
            w, n, "spark", table="deltaflow_spark_arrow_procs", layout="process", arrow=True
        ),
    ),
    Variant(
        "deltaflow-delta-rs-arrow-procs",
        "deltaflow_delta_rs_arrow_procs",
        lambda w, n: run_deltaflow(
            w, n, "delta-rs", table="deltaflow_delta_rs_arrow_procs", layout="process", arrow=True
        ),
    ),
    # The Spark engine elsewhere than in the node: a standalone cluster (both writers: the
    # SQL writer's MERGEs run on its executor) and a Spark Connect server (SQL only), beside
    # the SQL writer in the node for comparison.
    _spark_variant("sql-arrow-procs", writer="sql"),
    _spark_variant("cluster-arrow-procs", spark="cluster"),
    _spark_variant("cluster-sql-arrow-procs", writer="sql", spark="cluster"),
    _spark_variant("connect-arrow-procs", writer="sql", spark="connect"),  # SQL, as always there
    # Nodes into one table by count (the object-store bench, docs/object-storage.md).
    _procs_variant("delta-rs", "1node-arrow-procs", arrow=True, nodes=1),
    _procs_variant("delta-rs", "3node-arrow-procs", arrow=True, nodes=3),
    _spark_variant("1node-arrow-procs", nodes=1),
    _spark_variant("3node-arrow-procs", nodes=3),
    _dv_variant("spark", "arrow-procs", arrow=True),  # the Arrow source
    _dv_variant("delta-rs", "arrow-procs", arrow=True),
    _dv_variant("spark", "paced", rate=PACED_RATE),  # the dict source, paced
    _dv_variant("delta-rs", "paced", rate=PACED_RATE),
    Variant(
        "naive-spark-merge",
        "naive_spark",
        lambda w, n: run_spark_batches(
            w, n, table="naive_spark", batch_rows=CHUNK_ROWS, limit=NAIVE_ROWS
        ),
        limit=lambda n: min(n, NAIVE_ROWS),
    ),
    Variant(
        "microbatch-spark",
        "microbatch_spark",
        lambda w, n: run_spark_batches(w, n, table="microbatch_spark", batch_rows=MICRO_BATCH_ROWS),
    ),
    Variant(
        "bulk-spark",
        "bulk_spark",
        lambda w, n: run_spark_batches(w, n, table="bulk_spark", batch_rows=max(n, 1)),
    ),
    Variant("bulk-delta-rs", "bulk_delta_rs", run_deltars_bulk),
)
BY_NAME: Final = {v.name: v for v in VARIANTS}
#: The variants of a run on object storage (``--warehouse s3://...``): 1, 2 and 3 delta-rs
#: nodes, Spark's two, and one bulk delta-rs MERGE into the same store.
STORE_VARIANTS: Final = (
    "deltaflow-delta-rs-1node-arrow-procs",
    "deltaflow-delta-rs-arrow-procs",
    "deltaflow-delta-rs-3node-arrow-procs",
    "deltaflow-spark-arrow-procs",
    "bulk-delta-rs",
)


def run_variant(name: str, total: int, warehouse: Path, out: Path) -> None:
    """Child process: run one variant and write its :class:`Result` as JSON to ``out``."""
    peaks = PeakRss()
    run = BY_NAME[name].run(warehouse, total)
    rss_self, rss_children = peaks.stop()  # before sorting the latencies below
    ordered = sorted(run.latencies)
    result = Result(
        variant=name,
        rows=run.rows,
        seconds=run.seconds,
        rows_per_s=run.rows / run.seconds if run.seconds > 0 else float("nan"),
        p50_s=_quantile(ordered, 0.50),
        p95_s=_quantile(ordered, 0.95),
        p99_s=_quantile(ordered, 0.99),
        commits=run.commits,
        mean_commit_s=run.commit_seconds / run.commits if run.commits else float("nan"),
        rss_self_mib=rss_self,
        rss_children_mib=rss_children,
        note=run.note,
        ack_p50_s=run.ack.p50 if run.ack is not None else float("nan"),
        ack_p99_s=run.ack.p99 if run.ack is not None else float("nan"),
        races=run.races,
        sent_back=run.sent_back,
        client_cpu_s=run.client_cpu_s,
        nodes_cpu_s=run.nodes_cpu_s,
    )
    out.write_text(json.dumps(asdict(result)))


# -- the parent: run every variant, check, report -----------------------------------------


def count_table(path: Path) -> tuple[int, int, int]:
    """Rows, distinct ids and versions of a Delta table, read with delta-rs (not Spark),
    through its query engine, which applies deletion vectors (on a store, its settings from
    ``AWS_*``)."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    table = DeltaTable(str(path))
    query = QueryBuilder().register("t", table)
    counted = query.execute("SELECT count(*) AS n, count(DISTINCT id) AS d FROM t").read_all()
    row = pa.table(counted).to_pylist()[0]
    return int(row["n"]), int(row["d"]), table.version() + 1


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


def print_table(results: list[Result]) -> None:
    """Print the results table."""
    print(STAMP_LINE)
    print(
        f"{'variant':<25}{'rows':>10}{'time':>9}{'rows/s':>10}{'p50 lat':>9}{'p95 lat':>9}"
        f"{'p99 lat':>9}"
        f"{'commits':>8}{'mean cmt':>9}{'RSS py':>9}{'RSS sub':>9}{'RSS sum':>9}  check"
    )
    print(STAMP_LINE)
    for r in results:
        print(
            f"{r.variant:<25}{r.rows:>10,}{_fmt_s(r.seconds):>9}{r.rows_per_s:>10,.0f}"
            f"{_fmt_s(r.p50_s):>9}{_fmt_s(r.p95_s):>9}{_fmt_s(r.p99_s):>9}{r.commits:>8}"
            f"{_fmt_s(r.mean_commit_s):>9}"
            f"{r.rss_self_mib:>8.0f}M{r.rss_children_mib:>8.0f}M"
            f"{r.rss_self_mib + r.rss_children_mib:>8.0f}M  {r.check}"
        )
    print(STAMP_LINE)
    print(
        "time: first row produced to last commit durable (startup excluded); latency: row "
        "produced -> durable/acked;\nRSS: peak of the variant's Python process (py) and the sum "
        "of the peaks of the processes it started (sub: Spark's JVM, or the node processes and "
        "their JVMs); sum = py + sub (peaks may not coincide)"
    )
    for r in results:
        if r.note:
            print(f"  {r.variant}: {r.note}")


def print_ratios(results: list[Result]) -> None:
    """Print the throughput ratios and the latency-to-commit-time ratios."""
    by = {r.variant: r for r in results}

    def ratio(a: str, b: str) -> None:
        if a in by and b in by:
            print(f"  {a} / {b} rows/s: {by[a].rows_per_s / by[b].rows_per_s:8.2f}x")

    print("ratios:")
    for spark_variant in (n for n in by if n.startswith("deltaflow-spark") and "-paced" not in n):
        ratio(spark_variant, "naive-spark-merge")
        ratio(spark_variant, "microbatch-spark")
        ratio(spark_variant, "bulk-spark")
    ratio("deltaflow-delta-rs", "bulk-delta-rs")
    ratio("deltaflow-delta-rs-procs", "bulk-delta-rs")
    ratio("deltaflow-delta-rs-1node-arrow-procs", "bulk-delta-rs")
    ratio("deltaflow-delta-rs-arrow-procs", "bulk-delta-rs")
    ratio("deltaflow-delta-rs-3node-arrow-procs", "bulk-delta-rs")
    for engine in ("delta-rs", "spark"):  # a table's rate on 2 and 3 nodes against 1
        for more in ("arrow-procs", "3node-arrow-procs"):
            ratio(f"deltaflow-{engine}-{more}", f"deltaflow-{engine}-1node-arrow-procs")
    ratio("deltaflow-delta-rs-arrow-procs-dv", "bulk-delta-rs")
    for name in by:
        if "-paced" in name:
            r = by[name]
            print(
                f"  {name}: sustained {r.rows_per_s:,.0f} rows/s (source paced at "
                f"{PACED_RATE:,}/s), time to table p50 {_fmt_s(r.p50_s)}, p95 {_fmt_s(r.p95_s)}"
            )
    for name in by:
        r = by[name]
        if name.startswith("deltaflow-") and r.versions:
            print(
                f"  {name}: table versions {r.versions} ({r.versions / r.seconds:.1f}/s); "
                f"version races lost {r.races} ({100 * r.races / r.versions:.1f} per 100 "
                f"versions); groups sent back {r.sent_back}"
            )
    for name in by:
        r = by[name]
        if name.startswith("deltaflow-") and r.client_cpu_s == r.client_cpu_s:  # not NaN
            print(
                f"  {name}: CPU per row: client {1e6 * r.client_cpu_s / r.rows:.2f} µs "
                f"(the bench's source excluded), nodes {1e6 * r.nodes_cpu_s / r.rows:.2f} µs"
            )
    for name in by:
        if not name.startswith("deltaflow-"):
            continue
        r = by[name]
        print(
            f"  {name}: mean commit {_fmt_s(r.mean_commit_s)} ({r.commits} commits); p99 ack "
            f"(send to ack) {_fmt_s(r.ack_p99_s)} = {r.ack_p99_s / r.mean_commit_s:.1f}x it "
            f"(p50 {_fmt_s(r.ack_p50_s)}); p99 time to table (produced to ack) "
            f"{_fmt_s(r.p99_s)} = {r.p99_s / r.mean_commit_s:.1f}x"
        )


def plot(results: list[Result], path: Path) -> None:
    """Two panels: rows/s per variant (log scale), and p50/p99 latency per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.variant for r in results]
    xs = range(len(results))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    left.bar(xs, [r.rows_per_s for r in results], color="tab:blue")
    left.set_yscale("log")
    left.set_ylabel("rows/s (log)")
    left.set_title("throughput")
    width = 0.4
    right.bar([x - width / 2 for x in xs], [r.p50_s for r in results], width, label="p50")
    right.bar([x + width / 2 for x in xs], [r.p99_s for r in results], width, label="p99")
    right.set_yscale("log")
    right.set_ylabel("seconds, row produced -> durable (log)")
    right.set_title("latency")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(list(xs), names, rotation=25, ha="right")
        ax.grid(axis="y", which="both", alpha=0.3)
    rows = max((r.rows for r in results), default=0)
    fig.suptitle(f"deltaflow ingest benchmark ({rows:,} rows, {os.cpu_count()} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _round_trip_ms(options: dict[str, str], bucket: str, count: int = 40) -> float:
    """Median milliseconds of a small request (HEAD of the bucket) to the store ``options``
    reach: what the latency proxy adds, measured rather than assumed."""
    import boto3  # type: ignore[import-untyped]

    client = boto3.client(
        "s3",
        endpoint_url=options["AWS_ENDPOINT_URL"],
        aws_access_key_id=options["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=options["AWS_SECRET_ACCESS_KEY"],
        region_name=options["AWS_REGION"],
    )
    client.head_bucket(Bucket=bucket)  # the connection, untimed
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        client.head_bucket(Bucket=bucket)
        times.append(time.perf_counter() - t0)
    return _quantile(sorted(times), 0.5) * 1000


def run_all(
    total: int,
    names: list[str],
    out_dir: Path,
    keep: bool,
    store: bool = False,
    latency_ms: float | None = None,
) -> int:
    """Parent: run each variant in its own subprocess, verify its table, print and save.
    ``store``: the tables go to a bucket of an S3 server (versitygw) the run starts on
    127.0.0.1; its settings reach the variants and their nodes through ``AWS_*`` variables.
    ``latency_ms``: everything reaches the server through a proxy that delays each answer by
    that much (Toxiproxy; 0 measures the proxy itself)."""
    from deltaflow.storage.paths import location

    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="deltaflow-bench-"))
    servers: list[Any] = []
    where = str(scratch)
    described = ""
    if store:
        from deltaflow.testing.object_store import LatencyS3, S3Server

        server = S3Server(scratch / "s3").start()
        servers.append(server)
        where = server.create_bucket("deltaflow-bench") + "/warehouse"
        options = server.storage_options
        described = " (versitygw on 127.0.0.1"
        if latency_ms is not None:
            proxy = LatencyS3(scratch / "proxy", server, latency_ms).start()
            servers.append(proxy)
            direct = _round_trip_ms(options, "deltaflow-bench")
            options = proxy.storage_options
            described += (
                f", through Toxiproxy adding {latency_ms:g} ms to each answer: a small request's "
                f"round trip {direct:.1f} ms direct, "
                f"{_round_trip_ms(options, 'deltaflow-bench'):.1f} ms through it"
            )
        described += ")"
        os.environ.update(options)
    warehouse = location(where)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"deltaflow ingest benchmark: {total:,} rows ({max(1, total // 2):,} distinct ids, "
        f"~{DELETE_FRACTION:.0%} deletes), {os.cpu_count()} cores, load {load}\n"
        f"warehouse {where}{described}",
        flush=True,
    )
    results: list[Result] = []
    expected: dict[int | None, int] = {}
    began = time.monotonic()
    try:
        for name in names:
            variant = BY_NAME[name]
            out = scratch / f"{name}.json"
            log = out_dir / f"ingest-{name}.log"
            print(f"running {name} ... ", end="", flush=True)
            t0 = time.monotonic()
            with log.open("w") as sink:
                command = [sys.executable, __file__, "--variant", name, "--rows", str(total)]
                proc = subprocess.run(
                    [*command, "--warehouse", where, "--out", str(out)],
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    check=False,
                )
            if proc.returncode != 0:
                tail = log.read_text().splitlines()[-15:]
                print(f"FAILED (exit {proc.returncode}); see {log}:\n  " + "\n  ".join(tail))
                continue
            result = Result(**json.loads(out.read_text()))
            limit = variant.limit(total)
            if limit not in expected:
                expected[limit] = expected_rows(total, limit)
            rows, distinct, versions = count_table(warehouse / variant.table)
            ok = rows == expected[limit] == distinct
            result = Result(
                **{
                    **asdict(result),
                    "table_rows": rows,
                    "expected_rows": expected[limit],
                    "versions": versions,
                    "check": "OK" if ok else f"MISMATCH ({rows:,} rows, {distinct:,} ids)",
                }
            )
            results.append(result)
            print(
                f"{time.monotonic() - t0:.0f}s, {result.rows_per_s:,.0f} rows/s, table "
                f"{rows:,} rows (expected {expected[limit]:,}) {result.check}",
                flush=True,
            )
    finally:
        for running in reversed(servers):
            running.stop()
        if keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"\ntotal benchmark time {time.monotonic() - began:.0f}s\n")
    if results:
        print_table(results)
        print_ratios(results)
        (out_dir / "ingest.json").write_text(
            json.dumps({"rows": total, "results": [asdict(r) for r in results]}, indent=2)
        )
        plot(results, out_dir / "ingest.png")
        print(f"\nwrote {out_dir / 'ingest.json'} and {out_dir / 'ingest.png'}")
    good = len(results) == len(names) and all(r.check == "OK" for r in results)
    return 0 if good else 1


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="N, rows to ingest")
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated variants to run (default: all; on a store, the store's)",
    )
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="where results go")
    parser.add_argument("--keep", action="store_true", help="keep the warehouse directory")
    parser.add_argument(
        "--warehouse",
        help="s3://...: write the tables to object storage; the bench starts its own S3 server "
        "(versitygw, on 127.0.0.1) for the run (default: a temporary directory)",
    )
    parser.add_argument(
        "--store-latency",
        type=float,
        metavar="MS",
        help="with --warehouse s3://...: reach the S3 server through a proxy (Toxiproxy, built "
        "by `make toxiproxy`) that delays each answer by MS milliseconds, as a remote store "
        "would; 0 measures the proxy alone",
    )
    parser.add_argument(
        "--window",
        type=int,
        metavar="BATCHES",
        help="batches of 4,000 rows the client keeps in flight per node (default: 16 with "
        "delta-rs, 32 with Spark; a stream to 3 nodes keeps three times as many)",
    )
    parser.add_argument("--variant", choices=sorted(BY_NAME), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rows < 2:
        parser.error("--rows must be at least 2")
    if args.variant:
        if args.warehouse is None or args.out is None:
            parser.error("--variant needs --warehouse and --out")
        from deltaflow.storage.paths import location

        run_variant(args.variant, args.rows, location(args.warehouse), args.out)  # type: ignore[arg-type]
        return 0
    if args.window is not None:  # reaches the variants' processes
        if args.window < 1:
            parser.error("--window takes at least 1 batch")
        os.environ["BENCH_WINDOW_PER_NODE"] = str(args.window)
    store = args.warehouse is not None
    if store and not args.warehouse.startswith("s3://"):
        parser.error("--warehouse takes s3://... (the bench starts the S3 server itself)")
    if args.store_latency is not None and (not store or args.store_latency < 0):
        parser.error("--store-latency takes MS >= 0 and needs --warehouse s3://...")
    default = STORE_VARIANTS if store else tuple(BY_NAME)
    names = [n.strip() for n in (args.variants or ",".join(default)).split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {sorted(BY_NAME)}")
    return run_all(args.rows, names, args.out_dir, args.keep, store, args.store_latency)


if __name__ == "__main__":
    sys.exit(main())
