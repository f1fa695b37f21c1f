"""History benchmark: what a table's age costs a node, and what the streams it served cost.

A node's first commit on a table reads the lane marks of the table's commits (exactly-once,
``deltaflow/tables/marks.py``), so the time from a node's start to its first ack, and a
failover's, may grow with the table's versions; a node's memory may grow with the lanes of the
streams it served. Three measures, each against a baseline of the same run:

- **restart**: ``deltaflow serve`` started on the warehouse of a table of N versions, one
  1-row stream into it; from the process's start to the ack, and from "ready" to the ack,
  against the same on a table of 50 versions.
- **failover**: two node processes on the table, a paced stream running; the table's
  committer SIGKILLed; from the kill to the first ack of a batch of its partitions.
- **rss**: one node, N 1-row streams (each its own random stream id) into one table; the
  node's ``VmRSS`` after each level, less the first level's.

The tables of N versions are made fast and kept (``--cache``): 49 one-row streams through a
real node make the 50-version table, whose commits are then copied, each with lanes of its
own as distinct streams would have, up to N versions, with Delta checkpoints at the table's
interval (see ``bench/README.md``)::

    .venv/bin/python bench/history.py                                   # everything
    .venv/bin/python bench/history.py --versions 1000,10000 --streams 1000,10000 --repeat 2
    .venv/bin/python bench/history.py --warehouse s3://deltaflow-history --measures restart
    .venv/bin/python bench/history.py --tree /work/baseline --json before.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

DEFAULT_VERSIONS: Final = (1_000, 10_000, 100_000)
DEFAULT_STREAMS: Final = (1_000, 10_000, 100_000)
DEFAULT_REPEAT: Final = 3
DEFAULT_CACHE: Final = Path("/tmp/deltaflow-history")
#: The baseline table's versions: 0 (its creation) to 49, one 1-row stream each.
BASELINE_VERSIONS: Final = 50
#: The table the histories are of, and the table the RSS measure's streams write.
TABLE: Final = "history"
STREAMS_TABLE: Final = "streams"
MEASURES: Final = ("restart", "failover", "rss")
#: A cached history older than this is built again: its marks must all still count, and a
#: checkpoint drops the ``txn`` actions older than the table's transaction retention (7 days
#: on deltaflow's tables), a node's deletes the commit files older than its log retention.
CACHE_DAYS: Final = 2
#: Ids of the rows the measures write: never among the seed's 0..48.
PROBE_ID: Final = 10**12
RESTART_ID: Final = 2 * 10**12
FAILOVER_ID: Final = 3 * 10**12
#: The failover's stream: rows per second, paced in ticks, flushed every 50 ms; so a batch of
#: the dead node's partitions leaves every few tens of milliseconds. The kill comes once
#: ``WARM_ROWS`` rows were acked, both nodes' partitions among them.
FAILOVER_RATE: Final = 200
FAILOVER_TICK: Final = 0.02
WARM_ROWS: Final = 400
#: An ack this long after the kill, of a batch of the dead node's partitions, is a new
#: owner's (the dead node's last acks arrive within a millisecond on 127.0.0.1); a batch of
#: rows produced after the kill is one at any time.
GRACE: Final = 0.1
#: Longest wait from the two nodes' start to the failover's ack (the first ack of a table of
#: 100,000 versions on the S3 server took 6.5 minutes for one node alone).
FAILOVER_TIMEOUT: Final = 1800.0
#: 1-row streams running at once in the RSS measure, all on one client; their rows' keys
#: drawn from this many, so that the table stays one small file (what grows is the streams',
#: not the table's: new keys would make 100,000 rows in thousands of files).
CONCURRENT_STREAMS: Final = 64
#: Seconds the node is left idle before its RSS is read: delta-rs's blocking threads (one per
#: file operation in flight, up to dozens under this load) exit after 10 s idle, and what they
#: hold is not the memory a node keeps.
QUIET_SECONDS: Final = 12.0
ROW_KEYS: Final = 4096
#: Files put to or got from the S3 server at once.
STORE_CONCURRENCY: Final = 64
#: Every engine the nodes may run; delta-rs by default (no JVM: the figures are the log's).
ENGINES: Final = ("delta-rs", "spark")


class ClientWarnings(logging.Handler):
    """The client's warnings (a batch sent again after its ack timeout, say), kept per measure
    rather than printed among the figures."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def take(self) -> list[str]:
        taken, self.messages = self.messages, []
        return taken

    def install(self) -> ClientWarnings:
        logger = logging.getLogger("deltaflow")
        logger.addHandler(self)
        logger.propagate = False
        return self


