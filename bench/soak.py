"""Soak benchmark: does minute 30 of a steady stream look like minute 2?

Three node processes (``deltaflow serve``, delta-rs by default, on 127.0.0.1) take three
concurrent streams paced at ``--rate`` rows/s each, for ``--minutes`` minutes:

- ``soak_cow``: a keyed table upserted copy-on-write;
- ``soak_dv``: a keyed table with deletion vectors (merge-on-read);
- ``soak_append``: an append table (no key).

The keyed streams first insert every key of a bounded key space (``--keys``) once, then
update random keys with about 1% deletes, as a change feed does: the table's size stays
steady while its commits go on. Every minute the bench prints one line per table (rows/s
acknowledged, p50/p99 time to table, the table's live files and the rows and bytes in them,
its versions, its ``_delta_log`` files and bytes) and one of the processes' RSS and CPU; at
the end the figures (the last five minutes against minutes 2-6), a full read of each table by
``deltalake`` and ``polars`` against the same rows written once into a fresh table, and a
check of every table's rows against what the streams produced::

    .venv/bin/python bench/soak.py                          # 30 minutes
    .venv/bin/python bench/soak.py --minutes 3 --json /tmp/soak.json
    .venv/bin/python bench/soak.py --minutes 2 --warehouse s3://any   # on the S3 server

A row's time to table runs from the moment the paced schedule says it is due (not when the
generator got round to making it, so a stream that falls behind shows as latency) to its
batch's ack. See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

DEFAULT_MINUTES: Final = 30
DEFAULT_RATE: Final = 1_500  # rows/s of each stream (the workload)
DEFAULT_KEYS: Final = 50_000  # inserted in the first ~33 s at the default rate
DEFAULT_NODES: Final = 3
#: Pages of a paced stream are cut after this long (as bench/ingest.py's paced variants):
#: at 1,500 rows/s over 64 partitions a 1,000-row page would take 43 s to fill.
DEFAULT_FLUSH_INTERVAL: Final = 0.25
DELETE_FRACTION: Final = 0.01
#: The paced sources produce the rows that fell due every TICK seconds.
TICK: Final = 0.05
SEED: Final = 20_250_101
SCHEMA: Final = "id:long,seq:long,value:double,payload:string"
#: Minutes the figures compare the last ones against (the first is the keys' insertion).
BASELINE: Final = range(2, 7)
LAST_MINUTES: Final = 5
#: The goal: each figure of the last minutes within this factor of the baseline's.
GOAL: Final = 1.2
#: The goal for a full read of the soaked table against the same rows written once.
READ_GOAL: Final = 1.5
READS: Final = 3  # full reads per table and reader; the median is reported
STREAM_WINDOW: Final = 1024  # batches in flight per stream: the window never paces a stream
PER_PARTITION_IN_FLIGHT: Final = 16
BUCKET_COLUMN: Final = "_deltaflow_bucket"
OUT_DIR: Final = Path(__file__).resolve().parent / "out"


@dataclass(frozen=True, slots=True)
class TableSpec:
    """One of the soaked tables: its name, its key (None: append) and deletion vectors."""

    name: str
    key: str | None
    deletion_vectors: bool = False

    @property
    def kind(self) -> str:
        if self.key is None:
            return "append"
        return "keyed, deletion vectors" if self.deletion_vectors else "keyed, copy-on-write"


TABLES: Final = (
    TableSpec("soak_cow", "id"),
    TableSpec("soak_dv", "id", deletion_vectors=True),
    TableSpec("soak_append", None),
)


# -- the paced streams ---------------------------------------------------------------------


class PacedStream:
    """One table's source, paced at ``rate`` rows/s from ``began`` until ``ends``, and what
    its acks measured, per minute of the soak (by when the ack arrived).

    Keyed: the first ``keys`` rows insert ids ``0 .. keys - 1`` once, then rows update a
    random id, about ``DELETE_FRACTION`` of them deleting it instead. Append: row ``seq`` has
    id ``seq``. Every row carries ``seq``, its index in the stream, so the table's sum of
    ``seq`` checks which version of each key it holds.
    """

    def __init__(self, spec: TableSpec, rate: float, keys: int, minutes: int) -> None:
        self.spec = spec
        self.rate = rate
        self.keys = keys
        self.began = self.ends = 0.0
        self.made = 0
        self.rng = random.Random(f"{SEED}-{spec.name}")
        self.due: dict[int, float] = {}  # id(item) -> when it fell due, until acked
        self.latencies = [array("d") for _ in range(minutes)]
        self.last_ack = 0.0
        self.last_seq: dict[int, int] = {}  # keyed: each live id's last seq

    def _item(self, seq: int) -> Any:
        from deltaflow import Delete

        key = seq  # append, and the keyed tables' first pass over their keys
        if self.spec.key is not None:
            if seq >= self.keys:
                key = self.rng.randrange(self.keys)
                if self.rng.random() < DELETE_FRACTION:
                    self.last_seq.pop(key, None)
                    return Delete({"id": key})
            self.last_seq[key] = seq
        payload = f"{seq:012d}" + self.rng.randbytes(44).hex()  # 100 characters
        return {"id": key, "seq": seq, "value": self.rng.random() * 1000, "payload": payload}

    async def source(self) -> AsyncIterator[Any]:
        """The rows, each yielded once it falls due (row ``seq`` at ``began + seq / rate``)."""
        while True:
            now = min(time.monotonic(), self.ends)
            due = int((now - self.began) * self.rate)
            for seq in range(self.made, due):
                item = self._item(seq)
                self.due[id(item)] = self.began + seq / self.rate
                yield item
            self.made = max(self.made, due)
            if now >= self.ends:
                return
            # Pacing against the schedule, not waiting for an event: the rows fall due by time.
            await asyncio.sleep(TICK)

    def on_ack(self, items: Sequence[Any]) -> None:
        now = time.monotonic()
        minute = min(len(self.latencies) - 1, int((now - self.began) // 60))
        self.latencies[minute].extend(now - self.due.pop(id(item)) for item in items)
        self.last_ack = now

    def seconds_of(self, minute: int) -> float:
        """How long ``minute`` (1-based) lasted: 60 s, and the last one until its last ack
        (the rows still in flight when the source stopped are acknowledged in it)."""
        if minute < len(self.latencies):
            return 60.0
        return max(60.0, self.last_ack - (self.began + 60 * (minute - 1)))

    def expected(self) -> tuple[int, int]:
        """Rows the table must hold and the sum of their ``seq``."""
        if self.spec.key is None:
            return self.made, self.made * (self.made - 1) // 2
        return len(self.last_seq), sum(self.last_seq.values())


# -- what the tables and nodes look like ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A table as the ``deltalake`` reader sees it at a moment."""

    live_files: int
    file_rows: int  # rows in the live files, those their deletion vectors hide included
    file_bytes: int
    versions: int
    log_files: int
    log_bytes: int