WARNINGS: Final = ClientWarnings()


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _fmt_s(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


# -- where the tables are: a directory, or a bucket of the S3 server --------------------------


@dataclass(frozen=True, slots=True)
class Pristine:
    """What a built table holds, to put it back after a measure wrote to it.

    Attributes:
        last: its latest version.
        last_checkpoint: the text of ``_delta_log/_last_checkpoint`` (None: no checkpoint).
        log_names: the names in ``_delta_log`` that are not versions' files.
        data: every file outside ``_delta_log``, relative to the table.
    """

    last: int
    last_checkpoint: str | None
    log_names: tuple[str, ...]
    data: tuple[str, ...]


def _is_versioned(name: str) -> bool:
    return name[:20].isdigit() and len(name) > 20


def _data_paths(table: Path) -> list[Path]:
    """Every file and directory of a local table outside its log (deepest first)."""
    found = [
        path
        for top in table.iterdir()
        if top.name != "_delta_log"
        for path in (top, *top.rglob("*"))
    ]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


class Place:
    """Where the warehouses of the histories are, one per size (``name``), each holding the
    table :data:`TABLE`. Blocking throughout: call from a worker thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def warehouse(self, name: str) -> str:
        return str(self.root / name)

    def table(self, name: str, table: str = TABLE) -> str:
        return f"{self.warehouse(name)}/{table}"

    def manifest(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def clear(self, name: str) -> None:
        """Remove warehouse ``name`` and its manifest."""
        self.manifest(name).unlink(missing_ok=True)
        shutil.rmtree(self.root / name, ignore_errors=True)

    def remove_table(self, name: str, table: str) -> None:
        shutil.rmtree(self.root / name / table, ignore_errors=True)

    def read_text(self, name: str, path: str, table: str = TABLE) -> str:
        return (self.root / name / table / path).read_text(encoding="utf-8")

    def copy_in(self, source: Path, name: str) -> None:
        """Make ``source`` (a local table directory) table :data:`TABLE` of warehouse
        ``name``."""
        target = self.root / name / TABLE
        if target != source:
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source, target)

    def copy_out(self, name: str, into: Path) -> None:
        """The table of warehouse ``name`` as a local directory ``into``."""
        shutil.copytree(self.root / name / TABLE, into)

    def local_table(self, name: str) -> Path | None:
        """The table's directory when it is local (it is then extended in place)."""
        return self.root / name / TABLE

    def snapshot(self, name: str) -> Pristine:
        table = self.root / name / TABLE
        log = table / "_delta_log"
        names = [entry.name for entry in os.scandir(log)]
        versions = [int(n[:20]) for n in names if n.endswith(".json") and _is_versioned(n)]
        last_checkpoint = log / "_last_checkpoint"
        data = sorted(str(p.relative_to(table)) for p in _data_paths(table) if p.is_file())
        return Pristine(
            last=max(versions),
            last_checkpoint=last_checkpoint.read_text() if last_checkpoint.exists() else None,
            log_names=tuple(sorted(n for n in names if not _is_versioned(n))),
            data=tuple(data),
        )

    def restore(self, name: str, pristine: Pristine) -> int:
        """Put the table back as ``pristine`` recorded it (delete what a measure added);
        the files deleted."""
        table = self.root / name / TABLE
        log = table / "_delta_log"
        newer = f"{pristine.last:020d}.json"
        deleted = 0
        for entry in os.scandir(log):
            extra = (_is_versioned(entry.name) and entry.name > newer) or (
                not _is_versioned(entry.name) and entry.name not in pristine.log_names
            )
            if extra:
                if entry.is_dir():
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                deleted += 1
        self._put_last_checkpoint(log, pristine.last_checkpoint)
        keep = set(pristine.data)
        for path in _data_paths(table):  # files before their directories
            if path.is_file() and str(path.relative_to(table)) not in keep:
                path.unlink()
                deleted += 1
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        return deleted

    @staticmethod
    def _put_last_checkpoint(log: Path, text: str | None) -> None:
        target = log / "_last_checkpoint"
        if text is None:
            target.unlink(missing_ok=True)
        elif not target.exists() or target.read_text() != text:
            target.write_text(text)


class BucketPlace(Place):
    """The warehouses as prefixes of a bucket on the S3 server (``s3://bucket/name``), their
    manifests in the local directory ``root``. The store's settings come from ``AWS_*``."""

    def __init__(self, root: Path, bucket: str) -> None:
        super().__init__(root)
        from obstore.store import S3Store

        self.bucket = bucket
        self.store = S3Store(bucket)

    def warehouse(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def _keys(self, prefix: str, offset: str | None = None) -> list[str]:
        import obstore

        listed = obstore.list(self.store, prefix, offset=offset)
        return [meta["path"] for chunk in listed for meta in chunk]

    def _delete(self, keys: list[str]) -> None:
        import obstore

        for i in range(0, len(keys), 1000):
            obstore.delete(self.store, keys[i : i + 1000])

    def clear(self, name: str) -> None:
        self.manifest(name).unlink(missing_ok=True)
        self._delete(self._keys(f"{name}/"))

    def remove_table(self, name: str, table: str) -> None:
        self._delete(self._keys(f"{name}/{table}/"))

    def read_text(self, name: str, path: str, table: str = TABLE) -> str:
        import obstore

        return bytes(obstore.get(self.store, f"{name}/{table}/{path}").bytes()).decode()

    def copy_in(self, source: Path, name: str) -> None:
        files = [p for p in source.rglob("*") if p.is_file()]
        prefix = f"{name}/{TABLE}/"

        async def put_all() -> None:
            import obstore

            gate = asyncio.Semaphore(STORE_CONCURRENCY)

            async def put(path: Path) -> None:
                async with gate:
                    data = await asyncio.to_thread(path.read_bytes)
                    await obstore.put_async(
                        self.store, prefix + str(path.relative_to(source)), data
                    )

            await asyncio.gather(*(put(p) for p in files))

        asyncio.run(put_all())

    def copy_out(self, name: str, into: Path) -> None:
        prefix = f"{name}/{TABLE}/"
        keys = self._keys(prefix)

        async def get_all() -> None:
            import obstore

            gate = asyncio.Semaphore(STORE_CONCURRENCY)

            async def get(key: str) -> None:
                async with gate:
                    data = bytes(await (await obstore.get_async(self.store, key)).bytes_async())
                target = into / key.removeprefix(prefix)
                await asyncio.to_thread(_write_bytes, target, data)

            await asyncio.gather(*(get(k) for k in keys))

        asyncio.run(get_all())

    def local_table(self, name: str) -> Path | None:
        return None

    def snapshot(self, name: str) -> Pristine:
        prefix = f"{name}/{TABLE}/"
        log = f"{prefix}_delta_log/"
        keys = self._keys(prefix)
        names = [k.removeprefix(log) for k in keys if k.startswith(log)]
        versions = [int(n[:20]) for n in names if n.endswith(".json") and _is_versioned(n)]
        others = tuple(sorted(n for n in names if not _is_versioned(n)))
        return Pristine(
            last=max(versions),
            last_checkpoint=(
                self.read_text(name, "_delta_log/_last_checkpoint")
                if "_last_checkpoint" in others
                else None
            ),
            log_names=others,
            data=tuple(sorted(k.removeprefix(prefix) for k in keys if not k.startswith(log))),
        )

    def restore(self, name: str, pristine: Pristine) -> int:
        import obstore

        prefix = f"{name}/{TABLE}/"
        log = f"{prefix}_delta_log/"
        # The log only grows: list only past the last version kept (100,000 keys otherwise).
        after = self._keys(log, offset=f"{log}{pristine.last:020d}.json")
        extra = [
            k
            for k in after
            if (_is_versioned(n := k.removeprefix(log)) and n > f"{pristine.last:020d}.json")
            or (not _is_versioned(n) and n not in pristine.log_names)
        ]
        keep = set(pristine.data)
        listed = obstore.list_with_delimiter(self.store, prefix)
        for directory in listed["common_prefixes"]:
            if directory.rstrip("/") != log.rstrip("/"):
                extra += [k for k in self._keys(directory) if k.removeprefix(prefix) not in keep]
        extra += [
            m["path"] for m in listed["objects"] if m["path"].removeprefix(prefix) not in keep
        ]
        self._delete(extra)
        if pristine.last_checkpoint is not None:
            key = f"{log}_last_checkpoint"
            if self.read_text(name, "_delta_log/_last_checkpoint") != pristine.last_checkpoint:
                obstore.put(self.store, key, pristine.last_checkpoint.encode())
        return len(extra)


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# -- node processes ---------------------------------------------------------------------------


@dataclass(slots=True)
class Nodes:
    """How the bench starts ``deltaflow serve``: the engine, and the tree it runs from."""

    engine: str
    tree: Path | None = None

    def env(self) -> dict[str, str]:
        if self.tree is None:
            return {}
        return {"PYTHONPATH": str(self.tree)}

    def process(
        self, node_id: str, warehouse: str, peers: Sequence[str] = (), port: int = 0
    ) -> Any:
        from deltaflow.storage.paths import location
        from deltaflow.testing import NodeProcess

        return NodeProcess(
            node_id,
            location(warehouse),
            peers=peers,
            port=port,
            extra=["--engine", self.engine],
            env=self.env(),
        )

    @contextlib.asynccontextmanager
    async def one(self, warehouse: str) -> AsyncIterator[Any]:
        node = self.process("n1", warehouse)
        await node.start()
        try:
            yield node
        finally:
            await node.stop()


async def stream_one(
    address: str, row: dict[str, Any], table: str = TABLE, **kwargs: Any
) -> tuple[Any, float | None]:
    """One stream of ``row`` into ``table`` through the node at ``address``: the summary and
    when its ack came (``time.monotonic()``)."""
    import deltaflow

    acked: list[float] = []
    async with deltaflow.connect([address]) as client:
        summary = await client.stream_data(
            [row], table=table, key="id", on_ack=lambda _: acked.append(time.monotonic()), **kwargs
        )
    return summary, (acked[0] if acked else None)


def node_rss_kib(pid: int) -> int:
    """A process's ``VmRSS``, KiB."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1])


# -- the history: seed, shape, synthetic versions, checkpoints --------------------------------


@dataclass(frozen=True, slots=True)
class Probe:
    """A stream whose lane a history's first synthetic version records: replayed, its row
    must be skipped as already applied (the node read that mark) and not added.

    Attributes:
        stream_id, stream_key: the stream's.
        row: its one row.
        lane: its lane as a real node marked it (``stream/owner/partition``).
    """

    stream_id: str
    stream_key: str
    row: dict[str, Any]
    lane: str


@dataclass(slots=True)
class Manifest:
    """What the cache knows of one built table (``<name>.json`` beside its warehouse)."""

    versions: int
    shape: str
    built_at: float
    build_seconds: float
    checkpoints: int
    probe: dict[str, Any]
    pristine: dict[str, Any]
    rows: int
    checked: str = ""

    @property
    def fresh(self) -> bool:
        return time.time() - self.built_at < CACHE_DAYS * 86400

    def restored(self) -> Pristine:
        p = self.pristine
        return Pristine(p["last"], p["last_checkpoint"], tuple(p["log_names"]), tuple(p["data"]))


def commit_lanes(text: str) -> dict[str, Any]:
    """The lane marks a commit's ``commitInfo`` records (``{}`` without)."""
    for line in text.split("\n"):
        if line.startswith('{"commitInfo"'):
            info = json.loads(line)["commitInfo"]
            meta = json.loads(info.get("userMetadata") or "{}").get("deltaflow") or {}
            return dict(meta.get("lanes") or {})
    return {}


def shape_of(commits: Iterable[str], interval: int) -> str:
    """A short digest of what deltaflow's commits look like: per commit, its action kinds, the
    fields of its ``commitInfo`` and of deltaflow's record in it, its lanes and the length of
    their parts. Histories built from commits of another shape are built again."""
    import deltalake

    forms = set()
    for text in commits:
        actions = [json.loads(line) for line in text.split("\n") if line]
        info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
        meta = json.loads(info.get("userMetadata") or "{}").get("deltaflow") or {}
        lanes = meta.get("lanes") or {}
        parts = sorted({tuple(len(p) for p in lane.split("/")[:-1]) for lane in lanes})
        kinds = sorted(k for a in actions for k in a)
        forms.add(
            json.dumps([kinds, sorted(info), sorted(meta), len(lanes), parts, info["engineInfo"]])
        )
    described = json.dumps([sorted(forms), interval, deltalake.__version__])
    return hashlib.sha256(described.encode()).hexdigest()[:12]


def _checkpoint_interval(created: str) -> int:
    """The ``delta.checkpointInterval`` a table's first commit gives it (Delta's 10 without)."""
    for line in created.split("\n"):
        if line.startswith('{"metaData"'):
            configuration = json.loads(line)["metaData"].get("configuration") or {}
            return int(configuration.get("delta.checkpointInterval") or 10)
    raise RuntimeError("the table's first commit has no metaData")


def _fresh_part(part: str) -> str:
    """A random string like ``part``: each hex digit another, every other character kept (a
    random stream's ``~``, say)."""
    fresh = iter(secrets.token_hex(len(part) // 2 + 1))
    return "".join(next(fresh) if c in "0123456789abcdef" else c for c in part)


class Synthesizer:
    """Commits in the shape of the seed's: each a copy of one seed commit (in turn) whose
    lanes' streams (and owners) are new, as another stream's commit would be, at its own
    version and time. The copy keeps the seed commit's ``add``: the same tiny file again, so
    the table's live files and rows stay the seed's and only its log grows. Any other action
    naming a lane's stream (a ``txn`` of it, say) is renamed with it."""

    def __init__(self, seed_commits: list[str]) -> None:
        self.templates = [(text, list(commit_lanes(text))) for text in seed_commits]
        if not all(lanes for _, lanes in self.templates):
            raise RuntimeError("a seed commit records no lane marks: not deltaflow's")

    def commit(self, version: int, now_ms: int, probe_lane: str | None = None) -> str:
        text, lanes = self.templates[version % len(self.templates)]
        for i, lane in enumerate(lanes):
            stream = lane.rpartition("/")[0]
            if probe_lane is not None and i == 0:
                # The probe's whole lane (its partition too) where the first lane was marked:
                # in the commitInfo's JSON string and in any action naming it (its ``txn``).
                new_stream = probe_lane.rpartition("/")[0]
                for end in ('\\"', '"'):
                    text = text.replace(lane + end, probe_lane + end)
            else:
                new_stream = "/".join(_fresh_part(p) for p in stream.split("/"))
            text = text.replace(stream, new_stream)
        lines = []
        for line in text.split("\n"):
            if line.startswith('{"commitInfo"'):
                action = json.loads(line)
                action["commitInfo"]["timestamp"] = now_ms
                action["commitInfo"]["readVersion"] = version - 1
                line = json.dumps(action, separators=(",", ":"), ensure_ascii=False)
            elif line.startswith('{"txn"'):
                action = json.loads(line)
                if "lastUpdated" in action["txn"]:
                    action["txn"]["lastUpdated"] = now_ms
                line = json.dumps(action, separators=(",", ":"), ensure_ascii=False)
            lines.append(line)
        return "\n".join(lines)


@dataclass(slots=True)
class Built:
    """One build: how long it took and how (``synthetic``: the commits it wrote)."""

    synthetic: int
    seconds: float
    commit_seconds: float
    checkpoint_seconds: float
    checkpoints: int
    upload_seconds: float = 0.0


def extend(table: Path, versions: int, synthesizer: Synthesizer, probe: Probe) -> Built:
    """Blocking: grow the local table ``table`` (the seed's copy) to ``versions`` versions
    (0 to ``versions - 1``): synthetic commits, the first recording ``probe``'s lane, and a
    checkpoint at every multiple of the table's ``delta.checkpointInterval`` (delta-rs's, as
    the nodes write them; ``_last_checkpoint`` ends at the latest)."""
    from deltalake import DeltaTable

    started = time.monotonic()
    log = table / "_delta_log"
    # Files before the latest checkpoint wait beside the log until the end: delta-rs lists
    # the whole log directory at each update, which made 1,000 checkpoints of a log growing
    # to 100,000 files take 420 s, against 110 s so.
    aside = table.parent / f".{table.name}-built-log"
    aside.mkdir()
    delta = DeltaTable(str(table))
    first = delta.version() + 1
    interval = int(delta.metadata().configuration.get("delta.checkpointInterval") or 10)
    checkpoint_seconds = 0.0
    checkpoints = 0
    try:
        for version in range(first, versions):
            text = synthesizer.commit(
                version, int(time.time() * 1000), probe.lane if version == first else None
            )
            with open(log / f"{version:020d}.json", "x", encoding="utf-8") as out:
                out.write(text)
            if version % interval == 0:
                t0 = time.monotonic()
                delta.update_incremental()
                if delta.version() != version:
                    raise RuntimeError(f"the table reads as {delta.version()}, not {version}")
                delta.create_checkpoint()
                checkpoints += 1
                for entry in os.scandir(log):
                    if _is_versioned(entry.name) and int(entry.name[:20]) < version:
                        os.rename(entry.path, aside / entry.name)
                checkpoint_seconds += time.monotonic() - t0
    finally:
        for entry in os.scandir(aside):
            os.rename(entry.path, log / entry.name)
        aside.rmdir()
    seconds = time.monotonic() - started
    return Built(
        synthetic=versions - first,
        seconds=seconds,
        commit_seconds=seconds - checkpoint_seconds,
        checkpoint_seconds=checkpoint_seconds,
        checkpoints=checkpoints,
    )


def check_loads(uri: str, versions: int, rows: int, files: int) -> str:
    """Blocking: the table at ``uri`` read by ``deltalake``: its latest version, rows and
    live files as built, its ``_last_checkpoint`` at the latest interval. Raises if not."""
    from deltalake import DeltaTable

    table = DeltaTable(uri)
    got = (table.version(), table.count(), len(table.file_uris()))
    want = (versions - 1, rows, files)
    if got != want:
        raise RuntimeError(f"{uri} reads as (version, rows, files) {got}, not {want}")
    return f"deltalake reads version {got[0]}, {got[1]} rows in {got[2]} files"


# -- the cache: build what is missing ---------------------------------------------------------


class Histories:
    """The tables of each size at one place, built on demand and kept."""

    def __init__(self, place: Place, nodes: Nodes, rebuild: bool) -> None:
        self.place = place
        self.nodes = nodes
        self.rebuild = rebuild
        self.shape = ""
        self.seed_commits: list[str] = []
        self.probe: Probe | None = None
        self.manifests: dict[int, Manifest] = {}
        self.builds: list[dict[str, Any]] = []

    def name(self, versions: int) -> str:
        return str(versions)

    async def seed(self) -> Manifest:
        """The 50-version table, made afresh by a real node: 49 one-row streams (the first
        also creates the table), each its own version. Also a probe stream into a scratch
        table, whose lane the built histories record."""
        name = self.name(BASELINE_VERSIONS)
        place = self.place
        await asyncio.to_thread(place.clear, name)
        started = time.monotonic()
        probe_id = f"history-probe-{secrets.token_hex(4)}"
        probe_key = secrets.token_hex(16)
        probe_row = {"id": PROBE_ID, "v": -1.0}
        async with self.nodes.one(place.warehouse(name)) as node:
            for i in range(BASELINE_VERSIONS - 1):
                await stream_one(node.address, {"id": i, "v": float(i)})
            await stream_one(
                node.address, probe_row, table="probe", stream_id=probe_id, stream_key=probe_key
            )
        probe_lanes = commit_lanes(
            await asyncio.to_thread(
                place.read_text, name, "_delta_log/00000000000000000001.json", "probe"
            )
        )
        await asyncio.to_thread(place.remove_table, name, "probe")
        (lane,) = probe_lanes
        self.probe = Probe(probe_id, probe_key, probe_row, lane)
        pristine = await asyncio.to_thread(place.snapshot, name)
        if pristine.last != BASELINE_VERSIONS - 1:
            raise RuntimeError(
                f"the seed has versions 0 to {pristine.last}, not 0 to {BASELINE_VERSIONS - 1}"
            )
        self.seed_commits = [
            await asyncio.to_thread(place.read_text, name, f"_delta_log/{v:020d}.json")
            for v in range(1, BASELINE_VERSIONS)
        ]
        created = await asyncio.to_thread(place.read_text, name, f"_delta_log/{0:020d}.json")
        self.shape = shape_of(self.seed_commits, _checkpoint_interval(created))
        manifest = Manifest(
            versions=BASELINE_VERSIONS,
            shape=self.shape,
            built_at=time.time(),
            build_seconds=time.monotonic() - started,
            checkpoints=0,
            probe=asdict(self.probe),
            pristine=asdict(pristine),
            rows=BASELINE_VERSIONS - 1,
            checked="made by a node",
        )
        self.manifests[BASELINE_VERSIONS] = manifest
        self.builds.append({"versions": BASELINE_VERSIONS, "cached": False, **_seconds(manifest)})
        print(
            f"  {BASELINE_VERSIONS} versions: {BASELINE_VERSIONS - 1} one-row streams through a "
            f"node, {manifest.build_seconds:.1f} s (shape {self.shape})",
            flush=True,
        )
        return manifest

    def cached(self, versions: int) -> Manifest | None:
        path = self.place.manifest(self.name(versions))
        if self.rebuild or not path.exists():
            return None
        manifest = Manifest(**json.loads(path.read_text()))
        if manifest.shape != self.shape or not manifest.fresh or not manifest.checked:
            return None
        return manifest

    async def get(self, versions: int) -> Manifest:
        """The table of ``versions`` versions: cached, else built and checked."""
        if versions in self.manifests:
            return self.manifests[versions]
        manifest = await asyncio.to_thread(self.cached, versions)
        if manifest is not None:
            self.manifests[versions] = manifest
            self.builds.append({"versions": versions, "cached": True, **_seconds(manifest)})
            print(f"  {versions:,} versions: cached (built in {manifest.build_seconds:.1f} s)")
            return manifest
        manifest = await self.build(versions)
        self.manifests[versions] = manifest
        return manifest

    async def build(self, versions: int) -> Manifest:
        assert self.probe is not None, "seed first"
        name, place = self.name(versions), self.place
        seed = self.manifests[BASELINE_VERSIONS]
        await asyncio.to_thread(place.clear, name)
        started = time.monotonic()
        # Not the table's first write: it may carry what a node writes once (the txn that says
        # every lane's mark is in a txn action, say).
        synthesizer = Synthesizer(self.seed_commits[1:])
        local = place.local_table(name)
        with tempfile.TemporaryDirectory(prefix="deltaflow-history-") as scratch:
            staging = local if local is not None else Path(scratch) / TABLE
            await asyncio.to_thread(place.copy_out, self.name(BASELINE_VERSIONS), staging)
            built = await asyncio.to_thread(extend, staging, versions, synthesizer, self.probe)
            if local is None:
                t0 = time.monotonic()
                await asyncio.to_thread(place.copy_in, staging, name)
                built.upload_seconds = time.monotonic() - t0
        files = len(seed.restored().data)
        loads = await asyncio.to_thread(check_loads, place.table(name), versions, seed.rows, files)
        pristine = await asyncio.to_thread(place.snapshot, name)
        seconds = time.monotonic() - started
        manifest = Manifest(
            versions=versions,
            shape=self.shape,
            built_at=time.time(),
            build_seconds=seconds,
            checkpoints=built.checkpoints,
            probe=asdict(self.probe),
            pristine=asdict(pristine),
            rows=seed.rows,
        )
        manifest.checked = f"{loads}; {await self.check_node(name, manifest)}"
        await asyncio.to_thread(place.restore, name, pristine)
        await asyncio.to_thread(place.manifest(name).write_text, json.dumps(asdict(manifest)))
        upload = f", upload {built.upload_seconds:.1f} s" if built.upload_seconds else ""
        print(
            f"  {versions:,} versions: built in {seconds:.1f} s, {versions / seconds:,.0f} "
            f"versions/s ({built.synthetic:,} synthetic commits in {built.commit_seconds:.1f} s; "
            f"{built.checkpoints} checkpoints in {built.checkpoint_seconds:.1f} s{upload}; the "
            f"checks after); {manifest.checked}",
            flush=True,
        )
        self.builds.append(
            {"versions": versions, "cached": False, **_seconds(manifest), **asdict(built)}
        )
        return manifest

    async def check_node(self, name: str, manifest: Manifest) -> str:
        """A real node on the built table: the probe stream replayed is skipped (the node
        read the mark of the history's first synthetic version), a new stream is added."""
        probe = Probe(**manifest.probe)
        uri = self.place.table(name)
        async with self.nodes.one(self.place.warehouse(name)) as node:
            replay, _ = await stream_one(
                node.address,
                probe.row,
                stream_id=probe.stream_id,
                stream_key=probe.stream_key,
                options=_replay_options(),
            )
            after_replay = await asyncio.to_thread(_count, uri)
            fresh, _ = await stream_one(node.address, {"id": PROBE_ID + 1, "v": 0.0})
            after_fresh = await asyncio.to_thread(_count, uri)
        if replay.items_acked != 1 or after_replay != manifest.rows:
            raise RuntimeError(
                f"the probe stream replayed on {uri} left {after_replay} rows, not "
                f"{manifest.rows}: the node did not find the mark of version "
                f"{BASELINE_VERSIONS} (its lane {probe.lane})"
            )
        if fresh.items_acked != 1 or after_fresh != manifest.rows + 1:
            raise RuntimeError(f"a new stream on {uri} left {after_fresh} rows")
        return "a node skips the replayed probe stream and takes a new one"


def _replay_options() -> Any:
    from deltaflow import StreamerOptions

    return StreamerOptions(auto_flush_interval=0)  # batches cut by count only: a replay


def _count(uri: str) -> int:
    from deltalake import DeltaTable

    return int(DeltaTable(uri).count())


def _seconds(manifest: Manifest) -> dict[str, Any]:
    return {"build_seconds": manifest.build_seconds, "checkpoints": manifest.checkpoints}


# -- the measures -----------------------------------------------------------------------------


@dataclass(slots=True)
class Restart:
    """One restart: seconds from the process's start to "ready", and to the first ack; the
    node's ``VmRSS`` (KiB) after it."""

    ready: float
    start_to_ack: float
    rss_kib: int

    @property
    def ready_to_ack(self) -> float:
        return self.start_to_ack - self.ready


async def restart_once(histories: Histories, versions: int, repeat: int) -> Restart:
    """A node started on the table of ``versions`` versions, one 1-row stream into it."""
    manifest = await histories.get(versions)
    name = histories.name(versions)
    node = histories.nodes.process("n1", histories.place.warehouse(name))
    began = time.monotonic()
    await node.start()
    ready = time.monotonic()
    try:
        summary, acked = await stream_one(node.address, {"id": RESTART_ID + repeat, "v": 0.0})
        assert node.proc is not None
        rss = node_rss_kib(node.proc.pid)
    finally:
        await node.stop()
        await asyncio.to_thread(histories.place.restore, name, manifest.restored())
    if acked is None or summary.items_acked != 1:
        raise RuntimeError(f"the stream into the {versions}-version table was not acked")
    return Restart(ready=ready - began, start_to_ack=acked - began, rss_kib=rss)


@dataclass(slots=True)
class Failover:
    """One failover: seconds from the SIGKILL to the first ack of a batch of the dead node's
    partitions, and from the two nodes' start to the stream's first ack."""

    seconds: float
    first_ack: float
    victim: str
    rows: int
    #: The client's warnings meanwhile (batches sent again after 120 s without an answer).
    warnings: list[str]


class FailoverWatch:
    """``on_ack`` of the failover's stream: SIGKILLs ``victim`` once ``WARM_ROWS`` rows were
    acked, both nodes' partitions among them, then notes the first ack of a batch of the
    victim's partitions that a new owner sent: rows made after the kill, or an ack at least
    ``GRACE`` after it."""

    def __init__(self, victim: Any, owners: Sequence[str], made: Callable[[], int]) -> None:
        self.victim = victim
        self.owners = owners
        self.made = made
        self.acked = 0
        self.seen: set[str] = set()
        self.first_ack: float | None = None
        self.killed_at: float | None = None
        self.made_at_kill = 0
        self.replaced = asyncio.get_running_loop().create_future()

    def __call__(self, items: Sequence[Any]) -> None:
        from deltaflow.partitioning import partition_of

        now = time.monotonic()
        if self.first_ack is None:
            self.first_ack = now
        self.acked += len(items)
        owner = self.owners[partition_of(items[0]["id"], len(self.owners))]
        self.seen.add(owner)
        if self.killed_at is None:
            if self.acked >= WARM_ROWS and len(self.seen) == len(set(self.owners)):
                self.victim.kill()
                self.killed_at = time.monotonic()
                self.made_at_kill = self.made()
            return
        if owner != self.victim.node_id or self.replaced.done():
            return
        after = min(item["id"] for item in items) - FAILOVER_ID >= self.made_at_kill
        if after or now >= self.killed_at + GRACE:
            self.replaced.set_result(now - self.killed_at)


async def failover_once(histories: Histories, versions: int, repeat: int) -> Failover:
    """Two nodes on the table of ``versions`` versions; the table's committer SIGKILLed while
    a paced stream runs."""
    from deltaflow.testing import free_port, wait_for_members

    manifest = await histories.get(versions)
    name = histories.name(versions)
    warehouse = histories.place.warehouse(name)
    WARNINGS.take()
    ports = {"n1": free_port(), "n2": free_port()}
    addresses = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
    nodes = {
        n: histories.nodes.process(n, warehouse, [a for m, a in addresses.items() if m != n], p)
        for n, p in ports.items()
    }
    began = time.monotonic()
    made = 0
    stop = asyncio.Event()

    async def rows() -> AsyncIterator[dict[str, Any]]:
        nonlocal made
        per_tick = max(1, round(FAILOVER_RATE * FAILOVER_TICK))
        while not stop.is_set():
            for _ in range(per_tick):
                yield {"id": FAILOVER_ID + made, "v": float(repeat)}
                made += 1
            await asyncio.sleep(FAILOVER_TICK)  # the source's pace

    try:
        await asyncio.gather(*(node.start() for node in nodes.values()))
        await wait_for_members(list(addresses.values()))
        client = await _client_seeing(list(addresses.values()), len(nodes))
        async with client:
            owners = client.partition_map.owners
            victim = nodes[client.partition_map.committer(TABLE)]
            watch = FailoverWatch(victim, owners, lambda: made)
            stream = asyncio.create_task(
                client.stream_data(
                    rows(), table=TABLE, key="id", on_ack=watch, options=_failover_options()
                )
            )
            try:
                async with asyncio.timeout(FAILOVER_TIMEOUT):
                    # The stream may end first (failed): then its error, not a wait.
                    await asyncio.wait({watch.replaced, stream}, return_when="FIRST_COMPLETED")
                    if not watch.replaced.done():
                        await stream
                        raise RuntimeError("the failover's stream ended before a new owner's ack")
                    seconds = watch.replaced.result()
            finally:
                stop.set()
                summary = await stream
        assert watch.first_ack is not None
        if summary.items_failed:
            raise RuntimeError(f"the failover's stream failed {summary.items_failed} rows")
        return Failover(
            seconds, watch.first_ack - began, victim.node_id, summary.items_acked, WARNINGS.take()
        )
    finally:
        await asyncio.gather(*(node.stop() for node in nodes.values()))
        await asyncio.to_thread(histories.place.restore, name, manifest.restored())


def _failover_options() -> Any:
    from deltaflow import StreamerOptions

    # Retries as the failover tests' (tests/support.py FAILOVER_OPTIONS), flushed every 50 ms;
    # the default ack timeout: the first acks on an old table take longer than their 20 s.
    return StreamerOptions(
        auto_flush_interval=0.05, retry_initial_backoff=0.05, retry_max_backoff=1.0, retry_limit=40
    )


async def _client_seeing(addresses: list[str], count: int) -> Any:
    """A started client whose map shows ``count`` live nodes (the nodes agree within a poll
    or two of :func:`wait_for_members`; a client that connected before gets the older map)."""
    import deltaflow

    async with asyncio.timeout(60):
        while True:
            client = deltaflow.connect(addresses)
            await client.start()
            if len(set(client.partition_map.owners)) == count:
                return client
            await client.close()
            await asyncio.sleep(0.2)


@dataclass(slots=True)
class RssLevel:
    """The node's ``VmRSS`` after serving ``streams`` 1-row streams."""

    streams: int
    rss_kib: int
    seconds: float
    versions: int


async def rss_levels(histories: Histories, levels: Sequence[int]) -> list[RssLevel]:
    """One node, a fresh table, 1-row streams of random ids up to each level in turn
    (``CONCURRENT_STREAMS`` at a time, all on one client)."""
    import deltaflow

    name = "streams"
    place = histories.place
    await asyncio.to_thread(place.clear, name)
    rng = random.Random()
    out: list[RssLevel] = []
    try:
        async with histories.nodes.one(place.warehouse(name)) as node:
            assert node.proc is not None
            async with deltaflow.connect([node.address]) as client:
                served = 0
                for level in sorted(levels):
                    started = time.monotonic()
                    await serve_streams(client, level - served, rng)
                    served = level
                    seconds = time.monotonic() - started
                    await asyncio.sleep(QUIET_SECONDS)  # the pools idle
                    rss = node_rss_kib(node.proc.pid)
                    versions = await asyncio.to_thread(_latest, place.table(name, STREAMS_TABLE))
                    out.append(RssLevel(level, rss, seconds, versions + 1))
                    print(
                        f"  rss: {level:,} streams, node VmRSS {rss / 1024:.0f} MiB "
                        f"({seconds:.0f} s, {versions + 1:,} versions)",
                        flush=True,
                    )
    finally:
        await asyncio.to_thread(place.clear, name)
    return out


async def serve_streams(client: Any, count: int, rng: random.Random) -> None:
    """``count`` 1-row streams (random stream ids, keys of ``ROW_KEYS``),
    ``CONCURRENT_STREAMS`` at a time."""
    todo = iter(range(count))

    async def worker() -> None:
        for _ in todo:  # shared: each stream is taken by one worker
            row = {"id": rng.randrange(ROW_KEYS), "v": 1.0}
            await client.stream_data([row], table=STREAMS_TABLE, key="id")

    await asyncio.gather(*(worker() for _ in range(CONCURRENT_STREAMS)))


def _latest(uri: str) -> int:
    from deltalake import DeltaTable

    return int(DeltaTable(uri).version())


# -- the run ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Figure:
    """One line of the results: a measure on a table of ``versions`` (or ``streams``)."""

    measure: str
    at: str
    median: float
    runs: list[float]
    baseline: float | None = None
    unit: str = "s"

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or not self.baseline:
            return None
        return self.median / self.baseline


@dataclass(slots=True)
class Report:
    place: str
    engine: str
    figures: list[Figure] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)


def _figures(
    report: Report,
    measure: str,
    runs: dict[int, list[Any]],
    of: Callable[[Any], float],
    unit: str = "s",
) -> None:
    """One figure per table age: the median of ``of`` over the runs, against the 50-version
    table's."""
    base = _median([of(r) for r in runs[BASELINE_VERSIONS]])
    for versions, rs in runs.items():
        values = [of(r) for r in rs]
        report.figures.append(
            Figure(measure, f"{versions:,} versions", _median(values), values, base, unit)
        )


async def measure_ages(
    histories: Histories,
    sizes: Sequence[int],
    repeat: int,
    once: Callable[[Histories, int, int], Any],
    say: Callable[[int, Any], str],
) -> dict[int, list[Any]]:
    """``once`` on each table age, ``repeat`` rounds over all of them (a machine that slows
    down meanwhile slows every age alike)."""
    runs: dict[int, list[Any]] = {versions: [] for versions in sizes}
    for round_ in range(repeat):
        for versions in sizes:
            result = await once(histories, versions, round_)
            runs[versions].append(result)
            print(f"  {versions:,} versions: {say(versions, result)}", flush=True)
    return runs


async def run(args: argparse.Namespace, place: Place, report: Report) -> None:
    histories = Histories(place, Nodes(args.engine, args.tree), args.rebuild)
    sizes = [BASELINE_VERSIONS, *args.versions]
    print("tables:", flush=True)
    await histories.seed()
    if {"restart", "failover"} & set(args.measures):
        for versions in args.versions:
            await histories.get(versions)
    report.raw["builds"] = histories.builds
    if "restart" in args.measures:
        print("restart:", flush=True)
        restarts = await measure_ages(
            histories,
            sizes,
            args.repeat,
            restart_once,
            lambda _, r: (
                f"ready {_fmt_s(r.ready)}, first ack {_fmt_s(r.start_to_ack)} after the start, "
                f"{_fmt_s(r.ready_to_ack)} after ready; RSS {r.rss_kib / 1024:.0f} MiB"
            ),
        )
        report.raw["restart"] = {v: [asdict(r) for r in rs] for v, rs in restarts.items()}
        _figures(report, "restart: start to first ack", restarts, lambda r: r.start_to_ack)
        _figures(report, "restart: ready to first ack", restarts, lambda r: r.ready_to_ack)
        _figures(report, "restart: start to ready", restarts, lambda r: r.ready)
        # What reading the marks cost the node's memory.
        _figures(
            report, "restart: RSS after first ack", restarts, lambda r: r.rss_kib / 1024, "MiB"
        )
    if "failover" in args.measures:
        print("failover:", flush=True)
        failovers = await measure_ages(
            histories,
            sizes,
            args.repeat,
            failover_once,
            lambda _, f: (
                f"SIGKILL of {f.victim} (the committer) to a new owner's first ack "
                f"{_fmt_s(f.seconds)}; the two nodes' start to the first ack "
                f"{_fmt_s(f.first_ack)}; {f.rows:,} rows; {len(f.warnings)} client warnings"
            ),
        )
        report.raw["failover"] = {v: [asdict(f) for f in fs] for v, fs in failovers.items()}
        _figures(report, "failover: SIGKILL to first ack", failovers, lambda f: f.seconds)
        _figures(report, "failover: start to first ack", failovers, lambda f: f.first_ack)
    if "rss" in args.measures:
        print("rss:", flush=True)
        levels = await rss_levels(histories, args.streams)
        report.raw["rss"] = [asdict(level) for level in levels]
        first = levels[0]
        for level in levels[1:]:
            grown = (level.rss_kib - first.rss_kib) / 1024
            per = (level.rss_kib - first.rss_kib) / (level.streams - first.streams)
            at = f"{level.streams:,} streams"
            report.figures.append(
                Figure(f"rss: less after {first.streams:,} streams", at, grown, [grown], unit="MiB")
            )
            report.figures.append(Figure("rss: per stream served", at, per, [per], unit="KiB"))


def headline(report: Report, args: argparse.Namespace) -> list[str]:
    """The issue's figures and goals, from this run."""
    by = {(f.measure, f.at): f for f in report.figures}
    lines = []
    oldest = f"{max(args.versions):,} versions"
    restart = by.get(("restart: start to first ack", oldest))
    if restart is not None and restart.ratio is not None:
        lines.append(
            f"first ack after restart, {oldest} / {BASELINE_VERSIONS} versions: "
            f"{restart.ratio:.2f}x ({_fmt_s(restart.median)} / {_fmt_s(restart.baseline or 0)}; "
            "goal <= 1.5x)"
        )
    failover = by.get(("failover: SIGKILL to first ack", oldest))
    if failover is not None:
        lines.append(
            f"failover, {oldest}: median {_fmt_s(failover.median)} "
            f"({failover.ratio or 0:.2f}x the {BASELINE_VERSIONS}-version table's; goal <= 0.5 s)"
        )
    most = f"{max(args.streams):,} streams"
    grown = next((f for (m, at), f in by.items() if m.startswith("rss: less") and at == most), None)
    per = by.get(("rss: per stream served", most))
    if grown is not None and per is not None:
        lines.append(
            f"node RSS after {most} less after {min(args.streams):,}: {grown.median:,.1f} MiB, "
            f"{per.median:.2f} KiB a stream (goal <= 32 MiB)"
        )
    return lines


def print_report(report: Report, lines: list[str]) -> None:
    line = "-" * 100
    print(f"\n{line}\n{'measure':<38}{'table':<18}{'median':>12}  {'vs 50 versions':>15}  runs")
    print(line)
    for f in report.figures:
        if f.unit == "s":
            median, runs = _fmt_s(f.median), ", ".join(_fmt_s(v) for v in f.runs)
        else:
            median = f"{f.median:,.1f} {f.unit}"
            runs = ", ".join(f"{v:,.1f}" for v in f.runs) if len(f.runs) > 1 else ""
        ratio = f"{f.ratio:.2f}x" if f.ratio is not None else ""
        print(f"{f.measure:<38}{f.at:<18}{median:>12}  {ratio:>15}  {runs}")
    print(line)
    for text in lines:
        print(text)


def _sizes(text: str) -> list[int]:
    try:
        values = sorted({int(v.replace("_", "")) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated counts") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: counts of at least 1")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--versions",
        type=_sizes,
        default=list(DEFAULT_VERSIONS),
        help="table ages, versions (default: %(default)s); each against the 50-version table",
    )
    parser.add_argument(
        "--streams",
        type=_sizes,
        default=list(DEFAULT_STREAMS),
        help="streams served for the RSS measure, the first the baseline (default: %(default)s)",
    )
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="runs per measure")
    parser.add_argument(
        "--measures",
        default=",".join(MEASURES),
        help=f"comma-separated, of {', '.join(MEASURES)} (default: all)",
    )
    parser.add_argument(
        "--cache", type=Path, default=DEFAULT_CACHE, help="built tables (default: %(default)s)"
    )
    parser.add_argument("--rebuild", action="store_true", help="build every table again")
    parser.add_argument(
        "--warehouse",
        help="s3://BUCKET: the tables in a bucket of an S3 server (versitygw on 127.0.0.1) the "
        "bench starts over a directory of --cache (default: directories of --cache)",
    )
    parser.add_argument("--engine", choices=ENGINES, default="delta-rs", help="the nodes' engine")
    parser.add_argument(
        "--tree", type=Path, help="the deltaflow checkout the nodes run (default: this one's)"
    )
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    args.measures = [m.strip() for m in args.measures.split(",") if m.strip()]
    unknown = set(args.measures) - set(MEASURES)
    if unknown:
        parser.error(f"unknown measures {sorted(unknown)}; choose from {', '.join(MEASURES)}")
    if args.repeat < 1:
        parser.error("--repeat takes at least 1")
    if args.warehouse is not None and not args.warehouse.startswith("s3://"):
        parser.error("--warehouse takes s3://BUCKET (the bench starts the S3 server itself)")
    if "rss" in args.measures and len(args.streams) < 2:
        parser.error("--streams needs two levels at least (the first is the baseline)")
    if args.tree is not None:
        args.tree = args.tree.resolve()
    server = None
    if args.warehouse is None:
        place: Place = Place(args.cache / "local")
    else:
        from deltaflow.testing.object_store import S3Server

        bucket = args.warehouse.removeprefix("s3://").split("/")[0] or "deltaflow-history"
        # The server's files under the cache: the histories in its bucket are kept too.
        server = S3Server(args.cache / "s3" / "server").start()
        with contextlib.suppress(Exception):  # made on an earlier run
            server.create_bucket(bucket)
        os.environ.update(server.storage_options)  # for deltalake, obstore and the nodes
        place = BucketPlace(args.cache / "s3", bucket)
    report = Report(place=place.warehouse("<size>"), engine=args.engine)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"deltaflow history benchmark: warehouse {report.place}, engine {args.engine}, "
        f"{os.cpu_count()} cores, load {load}; cache {args.cache}",
        flush=True,
    )
    began = time.monotonic()
    WARNINGS.install()
    try:
        asyncio.run(run(args, place, report))
    finally:
        if server is not None:
            server.stop()
    report.raw["seconds"] = time.monotonic() - began
    lines = headline(report, args)
    print_report(report, lines)
    print(f"total {report.raw['seconds']:.0f} s")
    if args.json is not None:
        figures = [{**asdict(f), "ratio": f.ratio} for f in report.figures]
        described = {"place": report.place, "engine": report.engine, "headline": lines}
        args.json.write_text(
            json.dumps(
                {**described, "figures": figures, **report.raw},
                indent=2,
                default=str,
            )
            + "\n"
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