class Warehouse:
    """Where the tables are: a directory, or a prefix in a bucket of the S3 server."""

    def __init__(self, where: str, options: dict[str, str] | None) -> None:
        from deltaflow.storage.paths import location

        self.where = where
        self.options = options
        self.location = location(where, options)
        self._tables: dict[str, Any] = {}

    def uri(self, table: str) -> str:
        return f"{self.where.rstrip('/')}/{table}"

    def open(self, table: str) -> Any:
        from deltalake import DeltaTable

        return DeltaTable(self.uri(table), storage_options=self.options)

    def snapshot(self, table: str) -> Snapshot:
        """Blocking: the table's live files (``get_add_actions``) and its log, now."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if table in self._tables:  # only the commits since the last snapshot are read
            self._tables[table].update_incremental()
        else:
            self._tables[table] = self.open(table)
        dt = self._tables[table]
        adds = pa.table(dt.get_add_actions(flatten=True))
        log_files, log_bytes = self._log_size(table)
        return Snapshot(
            live_files=adds.num_rows,
            file_rows=int(pc.sum(adds.column("num_records")).as_py() or 0),
            file_bytes=int(pc.sum(adds.column("size_bytes")).as_py() or 0),
            versions=dt.version() + 1,
            log_files=log_files,
            log_bytes=log_bytes,
        )

    def _log_size(self, table: str) -> tuple[int, int]:
        """Files and bytes under the table's ``_delta_log`` (checkpoints included)."""
        if self.options is None:
            sizes = [e.stat().st_size for e in os.scandir(Path(self.uri(table)) / "_delta_log")]
            return len(sizes), sum(sizes)
        import boto3  # type: ignore[import-untyped]

        bucket, _, prefix = self.uri(table).removeprefix("s3://").partition("/")
        client = boto3.client(
            "s3",
            endpoint_url=self.options["AWS_ENDPOINT_URL"],
            aws_access_key_id=self.options["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.options["AWS_SECRET_ACCESS_KEY"],
            region_name=self.options["AWS_REGION"],
        )
        files = size = 0
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{prefix}/_delta_log/"
        ):
            for obj in page.get("Contents", []):
                files, size = files + 1, size + int(obj["Size"])
        return files, size


def _tree(pid: int) -> list[int]:
    """A process and its descendants (a Spark node's JVM)."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                pending += [int(child) for child in task.read_text().split()]
            except OSError:
                continue
    return found


def _rss_mib(pids: list[int]) -> float:
    """The processes' ``VmRSS`` summed, MiB (0 for one that is gone)."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")), 0)
    return total / 1024


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes used so far, seconds."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[int, int]:
    """The machine's busy and total clock ticks so far, all cores (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # less idle and iowait


class Usage:
    """The nodes' and the client's RSS and CPU, read from ``/proc`` at each minute's end: CPU
    as the share of a core each used since the previous reading, and the share of the
    machine's cores busy meanwhile (near 100%: the figures are the machine's, not
    deltaflow's)."""

    def __init__(self, procs: dict[str, int]) -> None:
        self.procs = procs  # node id -> pid
        self._last = self._read()

    def _read(self) -> tuple[float, dict[str, float], float, tuple[int, int]]:
        cpu = {node: _cpu_seconds(_tree(pid)) for node, pid in self.procs.items()}
        return time.monotonic(), cpu, _cpu_seconds([os.getpid()]), _machine_ticks()

    def sample(self, minute: int) -> NodesMinute:
        (t0, nodes0, client0, (busy0, total0)) = self._last
        self._last = now = self._read()
        t1, nodes1, client1, (busy1, total1) = now
        wall = max(t1 - t0, 1e-9)
        return NodesMinute(
            minute=minute,
            rss_mib={node: _rss_mib(_tree(pid)) for node, pid in self.procs.items()},
            cpu_cores={node: (nodes1[node] - nodes0[node]) / wall for node in self.procs},
            client_rss_mib=_rss_mib([os.getpid()]),
            client_cpu_cores=(client1 - client0) / wall,
            machine_busy=(busy1 - busy0) / max(total1 - total0, 1),
            load_1min=os.getloadavg()[0],
        )


# -- the per-minute rows and the figures -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class TableMinute:
    """One table's minute (a row of the JSON's ``minutes``)."""

    minute: int
    table: str
    rows_per_s: float
    p50_s: float
    p99_s: float
    live_files: int
    file_rows: int
    file_bytes: int
    versions: int
    log_files: int
    log_bytes: int


@dataclass(frozen=True, slots=True)
class NodesMinute:
    """The processes at the end of a minute (a row of the JSON's ``nodes``): RSS in MiB, CPU
    over the minute in cores (1.0: one core all the minute), the share of the machine's
    cores busy and its load average."""

    minute: int
    rss_mib: dict[str, float]
    cpu_cores: dict[str, float]
    client_rss_mib: float
    client_cpu_cores: float
    machine_busy: float
    load_1min: float


def _quantile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f}MiB"


def _table_minute(minute: int, stream: PacedStream, snap: Snapshot) -> TableMinute:
    ordered = sorted(stream.latencies[minute - 1])
    return TableMinute(
        minute=minute,
        table=stream.spec.name,
        rows_per_s=len(ordered) / stream.seconds_of(minute),
        p50_s=_quantile(ordered, 0.5),
        p99_s=_quantile(ordered, 0.99),
        **asdict(snap),
    )


def print_minute(row: TableMinute) -> None:
    print(
        f"min {row.minute:>3} {row.table:<12} {row.rows_per_s:>7,.0f} rows/s  "
        f"p50 {_fmt_s(row.p50_s):>7} p99 {_fmt_s(row.p99_s):>7}  "
        f"files {row.live_files:>5} ({row.file_rows:>9,} rows, {_mib(row.file_bytes):>9})  "
        f"versions {row.versions:>6}  log {row.log_files:>6} files {_mib(row.log_bytes):>9}",
        flush=True,
    )


@dataclass(frozen=True, slots=True)
class Figure:
    """One table's figure: the last minutes against the baseline minutes."""

    table: str
    what: str
    baseline: float
    last: float
    ratio: float  # last / baseline
    within_goal: bool


def figures(
    streams: list[PacedStream], rows: list[TableMinute], minutes: int
) -> tuple[list[int], list[int], list[Figure]]:
    """Live files and rows/s (means of the minutes) and p99 time to table (of every row of
    the minutes), the last ``LAST_MINUTES`` against ``BASELINE``; the minutes compared."""
    base = [m for m in BASELINE if m <= minutes] or [minutes]
    last = list(range(max(1, minutes - LAST_MINUTES + 1), minutes + 1))
    out: list[Figure] = []
    for stream in streams:
        mine = {r.minute: r for r in rows if r.table == stream.spec.name}

        def mean(attr: str, span: list[int], mine: dict[int, TableMinute] = mine) -> float:
            return statistics.fmean(getattr(mine[m], attr) for m in span)

        def p99(span: list[int], stream: PacedStream = stream) -> float:
            return _quantile(sorted(x for m in span for x in stream.latencies[m - 1]), 0.99)

        for what, b, lst, higher_is_worse in (
            ("live files", mean("live_files", base), mean("live_files", last), True),
            ("p99 time to table", p99(base), p99(last), True),
            ("rows/s", mean("rows_per_s", base), mean("rows_per_s", last), False),
        ):
            ratio = lst / b if b else float("inf")
            ok = ratio <= GOAL if higher_is_worse else ratio >= 1 / GOAL
            out.append(Figure(stream.spec.name, what, b, lst, ratio, ok))
    return base, last, out


# -- the full reads and the check ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Read:
    """A full read of a soaked table and of the same rows written once, seconds (median)."""

    table: str
    reader: str
    soaked_s: float
    optimized_s: float
    ratio: float
    soaked_files: int
    optimized_files: int
    within_goal: bool


@dataclass(frozen=True, slots=True)
class Check:
    """A table's rows against what its stream produced: count, distinct ids and sum of
    ``seq`` by ``deltalake``, and polars' count (None: not read); ``why``, if not ``ok``."""

    table: str
    rows: int | None
    distinct_ids: int | None
    seq_sum: int | None
    expected_rows: int
    expected_seq_sum: int
    polars_rows: int | None
    ok: bool
    why: str = ""


#: What the reads run in a child process (``sys.argv``: the task, the storage options as
#: JSON, the bucket column, the tables' URIs); prints its answer as JSON. ``count``: rows,
#: distinct ids and the sum of ``seq`` of the table; ``copy``: the table's rows written once
#: into the second (one file per bucket); ``deltalake`` and ``polars``: the seconds of a full
#: read of the table (after an untimed one, so the reader's first use is not counted) and
#: its rows. Through delta-rs's query engine, which applies deletion
#: vectors (its ``to_pyarrow_table`` refuses tables that have them), and
#: ``polars.read_delta``.
READER: Final = """
import json, sys, time
import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder, write_deltalake

task, options, bucket, uris = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4:]


def query(uri, sql):
    table = DeltaTable(uri, storage_options=options)
    return pa.table(QueryBuilder().register("t", table).execute(sql).read_all())


if task == "count":
    sql = "SELECT count(*) AS n, count(DISTINCT id) AS d, sum(seq) AS s FROM t"
    print(json.dumps(query(uris[0], sql).to_pylist()[0]))
elif task == "copy":
    data = query(uris[0], "SELECT * FROM t")
    by = [bucket] if bucket in data.column_names else None
    write_deltalake(uris[1], data, partition_by=by, storage_options=options)
    print(json.dumps({"rows": data.num_rows}))
else:  # a full read, timed after an untimed one: the reader's first use is not timed
    if task == "polars":
        import polars
        polar = {k.lower(): v for k, v in (options or {}).items()
                 if k != "AWS_EC2_METADATA_DISABLED"}  # delta-rs's alone
        def read():
            return polars.read_delta(uris[0], storage_options=polar or None).height
    else:
        def read():
            return query(uris[0], "SELECT * FROM t").num_rows
    read()
    t0 = time.perf_counter()
    rows = read()
    print(json.dumps({"seconds": time.perf_counter() - t0, "rows": rows}))
"""
#: A child that takes longer is killed and run again, up to ``READER_ATTEMPTS`` times: reads
#: of soaked tables with deletion vectors by deltalake 1.6.6 (``QueryBuilder``, and the
#: ``deletion_vectors()`` polars 1.44 calls) were seen to stall at 0% CPU, some for good.
READER_TIMEOUT: Final = 60.0
READER_ATTEMPTS: Final = 3


class Reader:
    """Runs :data:`READER`'s tasks on the warehouse's tables, each in a child process of its
    own (a fresh reader, and one that stalls cannot stall the bench), and notes the
    attempts that failed or stalled."""

    def __init__(self, warehouse: Warehouse) -> None:
        self.warehouse = warehouse
        self.notes: list[str] = []

    def __call__(self, task: str, *tables: str) -> Any:
        """Blocking: the task's answer; None if every attempt failed or stalled."""
        command = [
            sys.executable,
            "-c",
            READER,
            task,
            json.dumps(self.warehouse.options),
            BUCKET_COLUMN,
            *(self.warehouse.uri(t) for t in tables),
        ]
        for attempt in range(1, READER_ATTEMPTS + 1):
            what = f"{task} of {' into '.join(tables)} (attempt {attempt})"
            try:
                done = subprocess.run(
                    command, capture_output=True, text=True, timeout=READER_TIMEOUT, check=False
                )
            except subprocess.TimeoutExpired:  # run() killed the child
                self.notes.append(f"{what}: stalled, killed after {READER_TIMEOUT:.0f} s")
                continue
            if done.returncode == 0:
                return json.loads(done.stdout)
            tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
            self.notes.append(f"{what}: failed: {tail[0]}")
        return None

    def timed(self, kind: str, soaked: str, optimized: str) -> tuple[float, float, int] | None:
        """Blocking: the median seconds of ``READS`` full reads of each table by ``kind``,
        in turns (so that other work on the machine weighs on both alike), and the rows of
        the soaked one; None if a read never finished."""
        times: dict[str, list[float]] = {soaked: [], optimized: []}
        rows = 0
        for _ in range(READS):
            for table in (soaked, optimized):
                done = self(kind, table)
                if done is None:
                    return None
                times[table].append(float(done["seconds"]))
                rows = int(done["rows"]) if table == soaked else rows
        return statistics.median(times[soaked]), statistics.median(times[optimized]), rows


def check_and_read(
    warehouse: Warehouse, streams: list[PacedStream], polars: bool
) -> tuple[list[Check], list[Read], list[str]]:
    """Blocking: every table's rows against its stream's, and the full reads of each soaked
    table and of its rows written once into a fresh table, by ``deltalake`` and (``polars``:
    it is installed) by polars; notes on the reads that failed or stalled."""
    reader = Reader(warehouse)
    checks: list[Check] = []
    reads: list[Read] = []
    for stream in streams:
        name, copy = stream.spec.name, f"{stream.spec.name}_optimized"
        print(f"  reading {name} ...", flush=True)
        want_rows, want_sum = stream.expected()
        counted = reader("count", name)
        copied = reader("copy", name, copy)
        polars_rows: int | None = None
        if copied is not None:
            files = {t: warehouse.snapshot(t).live_files for t in (name, copy)}
            for kind in ("deltalake", "polars") if polars else ("deltalake",):
                timed = reader.timed(kind, name, copy)
                if timed is not None:
                    reads.append(_read(kind, name, timed[0], timed[1], files))
                    polars_rows = timed[2] if kind == "polars" else polars_rows
        if counted is None:
            why = "deltalake never finished counting it"
            checks.append(Check(name, None, None, None, want_rows, want_sum, None, False, why))
            continue
        rows, ids, total = int(counted["n"]), int(counted["d"]), int(counted["s"] or 0)
        ok = rows == ids == want_rows and total == want_sum and polars_rows in (None, want_rows)
        checks.append(Check(name, rows, ids, total, want_rows, want_sum, polars_rows, ok))
    return checks, reads, reader.notes


def _read(reader: str, table: str, soaked: float, optimized: float, files: dict[str, int]) -> Read:
    ratio = soaked / optimized if optimized else float("inf")
    return Read(
        table,
        reader,
        soaked,
        optimized,
        ratio,
        files[table],
        files[f"{table}_optimized"],
        ratio <= READ_GOAL,
    )


# -- the run ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Report:
    """Everything ``--json`` writes."""

    settings: dict[str, Any]
    minutes: list[TableMinute] = field(default_factory=list)
    nodes: list[NodesMinute] = field(default_factory=list)
    baseline_minutes: list[int] = field(default_factory=list)
    last_minutes: list[int] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # why the soak stopped early

    def write(self, path: Path | None) -> None:
        if path is not None:
            path.write_text(json.dumps(asdict(self), indent=2))


async def soak(args: argparse.Namespace, warehouse: Warehouse, report: Report) -> list[PacedStream]:
    """Create the tables, start the nodes, stream for ``args.minutes`` and print every
    minute; the streams, once the nodes are stopped (by pid)."""
    import deltaflow
    from deltaflow.testing import NodeProcess, free_port, wait_for_members

    for spec in TABLES:
        await asyncio.to_thread(
            deltaflow.create_table,
            warehouse.location,
            spec.name,
            schema=SCHEMA,
            key=spec.key or (),
            deletion_vectors=spec.deletion_vectors,
        )
    extra = ["--engine", args.engine, "--log-level", args.node_log_level]
    if args.engine == "spark":
        extra += ["--driver-memory", "1g"]
    ports = [free_port() for _ in range(args.nodes)]
    addresses = [f"127.0.0.1:{port}" for port in ports]
    procs = [
        NodeProcess(
            f"node-{i}",
            warehouse.location,
            port=port,
            peers=[a for a in addresses if not a.endswith(f":{port}")],
            extra=extra,
        )
        for i, port in enumerate(ports, start=1)
    ]
    try:
        await asyncio.gather(*(proc.start() for proc in procs))
        await wait_for_members(addresses)
        streams = [PacedStream(spec, args.rate, args.keys, args.minutes) for spec in TABLES]
        options = deltaflow.StreamerOptions(
            auto_flush_interval=args.flush_interval,
            max_in_flight=STREAM_WINDOW,
            per_partition_in_flight=PER_PARTITION_IN_FLIGHT,
        )
        async with deltaflow.connect(addresses) as client:
            began = time.monotonic()
            for stream in streams:
                stream.began, stream.ends = began, began + 60 * args.minutes
            running: list[asyncio.Task[Any]] = [
                asyncio.create_task(
                    client.stream_data(
                        stream.source(),
                        table=stream.spec.name,
                        key=stream.spec.key,
                        on_ack=stream.on_ack,
                        options=options,
                    )
                )
                for stream in streams
            ]
            try:
                await _every_minute(args, warehouse, report, streams, procs, running)
            finally:  # a stream that failed leaves the others to be cancelled
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
    finally:
        for proc in reversed(procs):
            await proc.stop()
        args.logs.mkdir(parents=True, exist_ok=True)
        for proc in procs:  # kept for when a stream failed: the nodes say why
            (args.logs / f"soak-{proc.node_id}.log").write_text("".join(proc.output))
    report.baseline_minutes, report.last_minutes, report.figures = figures(
        streams, report.minutes, args.minutes
    )
    return streams


async def _every_minute(
    args: argparse.Namespace,
    warehouse: Warehouse,
    report: Report,
    streams: list[PacedStream],
    procs: list[Any],
    running: list[asyncio.Task[Any]],
) -> None:
    """At the end of each minute, the tables' snapshots and the processes' RSS and CPU,
    printed; the last minute ends when every stream is acknowledged."""
    began = streams[0].began
    usage = Usage({proc.node_id: proc.proc.pid for proc in procs})
    for minute in range(1, args.minutes + 1):
        if minute < args.minutes:
            done, _ = await asyncio.wait(
                running, timeout=max(0.0, began + 60 * minute - time.monotonic())
            )
            for task in done:  # a stream that ended early failed: say why now
                task.result()
        else:  # the last minute's acks are those up to the end of the streams
            await asyncio.gather(*running)
        snaps = await asyncio.to_thread(lambda: [warehouse.snapshot(s.spec.name) for s in streams])
        for stream, snap in zip(streams, snaps, strict=True):
            row = _table_minute(minute, stream, snap)
            report.minutes.append(row)
            print_minute(row)
        used = usage.sample(minute)
        report.nodes.append(used)
        nodes = ", ".join(
            f"{n} {used.rss_mib[n]:,.0f}MiB {used.cpu_cores[n]:.2f} cores" for n in used.rss_mib
        )
        print(
            f"min {minute:>3} RSS and CPU: {nodes}; client {used.client_rss_mib:,.0f}MiB "
            f"{used.client_cpu_cores:.2f} cores; machine {used.machine_busy:.0%} busy, load "
            f"{used.load_1min:.1f}",
            flush=True,
        )
        report.write(args.json)


def print_figures(report: Report) -> None:
    first, last = report.baseline_minutes, report.last_minutes
    print(
        f"\nfigures: minutes {last[0]}-{last[-1]} against {first[0]}-{first[-1]} "
        f"(goal: each within {GOAL}x)"
    )
    for f in report.figures:
        if f.what == "p99 time to table":
            values = f"{_fmt_s(f.baseline):>7} -> {_fmt_s(f.last):>7}"
        else:
            values = f"{f.baseline:>7,.0f} -> {f.last:>7,.0f}"
        verdict = "within" if f.within_goal else "OUTSIDE"
        print(f"  {f.table:<12} {f.what:<18} {values}  {f.ratio:5.2f}x  {verdict} the goal")


def print_reads(report: Report) -> None:
    print(f"\nfull reads, median of {READS} (goal: soaked <= {READ_GOAL}x the same rows optimized)")
    for r in report.reads:
        print(
            f"  {r.table:<12} {r.reader:<9} soaked {_fmt_s(r.soaked_s):>7} ({r.soaked_files} "
            f"files), optimized {_fmt_s(r.optimized_s):>7} ({r.optimized_files} files): "
            f"{r.ratio:5.2f}x  {'within' if r.within_goal else 'OUTSIDE'} the goal"
        )
    print("\nrows (deltalake: count, distinct ids, sum of seq; polars: count) against the streams:")
    for c in report.checks:
        want = f"expected {c.expected_rows:,} rows, seq sum {c.expected_seq_sum:,}"
        if c.rows is None:
            print(f"  {c.table:<12} NOT CHECKED ({c.why}); {want}")
            continue
        polars = "" if c.polars_rows is None else f", polars {c.polars_rows:,}"
        print(
            f"  {c.table:<12} {c.rows:,} rows, {c.distinct_ids:,} ids, seq sum {c.seq_sum:,}"
            f"{polars}; {want}: {'OK' if c.ok else 'MISMATCH'}"
        )


def run(args: argparse.Namespace) -> int:
    """Start the store if asked, soak, read and check; 1 if a stream failed or a table
    holds the wrong rows."""
    from deltaflow import DataStreamerError

    polars = importlib.util.find_spec("polars") is not None
    scratch = Path(tempfile.mkdtemp(prefix="deltaflow-soak-"))
    server: Any = None
    where, options = str(scratch / "warehouse"), None
    if args.warehouse is not None:
        from deltaflow.testing.object_store import S3Server

        server = S3Server(scratch / "s3").start()
        where = server.create_bucket("deltaflow-soak") + "/warehouse"
        options = server.storage_options
        os.environ.update(options)  # the node processes reach the store with these
    report = Report(
        settings={
            "minutes": args.minutes,
            "rate": args.rate,
            "keys": args.keys,
            "nodes": args.nodes,
            "engine": args.engine,
            "flush_interval_s": args.flush_interval,
            "warehouse": "s3 (versitygw on 127.0.0.1)" if server else "local directory",
            "cores": os.cpu_count(),
            "load_at_start": os.getloadavg(),
        },
        notes=[] if polars else ["polars is not installed: its reads were skipped"],
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"deltaflow soak: {args.minutes} min, {args.nodes} {args.engine} node processes, "
        f"{args.rate:,.0f} rows/s into each of {len(TABLES)} tables ({args.keys:,} keys, "
        f"~{DELETE_FRACTION:.0%} deletes), pages flushed after {args.flush_interval:g} s; "
        f"{os.cpu_count()} cores, load {load}\ntables: "
        + ", ".join(f"{spec.name} ({spec.kind})" for spec in TABLES)
        + f"\nwarehouse {where}"
        + (" (versitygw on 127.0.0.1)" if server else ""),
        flush=True,
    )
    try:
        warehouse = Warehouse(where, options)
        try:
            streams = asyncio.run(soak(args, warehouse, report))
        except DataStreamerError as exc:
            report.error = str(exc)
            report.write(args.json)
            print(f"FAILED: a stream stopped: {exc}\nthe nodes' logs: {args.logs}/soak-*.log")
            return 1
        print_figures(report)
        report.checks, report.reads, notes = check_and_read(warehouse, streams, polars)
        report.notes += notes
        print_reads(report)
        for note in report.notes:
            print(f"  note: {note}")
        report.write(args.json)
    finally:
        if server is not None:
            server.stop()
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    bad = [c.table for c in report.checks if not c.ok]
    if bad:
        print(f"FAILED: table(s) {bad} not shown to hold the rows their streams produced")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=DEFAULT_MINUTES, help="minutes to soak")
    parser.add_argument(
        "--rate", type=float, default=DEFAULT_RATE, help="rows/s of each of the three streams"
    )
    parser.add_argument(
        "--keys", type=int, default=DEFAULT_KEYS, help="key space of the keyed tables"
    )
    parser.add_argument("--nodes", type=int, default=DEFAULT_NODES, help="node processes")
    parser.add_argument("--engine", choices=("delta-rs", "spark"), default="delta-rs")
    parser.add_argument(
        "--flush-interval",
        type=float,
        default=DEFAULT_FLUSH_INTERVAL,
        help="seconds after which the client sends a partly filled page",
    )
    parser.add_argument(
        "--warehouse",
        help="s3://...: the tables go to a bucket of an S3 server the bench starts (versitygw, "
        "on 127.0.0.1); default: a temporary directory",
    )
    parser.add_argument("--json", type=Path, help="write every minute's rows and the figures")
    parser.add_argument("--keep", action="store_true", help="keep the warehouse directory")
    parser.add_argument(
        "--logs", type=Path, default=OUT_DIR, help="where the nodes' logs go (soak-NODE.log)"
    )
    parser.add_argument(
        "--node-log-level",
        choices=("debug", "info", "warning", "error"),
        default="warning",
        help="the nodes' --log-level (info: every group sent back and why)",
    )
    args = parser.parse_args(argv)
    if args.minutes < 1 or args.rate <= 0 or args.keys < 1 or args.nodes < 1:
        parser.error("--minutes, --rate, --keys and --nodes must be positive")
    if args.warehouse is not None and not args.warehouse.startswith("s3://"):
        parser.error("--warehouse takes s3://... (the bench starts the S3 server itself)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
