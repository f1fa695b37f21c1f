"""The table engine seam: validate rows, group batches per table, one commit per group.

A Delta MERGE has a fixed cost (one to two seconds with Spark), so no engine commits batch by
batch. Each table has a committer task: while one commit runs, newly staged batches queue up,
and the next commit takes all of them (up to ``max_group_rows`` and ``max_group_bytes``). Under
load commits grow and amortise the fixed cost; under light load a lone batch commits at once. A
group never waits to fill: it is cut the moment the previous commit ends (an idle committer
woken by a burst waits, briefly, for the writes of the burst still being converted). Only a
node's ``min_commit_interval`` holds a group back, to cap the commit rate: until that long
after the previous group was taken, or until a whole group is queued.

Within a group, several writes of one key collapse to the last in staging order (deletes
included), which is the order the node's lanes staged them: per (stream, partition) sequence
order. The result equals applying the batches one by one.

Rows are validated and converted to Arrow when staged, so a bad row fails only its own batch
(with the item and column named) and never poisons a group. Every commit holds the table's
cross-process lock (:mod:`.lock`) and records the group's lane marks (:mod:`.marks`).

Tables carry their settings (key, bucket layout, schema evolution, deletion vectors) in their
Delta properties (:mod:`.tables`). A table that does not exist is created by the first commit
that writes it, with the node's defaults, in a commit of its own before the group's write.
Keyed tables get the bucket column, and each MERGE names the buckets its group holds, so it
touches only their files.

Engines (subclasses of :class:`TableEngine`): Spark (:mod:`.spark_engine`, the default) and
delta-rs (:mod:`.deltars_engine`), selectable per node.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import functools
import logging
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

from .._faults import fault_point
from ..columnar import DELETE_COLUMN, ArrowRows
from ..errors import (
    CommitConflictError,
    LaneFailedError,
    SchemaError,
    ServerError,
    UsageError,
)
from ..partitioning import partition_table
from .conversion import column_of, convert_column, infer_column, table_type, transpose
from .footprint import Footprint
from .live_files import LiveFiles
from .lock import table_lock
from .marks import LaneMarks, Mark
from .merge_on_read import (
    KEY_MEMORY_BYTES,
    KeyColumns,
    MergeOnRead,
    vectors_at,
    write_group,
    write_merge_on_read,
)
from .rewrite import DataFile, RewriteUnsupported
from .tables import (
    BUCKET_COLUMN,
    DEFAULT_BUCKETS,
    MAX_BUCKETS,
    PROP_EXPIRED_LOG_CLEANUP,
    PROP_SCHEMA_EVOLUTION,
    TableSettings,
)

__all__ = [
    "BATCH_DURABLE_BUCKETS",
    "COMMIT_SECONDS_BUCKETS",
    "DEFAULT_MAX_GROUP_BYTES",
    "DEFAULT_MAX_GROUP_ROWS",
    "DEFAULT_MAX_QUEUED_ROWS",
    "DELETE_COLUMN",
    "GROUP_ROWS_BUCKETS",
    "MAX_COMMIT_INTERVAL",
    "EngineStatistics",
    "Histogram",
    "TableDescription",
    "TableEngine",
    "checked_commit_interval",
    "to_arrow_rows",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_GROUP_ROWS: Final = 500_000
DEFAULT_MAX_GROUP_BYTES: Final = 256 * 1024 * 1024
DEFAULT_MAX_QUEUED_ROWS: Final = 1_000_000
#: The longest ``min_commit_interval`` (seconds): batches wait up to this for their commit.
MAX_COMMIT_INTERVAL: Final = 600.0
_COMMIT_ATTEMPTS: Final = 5
#: How long a committer woken from idle waits at most for writes being converted to join its
#: group (see ``_TableCommitter._gather``).
GATHER_SECONDS: Final = 0.02
#: A committer that failed before taking a group (a bug) tries again after this pause.
COMMITTER_RETRY_SECONDS: Final = 1.0
_INTERNAL_COLUMNS: Final = (DELETE_COLUMN, BUCKET_COLUMN)
#: Upper bounds of the buckets of ``EngineStatistics.commit_seconds_histogram``, seconds.
COMMIT_SECONDS_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Upper bounds of the buckets of ``EngineStatistics.batch_durable_seconds_histogram``:
#: finer than a commit's around the tenths of a second where a loaded node's batches wait.
# fmt: off
BATCH_DURABLE_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
    60.0,
)
# fmt: on
#: Upper bounds of the buckets of ``EngineStatistics.group_rows_histogram``, rows.
GROUP_ROWS_BUCKETS: Final = (1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6)


@dataclass(frozen=True, slots=True)
class Histogram:
    """Observations counted in buckets, as a Prometheus histogram counts them.

    Immutable, so a copied :class:`EngineStatistics` is a true snapshot: :meth:`observe`
    returns a new histogram.

    Attributes:
        bounds: the buckets' inclusive upper bounds, ascending; one unbounded bucket follows.
        counts: observations per bucket (not cumulative), ``len(bounds) + 1`` of them.
        sum: the sum of every observation.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0

    @classmethod
    def empty(cls, bounds: Sequence[float]) -> Histogram:
        """A histogram with the buckets ``bounds`` and no observation."""
        return cls(tuple(bounds), (0,) * (len(bounds) + 1))

    @property
    def count(self) -> int:
        """The number of observations."""
        return sum(self.counts)

    def observe(self, value: float) -> Histogram:
        """This histogram with ``value`` counted in the first bucket whose bound is >= it."""
        counts = list(self.counts)
        counts[bisect.bisect_left(self.bounds, value)] += 1
        return Histogram(self.bounds, tuple(counts), self.sum + value)


@dataclass(slots=True)
class EngineStatistics:
    """Counters of a node's table engine (typed snapshot, see ``Node.statistics()``)."""

    commits: int = 0
    rows_committed: int = 0
    batches_committed: int = 0
    batches_failed: int = 0
    batches_deduplicated: int = 0
    commit_conflicts: int = 0
    largest_group_rows: int = 0
    commit_seconds: float = 0.0
    queued_rows: int = 0
    tables_created: int = 0
    columns_added: int = 0
    checkpoints: int = 0  # Delta checkpoints written, after the commit, outside the lock
    checkpoint_seconds: float = 0.0
    # Per commit: its duration in seconds (its preparation outside the table lock included, the
    # wait for the lock not) and its rows (0 when every batch was a duplicate).
    commit_seconds_histogram: Histogram = dataclasses.field(
        default_factory=lambda: Histogram.empty(COMMIT_SECONDS_BUCKETS)
    )
    group_rows_histogram: Histogram = dataclasses.field(
        default_factory=lambda: Histogram.empty(GROUP_ROWS_BUCKETS)
    )
    # Per committed batch: seconds from its staging to its commit landing (the wait for the
    # commit in progress, for the table's lock, and its own commit).
    batch_durable_seconds_histogram: Histogram = dataclasses.field(
        default_factory=lambda: Histogram.empty(BATCH_DURABLE_BUCKETS)
    )


@dataclass(frozen=True, slots=True)
class TableDescription:
    """What an engine reads about an existing table.

    Attributes:
        schema: the Arrow schema of every column, the bucket column included.
        partition_columns: Delta partition columns.
        properties: Delta table properties.
    """

    schema: Any
    partition_columns: tuple[str, ...]
    properties: Mapping[str, str]


@dataclass(slots=True)
class _Staged:
    table: Any  # pyarrow.Table incl. DELETE_COLUMN (and BUCKET_COLUMN when buckets > 0)
    future: asyncio.Future[None]
    abandoned: Callable[[], bool] | None
    mark: tuple[str, Mark] | None = None  # (lane, mark) for exactly-once; None: always apply
    buckets: int = 0  # the bucket count the bucket column was computed with
    # True while the receiver that staged the write still runs: the write is not committed
    # until it returned (a receiver that raises after staging must leave no trace).
    held: Callable[[], bool] | None = None
    rows: int = dataclasses.field(init=False)
    nbytes: int = dataclasses.field(init=False)  # measured once: it walks every buffer
    staged_at: float = dataclasses.field(init=False)  # time.monotonic()

    def __post_init__(self) -> None:
        self.rows = int(self.table.num_rows)
        self.nbytes = int(self.table.nbytes)
        self.staged_at = time.monotonic()

    def takeable(self) -> bool:
        return self.held is None or not self.held()


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A group made ready for its commit outside the table lock (see ``_TableCommitter._run``).

    Attributes:
        batches: how many writes the group had (a commit of fewer, some dropped as abandoned
            or already applied, prepares again).
        data: the group's rows as the commit applies them: one row per key (the last),
            conformed to the table's schema as read into ``settings`` and ``schema``.
        settings: the table's settings the rows were conformed to (the same object, or the
            table changed meanwhile and the group is prepared again under the lock).
        schema: the data columns the rows were conformed to (the same object, likewise).
        written: for merge-on-read, the group's new rows already written as data files, one
            per bucket (file, rows); None when the engine writes them in the commit.
        seconds: how long the preparation took (part of the commit time).
        footprint: where the group's keys can be (:meth:`.Footprint.of`, ranges cut from
            ``data``), checked against the live files under the lock.
    """

    batches: int
    data: Any
    settings: TableSettings
    schema: Any
    written: list[tuple[DataFile, Any]] | None
    seconds: float
    footprint: Footprint


class _TableCommitter:
    """Owns one table on this node: its settings, schema, staging queue and commit task."""

    def __init__(self, engine: TableEngine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.path = engine.warehouse / name
        self.key: list[str] | None = None  # the key this node's writes use
        self.settings: TableSettings | None = None  # None until the table exists
        self.schema: Any = None  # the data columns (no bucket), None until the table exists
        self.partition_columns: tuple[str, ...] = ()
        self.queue: deque[_Staged] = deque()
        self.queued_rows = 0
        self.queued_bytes = 0
        self.ready = asyncio.Event()
        self.full = asyncio.Event()  # set once the queue holds a whole group (see _pace)
        self.last_commit_at: float | None = None  # when the last group was taken
        self.taken: list[_Staged] | None = None  # the group being committed, until settled
        self.room = asyncio.Event()
        self.room.set()
        self.loaded = False
        self.described_version = -1
        self.marks = LaneMarks(self.path)
        self.session: Any = None
        self.released_at: float | None = None  # when this node last released the table lock
        self.converting = 0  # writes being checked and converted, about to be queued
        self.converted = asyncio.Event()  # set when the last of them is queued (or failed)
        self.checkpointing: asyncio.Future[None] | None = None  # see _start_checkpoint
        self.task = asyncio.create_task(self._run(), name=f"deltaflow-commit-{name}")

    async def load(self) -> None:
        if not self.loaded:
            await self.engine._in_thread(self._describe)
            self.loaded = True

    def _exists(self) -> bool:
        return (self.path / "_delta_log").is_dir()

    def _describe_if_newer(self) -> bool:
        """Blocking: read the table again if it has commits newer than the last read (an
        operator may have changed its settings); whether it did."""
        if _latest_version(self.path) <= self.described_version:
            return False
        self._describe()
        return True

    def _describe(self) -> None:
        """Blocking: read the table's settings and schema (nothing if it does not exist)."""
        if not self._exists():
            self.settings = self.schema = None
            return
        import pyarrow as pa

        self.described_version = _latest_version(self.path)
        desc = self.engine.describe(self.name, self.path)
        full = pa.schema(desc.schema)
        self.settings = TableSettings.from_table(desc.properties, full.names)
        self.schema = pa.schema([f for f in full if f.name != BUCKET_COLUMN])
        self.partition_columns = tuple(desc.partition_columns)
        if self.settings.buckets and BUCKET_COLUMN not in desc.partition_columns:
            log.warning("table %s: %s is not a partition column", self.name, BUCKET_COLUMN)

    def plan(self, key: Sequence[str]) -> TableSettings:
        """The settings a write with ``key`` is staged under (the table's, or the ones this
        node would create it with).

        Raises:
            SchemaError: the write's key is not the table's.
        """
        settings = self.settings
        if settings is not None and settings.managed:
            if list(settings.key) != list(key):
                how = f"merged on key {list(settings.key)}" if settings.key else "appended to"
                raise SchemaError(
                    f"table {self.name!r} is {how} (its deltaflow.key property); this write "
                    f"{'appends' if not key else f'merges on {list(key)}'}",
                    node=self.engine.node_id,
                )
        elif self.key is not None and self.key != list(key):
            how = f"merged on key {self.key}" if self.key else "appended to"
            raise SchemaError(
                f"table {self.name!r} is {how} on this node; this write "
                f"{'appends' if not key else f'merges on {list(key)}'}",
                node=self.engine.node_id,
            )
        if self.key is None:
            self.key = list(key)
        if settings is not None:
            return settings
        return self.engine.new_table_settings(key)

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Count a write being converted for the queue (see :meth:`_gather`)."""
        self.converting += 1
        try:
            yield
        finally:
            self.converting -= 1
            if not self.converting:
                self.converted.set()

    async def _gather(self) -> None:
        """Wait, up to ``GATHER_SECONDS``, for the writes being converted right now: a burst
        of batches (one per partition, as a client flushes them) wakes an idle committer with
        its first write, and would otherwise commit as a fragment of a group while the rest
        waits a whole commit for the next one. A lone batch waits for nothing."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(GATHER_SECONDS):
                while self.converting:
                    self.converted.clear()
                    await self.converted.wait()

    async def _pace(self) -> None:
        """With ``min_commit_interval``: wait until that long after the last group was taken,
        unless a whole group (``max_group_rows`` or ``max_group_bytes``) is queued by then."""
        interval = self.engine.min_commit_interval
        if not interval or self.last_commit_at is None:
            return
        delay = self.last_commit_at + interval - time.monotonic()
        if delay <= 0 or self._holds_a_group():
            return
        self.full.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self.full.wait()

    def wake_if_whole(self) -> None:
        """Wake a committer waiting out ``min_commit_interval`` once the queue holds a whole
        group (a write was queued, or a receiver returned and its writes can be taken)."""
        if self.engine.min_commit_interval and self._holds_a_group():
            self.full.set()

    def _holds_a_group(self) -> bool:
        """Whether the queue holds a whole group, or all it may hold (staging then waits), in
        writes that can be taken (not those of receivers still running)."""
        engine = self.engine
        max_rows = min(engine.max_group_rows, engine.max_queued_rows)
        if self.queued_rows < max_rows and self.queued_bytes < engine.max_group_bytes:
            return False
        takeable = [staged for staged in self.queue if staged.takeable()]
        return (
            sum(staged.rows for staged in takeable) >= max_rows
            or sum(staged.nbytes for staged in takeable) >= engine.max_group_bytes
        )

    async def _run(self) -> None:
        """Commit group after group for as long as the node runs. An error nothing else
        handles (a bug) fails the group taken, if any, and the committer goes on: batches are
        never left waiting for a commit that will not come."""
        while True:
            try:
                await self._commit_next()
            except Exception as exc:  # reported to the batches, then go on
                log.exception("table %s: the committer failed", self.name)
                taken, self.taken = self.taken, None
                if taken:
                    self._fail(
                        taken, f"the committer of table {self.name!r} failed: {exc}", count=True
                    )
                else:  # nothing was taken: try again, after a pause rather than in a spin
                    await asyncio.sleep(COMMITTER_RETRY_SECONDS)

    async def _commit_next(self) -> None:
        """Wait for writes, take the next group, prepare and commit it; again and again."""
        while True:
            self.taken = None  # the last group was settled (committed or failed)
            idle = not self.ready.is_set()
            await self.ready.wait()
            if idle and self.converting:
                await self._gather()
            await self._pace()
            if not self._any_takeable():
                self.ready.clear()  # only writes of receivers still running: wait for release()
                continue
            # The group is taken and prepared (its rows collapsed and conformed, and for
            # merge-on-read its new files written) before the table lock is taken, so the lock
            # is held only for the part that reads and writes the log: two nodes writing one
            # table mostly prepare at the same time instead of waiting for each other.
            group = self.taken = self._take_group()
            fault_point("taken")
            preparing = asyncio.ensure_future(self.engine._in_thread(self._prepare, group))
            try:
                prepared = await asyncio.shield(preparing)
            except asyncio.CancelledError:  # the node stops: the group was taken off the queue
                self._fail(group, "node stopped before commit", count=False)
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. a full disk: the commit does it all
                log.warning("table %s: preparing a group failed (%s)", self.name, exc)
                prepared = None
            lock = table_lock(self.engine.warehouse, self.name, released_at=self.released_at)
            entering = asyncio.ensure_future(self.engine._in_thread(lock.__enter__))
            try:
                await asyncio.shield(entering)
            except asyncio.CancelledError:  # the node stops: release the lock once it is ours
                entering.add_done_callback(functools.partial(_release_if_taken, lock=lock))
                self._fail(group, "node stopped before commit", count=False)
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. the lock's timeout: fail the group
                self._fail(group, str(exc), count=True)
                continue
            committing = asyncio.ensure_future(self._commit_group(group, prepared))
            try:
                # Shielded: a commit under way finishes (and settles its batches) even when
                # the node stops, so the lock is never released under a running commit.
                await asyncio.shield(committing)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await committing
                raise
            finally:
                lock.__exit__(None, None, None)  # a non-blocking unlock, on the loop
                # flock is not fair: the next locking lets a node waiting now commit first.
                self.released_at = time.monotonic()
            due = self.engine.checkpoints_due.pop(self.path, None)
            if due is not None:
                self._start_checkpoint(due)

    def _start_checkpoint(self, version: int) -> None:
        """Write the checkpoint a commit made due, on a thread of its own: after the commit
        landed and its batches were acknowledged, and outside the table lock, so neither this
        node's next commits nor another node's wait for it (a Spark checkpoint of a table with
        a few thousand files took 5 s on 2 cores). One at a time per table: a checkpoint due
        while one is written is skipped (readers replay a few more commits until the next)."""
        if self.checkpointing is None or self.checkpointing.done():
            self.checkpointing = asyncio.ensure_future(self._checkpoint(version))

    async def _checkpoint(self, version: int) -> None:
        """The checkpoint at ``version``; a failure is logged (a checkpoint only speeds readers
        up; the next interval tries again)."""
        started = time.monotonic()
        try:
            await asyncio.to_thread(self._write_checkpoint, version)
        except Exception as exc:  # noqa: BLE001
            log.warning("table %s: checkpoint at version %d failed: %s", self.name, version, exc)
            return
        self.engine.stats.checkpoints += 1
        self.engine.stats.checkpoint_seconds += time.monotonic() - started

    def _write_checkpoint(self, version: int) -> None:
        fault_point("checkpointing")
        self.engine.checkpoint(self.name, self.path, version)

    def _fail(self, group: list[_Staged], message: str, *, count: bool) -> None:
        """Settle a group taken off the queue that will not be committed (``count``: as
        failed batches, not as batches of a stopping node)."""
        for staged in group:
            if staged.future.done():
                continue  # settled already (a failure after part of the group was)
            if count:
                self.engine.stats.batches_failed += 1
            _settle(staged.future, ServerError(message, node=self.engine.node_id))

    def _take_group(self) -> list[_Staged]:
        """The next group: queued writes in staging order, up to the bounds, passing over the
        writes of receivers still running (they stay queued, in order)."""
        group: list[_Staged] = []
        held: deque[_Staged] = deque()
        rows = nbytes = 0
        max_rows, max_bytes = self.engine.max_group_rows, self.engine.max_group_bytes
        while self.queue:
            staged = self.queue[0]
            if not staged.takeable():
                held.append(self.queue.popleft())
                continue
            if group and (rows + staged.rows > max_rows or nbytes + staged.nbytes > max_bytes):
                break
            group.append(self.queue.popleft())
            rows += staged.rows
            nbytes += staged.nbytes
        held.extend(self.queue)
        self.queue = held
        self.queued_rows -= rows
        self.queued_bytes -= nbytes
        self.last_commit_at = time.monotonic()
        self.engine.stats.queued_rows -= rows
        if not self.queue:
            self.ready.clear()
        if self.queued_rows < self.engine.max_queued_rows or not self._any_takeable():
            self.room.set()
        return group

    def _any_takeable(self) -> bool:
        return any(staged.takeable() for staged in self.queue)

    async def _commit_group(self, group: list[_Staged], prepared: _Prepared | None = None) -> None:
        live = []
        for staged in group:  # checked right before every commit attempt
            if staged.abandoned is not None and staged.abandoned():
                _settle(
                    staged.future,
                    LaneFailedError(
                        "not applied: this batch or an earlier one of its partition failed",
                        node=self.engine.node_id,
                    ),
                )
            else:
                live.append(staged)
        group = live
        if not group:
            return
        try:
            await self._commit_with_retries(group, prepared)
        # Whatever the commit raised settles the batches' futures (or isolates the culprit).
        except Exception as exc:  # noqa: BLE001
            if len(group) == 1:
                self.engine.stats.batches_failed += 1
                _settle(group[0].future, exc)
                return
            # Isolate the culprit: the others must not fail with it.
            log.warning(
                "group commit to %s failed (%s); applying its %d batches one by one",
                self.name,
                exc,
                len(group),
            )
            for staged in group:
                await self._commit_group([staged])
            return
        landed = time.monotonic()
        stats = self.engine.stats
        for staged in group:
            stats.batch_durable_seconds_histogram = stats.batch_durable_seconds_histogram.observe(
                landed - staged.staged_at
            )
            _settle(staged.future, None)

    async def _commit_with_retries(self, group: list[_Staged], prepared: _Prepared | None) -> None:
        for attempt in range(1, _COMMIT_ATTEMPTS + 1):
            try:
                started = time.monotonic()
                rows = await self.engine._in_thread(self._commit, group, prepared)
            except CommitConflictError:
                self.engine.stats.commit_conflicts += 1
                if attempt == _COMMIT_ATTEMPTS:
                    raise
                await asyncio.sleep(0.05 * 2**attempt)
                continue
            # The commit time counts the group's preparation too (not the wait for the lock).
            elapsed = time.monotonic() - started + (prepared.seconds if prepared else 0.0)
            stats = self.engine.stats
            stats.commits += 1
            stats.rows_committed += rows
            stats.batches_committed += len(group)
            stats.largest_group_rows = max(stats.largest_group_rows, rows)
            stats.commit_seconds += elapsed
            stats.commit_seconds_histogram = stats.commit_seconds_histogram.observe(elapsed)
            stats.group_rows_histogram = stats.group_rows_histogram.observe(rows)
            return

    def _prepare(self, group: list[_Staged]) -> _Prepared | None:
        """Blocking, outside the table lock: the group's rows as its commit will apply them,
        and for merge-on-read its new files written, when the table exists and the group needs
        no change to it; else None (the commit does it all under the lock, where an error is
        also reported)."""
        prepared = self._prepare_group(group)
        fault_point("prepared")
        return prepared

    def _prepare_group(self, group: list[_Staged]) -> _Prepared | None:
        started = time.monotonic()
        settings, schema = self.settings, self.schema
        if settings is None or schema is None or not self.key:
            return None
        if settings.managed and list(settings.key) != self.key:
            return None  # reported under the lock
        try:
            data = self._conform(
                self._group_rows(group),
                recompute=any(s.buckets != settings.buckets for s in group),
                evolve=False,
            )
        except Exception:  # noqa: BLE001 - prepared again under the lock, which reports it
            return None
        written = None
        if (
            len(self.key) == 1
            and set(self.partition_columns) <= {BUCKET_COLUMN}
            and self.engine.merges_on_read(settings)
        ):
            written = write_group(self.path, data, schema, self.key[0])
        footprint = Footprint.of(data, self.key, bucketed=bool(settings.buckets))
        return _Prepared(
            len(group), data, settings, schema, written, time.monotonic() - started, footprint
        )

    def _group_rows(self, group: list[_Staged]) -> Any:
        """The group's rows in staging order, the last per key kept."""
        import pyarrow as pa

        data = pa.concat_tables([s.table for s in group], promote_options="permissive")
        return _last_per_key(data, self.key) if self.key else data

    def _commit(self, group: list[_Staged], prepared: _Prepared | None = None) -> int:
        """Blocking, called with the table lock held (see ``_run``): drop writes the table
        already holds, then create the table if needed and apply the rest in one commit that
        also records the group's lane marks."""
        # Another node may have created the table or changed its schema or settings.
        if self.marks.refresh() or (self.settings is None and self._exists()):
            self._describe()
        todo = [s for s in group if s.mark is None or not self.marks.applied(*s.mark)]
        self.engine.stats.batches_deduplicated += len(group) - len(todo)
        if not todo:
            return 0
        if prepared is not None and (
            len(todo) < prepared.batches
            or prepared.settings is not self.settings
            or prepared.schema is not self.schema
        ):
            # Some writes were abandoned or are applied already, or the table changed meanwhile.
            prepared = None
        lanes = LaneMarks.highest(s.mark for s in todo if s.mark is not None)
        metadata = LaneMarks.user_metadata(self.engine.node_id, lanes)
        rows = self._commit_rows(todo, metadata, prepared)
        self.marks.absorb(lanes)
        fault_point("after_commit")
        return rows

    def _commit_rows(self, group: list[_Staged], metadata: str, prepared: _Prepared | None) -> int:
        key = self.key or []
        if prepared is not None:
            return self._write(key, prepared.data, metadata, prepared.written, prepared.footprint)
        data = self._group_rows(group)
        if self.settings is None:
            if all(data.column(DELETE_COLUMN).to_pylist()):
                return 0  # only deletes, and no table: nothing exists to delete
            self._create(data)
        settings = self.settings
        assert settings is not None
        if settings.managed and list(settings.key) != key:
            raise SchemaError(
                f"table {self.name!r} was created with key {list(settings.key)} by another "
                f"writer; these rows merge on {key}",
                node=self.engine.node_id,
            )
        data = self._conform(data, recompute=any(s.buckets != settings.buckets for s in group))
        return self._write(key, data, metadata, None)

    def _write(
        self,
        key: list[str],
        data: Any,
        metadata: str,
        written: list[tuple[DataFile, Any]] | None,
        footprint: Footprint | None = None,
    ) -> int:
        """Blocking, under the lock: apply the conformed group ``data`` in one commit
        (``footprint``: its :meth:`.Footprint.of`, if prepared outside the lock)."""
        assert self.settings is not None
        if key:
            if footprint is None:
                footprint = Footprint.of(data, key, bucketed=bool(self.settings.buckets))
            fault_point("before_listing")
            listed = self.engine.live_files(self.path) if footprint.ranges else None
            if listed is not None:
                files, version = listed
                # The files' deletion vectors, read from the log up to the same version (a
                # writer outside deltaflow, not holding the lock, may have committed since).
                if self.marks.scanned < version:
                    self.marks.refresh()
                vectors = self.marks.vectors if self.marks.scanned == version else None
                footprint = footprint.checked_against(files, vectors, version)
                if footprint.fresh:
                    footprint = None  # no key of the group can be in the table: appended
        self.engine.write(self.name, self.path, key, data, metadata, footprint, written)
        return int(data.num_rows)

    def _create(self, data: Any) -> None:
        """Blocking, under the lock: create the table from the group's columns."""
        import pyarrow as pa

        settings = self.engine.new_table_settings(self.key or [])
        schema = pa.schema([f for f in data.schema if f.name not in _INTERNAL_COLUMNS])
        self.engine.create(self.name, self.path, schema, settings)
        self.engine.stats.tables_created += 1
        log.info("created table %s (%s)", self.name, settings.describe())
        self._describe()

    def _conform(self, data: Any, *, recompute: bool, evolve: bool = True) -> Any:
        """Blocking, under the lock (or, with ``evolve`` False, anywhere): the group with
        exactly the table's columns, in its order (added first if the table allows schema
        evolution), plus the bucket and delete columns. Rows checked against an older schema,
        or before the table existed, are cast here.

        Raises:
            SchemaError: a column the table lacks (and may not add, or ``evolve`` is False),
                or one whose type does not convert.
        """
        import pyarrow as pa

        settings, schema = self.settings, self.schema
        assert settings is not None and schema is not None
        node = self.engine.node_id
        new = [
            f for f in data.schema if f.name not in schema.names and f.name not in _INTERNAL_COLUMNS
        ]
        if new:
            names = [f.name for f in new]
            if not settings.schema_evolution or not evolve:
                raise SchemaError(_no_evolution_text(self.name, names), node=node)
            untyped = [f.name for f in new if pa.types.is_null(f.type)]
            if untyped:
                raise SchemaError(
                    f"new column(s) {untyped} of table {self.name!r} are null in every row, so "
                    "their type cannot be inferred; send a non-null value",
                    node=node,
                    details={"column": untyped[0]},
                )
            self.engine.add_columns(self.name, self.path, new)
            self.engine.stats.columns_added += len(new)
            log.info("table %s: added columns %s", self.name, names)
            self._describe()
            schema = self.schema
        columns: list[Any] = []
        cast_key = False
        for field in schema:
            if field.name not in data.column_names:
                columns.append(pa.nulls(data.num_rows, type=field.type))
                continue
            column = data.column(field.name)
            if column.type != field.type:
                column = convert_column(column, field, table=self.name, node=node)
                cast_key = cast_key or field.name in settings.key
            columns.append(column)
        out = pa.Table.from_arrays(columns, schema=schema)
        if settings.buckets:
            if recompute or cast_key or BUCKET_COLUMN not in data.column_names:
                buckets = partition_table(out, settings.key, settings.buckets)
            else:
                buckets = data.column(BUCKET_COLUMN)
            out = out.append_column(pa.field(BUCKET_COLUMN, pa.int32()), buckets)
        return out.append_column(DELETE_COLUMN, data.column(DELETE_COLUMN))


def _latest_version(path: Path) -> int:
    """The highest commit version in the table's log directory (-1 if none)."""
    try:
        names = [p.name for p in (path / "_delta_log").iterdir()]
    except FileNotFoundError:
        return -1
    return max(
        (int(n[:20]) for n in names if len(n) == 25 and n.endswith(".json") and n[:20].isdigit()),
        default=-1,
    )


def _no_evolution_text(table: str, columns: Sequence[str]) -> str:
    return (
        f"table {table!r} has no column(s) {list(columns)} and does not allow schema "
        "evolution; to add columns on write, create the table with allow_schema_evolution=True "
        f"(deltaflow table create --allow-schema-evolution), or set its table property "
        f"{PROP_SCHEMA_EVOLUTION}=true"
    )


def _release_if_taken(entering: asyncio.Future[Any], lock: Any) -> None:
    if not entering.cancelled() and entering.exception() is None:
        lock.__exit__(None, None, None)


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
        # Marked as seen: the writes of a failed or stopped batch have nobody awaiting them
        # (those who await still get the error).
        fut.exception()


def _last_per_key(table: Any, key: Sequence[str]) -> Any:
    """Rows of ``table`` keeping only the last occurrence of each key (order preserved)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = table.num_rows
    if rows < 2:
        return table
    if len(key) == 1:
        last_rows = _last_rows_of_one_column(table.column(key[0]))
        if last_rows is not None:
            return table if len(last_rows) == rows else table.take(last_rows)
    # Arrow's hash aggregation, not a Python pass: the highest row index of every key.
    index = "__deltaflow_row"
    last = (
        table.select(list(key))
        .append_column(index, pa.array(range(rows), type=pa.int64()))
        .group_by(list(key), use_threads=False)
        .aggregate([(index, "max")])
        .column(f"{index}_max")
    )
    if len(last) == rows:
        return table
    return table.take(pc.take(last, pc.sort_indices(last)))


def _last_rows_of_one_column(column: Any) -> Any:
    """Ascending indexes of the last occurrence of each value of ``column``, from its integers
    (or dictionary codes, a hash pass) and numpy's sort: a quarter of the cost of Arrow's hash
    aggregation for a group of 35 pages (1.6 ms instead of 6.6 for 28,000 rows). None for a
    type Arrow cannot dictionary-encode (the aggregation decides)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    column = column.combine_chunks()
    try:
        codes = (
            column.to_numpy(zero_copy_only=False)
            if pa.types.is_integer(column.type)
            else pc.dictionary_encode(column).indices.to_numpy(zero_copy_only=False)
        )
    except pa.ArrowNotImplementedError:
        return None
    _, first_from_end = np.unique(codes[::-1], return_index=True)
    return np.sort(len(codes) - 1 - first_from_end)


def to_arrow_rows(
    rows: Sequence[Any],
    deletes: frozenset[int],
    key: Sequence[str],
    schema: Any,
    *,
    table: str,
    node: str,
    evolve: bool = False,
    buckets: int = 0,
) -> Any:
    """Validate rows and build an Arrow table (with the delete flag column, and the bucket
    column when ``buckets`` > 0).

    Args:
        rows: row dicts, or an :class:`ArrowRows` page (its columns are checked as columns,
            and its own delete flags are used: ``deletes`` is ignored).
        schema: the table's data columns (an Arrow schema without the bucket column), or None
            when the table does not exist yet (the columns are then inferred from these rows).
        evolve: columns the table lacks are inferred and kept (schema evolution) instead of
            rejected.
        buckets: the table's bucket count; 0 for no bucket column.

    Raises:
        SchemaError: naming the first bad item (its index in the batch) and column.
    """
    fault_point("converting")
    import pyarrow as pa

    if isinstance(rows, ArrowRows):
        data, new = _page_columns(rows, key, schema, table=table, node=node, evolve=evolve)
        flags = rows.flags
    else:
        data, new = _row_columns(rows, deletes, key, schema, table=table, node=node, evolve=evolve)
        flags = pa.array([i in deletes for i in range(len(rows))], pa.bool_()) if deletes else None
    if schema is None:
        missing = [k for k in key if k not in data.column_names]
        if missing:
            raise SchemaError(f"rows for table {table!r} lack key column(s) {missing}", node=node)
    for field in data.schema:
        if (schema is None or field.name in new) and pa.types.is_null(field.type):
            raise SchemaError(
                f"column {field.name!r} is null in every row of this write to table {table!r}, "
                "which adds it, so its type cannot be inferred; send a non-null value",
                node=node,
                details={"column": field.name},
            )
    if buckets:
        data = data.append_column(
            pa.field(BUCKET_COLUMN, pa.int32()), partition_table(data, key, buckets)
        )
    return ArrowRows(data, flags).with_delete_column()


def _row_columns(
    rows: Sequence[Any],
    deletes: frozenset[int],
    key: Sequence[str],
    schema: Any,
    *,
    table: str,
    node: str,
    evolve: bool,
) -> tuple[Any, dict[str, None]]:
    """The columns of row dicts, checked; and the columns they add to the table."""
    import pyarrow as pa

    new: dict[str, None] = {}
    # The common case costs no Python pass per row: plain dicts whose columns the table has
    # (so none is reserved or unknown); keys are checked on the built columns. Anything else,
    # and a null key, takes the row-by-row check, which names the offending item.
    fast = (
        schema is not None
        and set(map(type, rows)) <= {dict}
        and all(k in schema.names for k in key)
        and all(map(frozenset(schema.names).issuperset, rows))
    )
    if not fast:
        new = _check_rows(rows, deletes, key, schema, table=table, node=node, evolve=evolve)
    if schema is None:
        # Inferred per column over every row (from_pylist would take the first row's keys).
        names = list(dict.fromkeys(c for row in rows for c in row))
        values = transpose(rows, names)
        data = pa.table(
            {
                c: infer_column(v, c, table=table, node=node)
                for c, v in zip(names, values, strict=True)
            }
        )
    else:
        present = set().union(*rows)
        fields = [f for f in schema if f.name in present]
        values = transpose(rows, [f.name for f in fields])
        for column, field in zip(values, fields, strict=True):
            if field.name not in key:
                for i in deletes:  # a delete needs only its key: its other values are ignored
                    column[i] = None
        given = {
            f.name: column_of(v, f, table=table, node=node)
            for v, f in zip(values, fields, strict=True)
        }
        data = pa.Table.from_arrays(
            [given[f.name] if f.name in given else pa.nulls(len(rows), f.type) for f in schema],
            schema=schema,
        )
    if fast and any(data.column(k).null_count for k in key):
        _check_rows(rows, deletes, key, schema, table=table, node=node, evolve=evolve)
    for c in new:
        column = [None if i in deletes else row.get(c) for i, row in enumerate(rows)]
        data = data.append_column(c, infer_column(column, c, table=table, node=node))
    return data, new


def _page_columns(
    page: ArrowRows, key: Sequence[str], schema: Any, *, table: str, node: str, evolve: bool
) -> tuple[Any, dict[str, None]]:
    """The columns of an Arrow page, checked as columns (a row is named only for a null key)
    and converted to the table's types; and the columns they add to the table."""
    import pyarrow.compute as pc

    data = page.table
    if BUCKET_COLUMN in data.column_names:  # the delete column never reaches here
        raise SchemaError(
            f"the page sets column {BUCKET_COLUMN!r}, which deltaflow reserves (the bucket "
            "layout is computed on the node)",
            node=node,
            details={"column": BUCKET_COLUMN},
        )
    for k in key:
        if k in data.column_names and data.column(k).null_count:
            i = pc.index(pc.is_null(data.column(k)), True).as_py()
            raise SchemaError(
                f"item #{i} of the batch has no value for key column {k!r} of table {table!r}",
                node=node,
                details={"item": i, "column": k},
            )
    if schema is None:
        return _as_table_types(data, table=table, node=node), {}
    unknown = [c for c in data.column_names if c not in schema.names]
    if unknown and not evolve:
        raise SchemaError(
            f"{_no_evolution_text(table, unknown)} (its columns: {sorted(schema.names)})",
            node=node,
            details={"column": unknown[0]},
        )
    for field in schema:
        at = data.schema.get_field_index(field.name)
        if at >= 0 and data.schema.field(at).type != field.type:
            # Converted once here: the commit then finds the table's type (raises if not).
            column = convert_column(data.column(at), field, table=table, node=node)
            data = data.set_column(at, field, column)
    if unknown:
        data = _as_table_types(data, table=table, node=node, only=unknown)
    return data, dict.fromkeys(unknown)


def _as_table_types(data: Any, *, table: str, node: str, only: Sequence[str] | None = None) -> Any:
    """A page's columns that the table does not have yet (all of them for a new table) in
    the types the table will hold them as (:func:`.conversion.table_type`)."""
    import pyarrow as pa

    for at, field in enumerate(data.schema):
        if only is not None and field.name not in only:
            continue
        wanted = pa.field(field.name, table_type(field.type), nullable=True)
        if wanted.type != field.type:
            data = data.set_column(
                at, wanted, convert_column(data.column(at), wanted, table=table, node=node)
            )
    return data


def _check_rows(
    rows: Sequence[Any],
    deletes: frozenset[int],
    key: Sequence[str],
    schema: Any,
    *,
    table: str,
    node: str,
    evolve: bool,
) -> dict[str, None]:
    """Check every row, naming the first bad one; the columns the rows add to the table (only
    when ``evolve``, else an unknown column is an error).

    Raises:
        SchemaError: naming the item (its index in the batch) and column.
    """
    columns = set(schema.names) if schema is not None else None
    new: dict[str, None] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise SchemaError(
                f"item #{i} of the batch is a {type(row).__name__}; rows for table {table!r} "
                "must be maps of column name to value",
                node=node,
                details={"item": i},
            )
        for k in key:
            if row.get(k) is None:
                raise SchemaError(
                    f"item #{i} of the batch has no value for key column {k!r} of table {table!r}",
                    node=node,
                    details={"item": i, "column": k},
                )
        if BUCKET_COLUMN in row or DELETE_COLUMN in row:
            reserved = BUCKET_COLUMN if BUCKET_COLUMN in row else DELETE_COLUMN
            raise SchemaError(
                f"item #{i} of the batch sets column {reserved!r}, which deltaflow reserves "
                "(the bucket layout and the delete flag are computed on the node)",
                node=node,
                details={"item": i, "column": reserved},
            )
        if columns is not None and i not in deletes:
            unknown = [c for c in row if c not in columns]
            if unknown and not evolve:
                raise SchemaError(
                    f"item #{i} of the batch: {_no_evolution_text(table, unknown)} "
                    f"(its columns: {sorted(columns)})",
                    node=node,
                    details={"item": i, "column": unknown[0]},
                )
            new.update(dict.fromkeys(unknown))
    return new


def checked_commit_interval(seconds: float) -> float:
    """``min_commit_interval``, checked (a node's config and its engine share the check).

    Raises:
        UsageError: it is not between 0 and ``MAX_COMMIT_INTERVAL``.
    """
    if not 0 <= seconds <= MAX_COMMIT_INTERVAL:
        raise UsageError(
            f"min_commit_interval must be between 0 and {MAX_COMMIT_INTERVAL:g} seconds, "
            f"got {seconds!r}"
        )
    return seconds


class TableEngine:
    """Applies staged rows to Delta tables under ``warehouse``; the seam between the node and a
    Delta implementation (Spark: :class:`~.spark_engine.SparkTableEngine`; delta-rs:
    :class:`~.deltars_engine.DeltaRsTableEngine`).

    The base class owns everything that must not differ between engines: validation, group
    commit, table settings and the bucket layout, schema checks and evolution, the per-table
    commit lock, lane marks (exactly-once) and statistics. A subclass supplies blocking methods
    run in worker threads: :meth:`_start_engine`, :meth:`describe`, :meth:`create`,
    :meth:`add_columns` and :meth:`write`.

    Args:
        warehouse: directory holding one Delta table per sub-directory.
        node_id: for error messages and logs.
        max_group_rows: rows per commit at most. Default 500,000.
        max_group_bytes: Arrow bytes per commit at most. Default 256 MiB.
        max_queued_rows: rows staged per table and not yet committed; staging waits beyond it
            (backpressure reaches the client through the unacknowledged window). Default
            1,000,000.
        min_commit_interval: seconds between the takes of two groups of one table, at least,
            unless a whole group is queued (fewer, larger commits at a steady rate, for a
            little latency). Default 0: a group is taken as soon as the previous commit ends.
        table_buckets: buckets of the keyed tables this node creates on first write (0: no
            bucket layout). Default 64.
        schema_evolution: tables this node creates on first write allow schema evolution.
            Default False.
        deletion_vectors: tables this node creates on first write have deletion vectors
            (engines with ``creates_deletion_vectors`` only). Default False.
        threads: worker threads for engine calls (the event loop never blocks on them).

    Raises:
        UsageError: a bound below 1, or deletion vectors asked of an engine that cannot create
            them.
    """

    #: The name nodes select the engine by (``--engine``).
    name: ClassVar[str] = ""
    #: Whether the engine creates tables with deletion vectors that every engine can read.
    creates_deletion_vectors: ClassVar[bool] = False
    #: Bytes of key columns kept per table for merge-on-read (:class:`.KeyColumns`).
    key_memory_bytes: int = KEY_MEMORY_BYTES

    def __init__(
        self,
        warehouse: Path,
        *,
        node_id: str,
        max_group_rows: int = DEFAULT_MAX_GROUP_ROWS,
        max_group_bytes: int = DEFAULT_MAX_GROUP_BYTES,
        max_queued_rows: int = DEFAULT_MAX_QUEUED_ROWS,
        min_commit_interval: float = 0.0,
        table_buckets: int = DEFAULT_BUCKETS,
        schema_evolution: bool = False,
        deletion_vectors: bool = False,
        threads: int = 2,
    ) -> None:
        if min(max_group_rows, max_group_bytes, max_queued_rows) < 1:
            raise UsageError("max_group_rows, max_group_bytes and max_queued_rows must be >= 1")
        if deletion_vectors and not self.creates_deletion_vectors:
            raise UsageError(
                f"the {self.name} engine cannot create tables with deletion vectors (see "
                "docs/tables.md); use the spark engine, or create the table with "
                "`deltaflow table create --engine spark --deletion-vectors`: every engine "
                "writes to it then"
            )
        self.warehouse = Path(warehouse)
        self.node_id = node_id
        self.max_group_rows = max_group_rows
        self.max_group_bytes = max_group_bytes
        self.max_queued_rows = max_queued_rows
        self.min_commit_interval = checked_commit_interval(min_commit_interval)
        if not 0 <= table_buckets <= MAX_BUCKETS:
            raise UsageError(f"table_buckets must be between 0 and {MAX_BUCKETS}")
        self.table_buckets = table_buckets
        self.schema_evolution = schema_evolution
        self.deletion_vectors = deletion_vectors
        self.stats = EngineStatistics()
        self.staging_dir = self.warehouse / ".deltaflow" / "staging" / node_id
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=f"deltaflow-{self.name}")
        self._tables: dict[str, _TableCommitter] = {}
        self._open: dict[Path, Any] = {}  # delta-rs tables, see _latest
        self._live: dict[Path, LiveFiles] = {}  # their live files, see live_files
        self._key_columns: dict[Path, KeyColumns] = {}  # merge-on-read, per table
        # Tables whose last commit reached their checkpoint interval: the version to write a
        # checkpoint at, once the table lock is released (set by the engine's commit).
        self.checkpoints_due: dict[Path, int] = {}

    def new_table_settings(self, key: Sequence[str]) -> TableSettings:
        """The settings of a table this node creates on first write with ``key``."""
        return TableSettings(
            key=tuple(key),
            buckets=self.table_buckets if key else 0,
            schema_evolution=self.schema_evolution,
            deletion_vectors=self.deletion_vectors,
        )

    async def start(self) -> None:
        """Prepare the warehouse and the engine (Spark takes seconds on first use)."""
        self.warehouse.mkdir(parents=True, exist_ok=True)
        # Leftovers of this node's earlier run (other nodes may share the warehouse).
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        await self._in_thread(self._start_engine)

    def _start_engine(self) -> None:
        """Blocking: start the engine."""

    def describe(self, table: str, path: Path) -> TableDescription:
        """Blocking: the schema, partition columns and properties of the table at ``path``,
        read from its log by delta-rs (milliseconds, where Spark's reading and ``DESCRIBE
        DETAIL`` took 0.7 s a table, 2-3 s in a fresh JVM)."""
        import pyarrow as pa
        from deltalake import DeltaTable

        dt = DeltaTable(str(path))
        meta = dt.metadata()
        return TableDescription(
            schema=pa.schema(dt.schema().to_arrow()),
            partition_columns=tuple(meta.partition_columns),
            properties=dict(meta.configuration),
        )

    def create(self, table: str, path: Path, schema: Any, settings: TableSettings) -> None:
        """Blocking, under the table's lock: create the empty table at ``path``.

        Args:
            schema: the data columns (Arrow); the engine adds the bucket column and partitions
                by it when ``settings.buckets`` > 0.
            settings: stored in the table's properties.
        """
        raise NotImplementedError

    def add_columns(self, table: str, path: Path, fields: Sequence[Any]) -> None:
        """Blocking, under the table's lock: add nullable columns (Arrow fields), one commit."""
        raise NotImplementedError

    def checkpoint(self, table: str, path: Path, version: int) -> None:
        """Blocking, outside the table's lock, while other commits may land: write the
        table's Delta checkpoint at ``version``. A commit that reaches the table's
        ``delta.checkpointInterval`` records its version in ``checkpoints_due`` instead of
        writing the checkpoint itself under the lock.

        delta-rs writes it, for either engine: 0.06 s for a table of 2,000 files, where
        Spark's checkpoint job took 5 s and both cores. Then, as Delta does after a
        checkpoint, it deletes the log's commit files older than the table's
        ``delta.logRetentionDuration`` (unless ``delta.enableExpiredLogCleanup`` is false).
        """
        from deltalake import DeltaTable

        target = DeltaTable(str(path), version=version)
        target.create_checkpoint()
        if target.metadata().configuration.get(PROP_EXPIRED_LOG_CLEANUP, "true") != "false":
            target.cleanup_metadata()

    def write(
        self,
        table: str,
        path: Path,
        key: list[str],
        data: Any,
        metadata: str,
        footprint: Footprint | None,
        written: list[tuple[DataFile, Any]] | None = None,
    ) -> None:
        """Blocking, under the table's lock: apply ``data`` to the existing table in one commit.

        Args:
            key: merge key columns, or empty to append.
            data: a pyarrow Table with exactly the table's columns (the bucket column
                included), plus the ``DELETE_COLUMN`` flag; at most one row per key.
            metadata: the commit's ``userMetadata`` (lane marks): it must land in the same
                commit as the data.
            footprint: for a merge, where ``data``'s keys can be in the table; the MERGE
                names it (:meth:`Footprint.merge_condition`) so it reads and rewrites no other
                files. Its ``files`` lists the live files that may hold one of the keys (when
                the key has ranges). None to append the rows that are not deletes instead:
                the table has no key, or holds none of the group's keys.
            written: the group's rows that are not deletes, already written as data files
                (:func:`.write_group`), when :meth:`merges_on_read` said the table is applied
                by merge-on-read: the commit adds them instead of writing the rows again. An
                engine that applies the group another way after all leaves them unreferenced
                (``deltaflow table vacuum`` deletes them).
        """
        raise NotImplementedError

    def merges_on_read(self, settings: TableSettings) -> bool:
        """Whether this engine applies groups to a table with ``settings`` by merge-on-read
        (:mod:`.merge_on_read`): the committer then writes a group's new files before it takes
        the table lock, and passes them to :meth:`write`."""
        return False

    def live_files(self, path: Path) -> tuple[Any, int] | None:
        """Blocking, under the table's lock: the table's live files with their statistics
        (``DeltaTable.get_add_actions(flatten=True)`` of delta-rs, which reads the Delta log
        whichever engine wrote it) and the version they are of, or None if they cannot be
        read (the ``deltalake`` package missing, a table feature delta-rs does not read): the
        group is then merged.

        Listed through delta-rs once, then kept up to date from the commits made since
        (:class:`.LiveFiles`), which spares delta-rs's replay of the log under the lock."""
        index = self._kept(path)
        if index is not None:
            return index.files, index.version
        try:
            table = self._latest(path)
            files, version = table.get_add_actions(flatten=True), int(table.version())
        except Exception as exc:  # noqa: BLE001 - any failure only costs the append shortcut
            self._open.pop(path, None)
            log.debug("cannot read the file statistics of %s (%s): merging", path, exc)
            return None
        if LiveFiles.understood(files, table.metadata().configuration):
            index = self._live[path] = LiveFiles(path, files, version)
            return index.files, version
        return files, version

    def _planned(self, path: Path) -> tuple[Any, int]:
        """Blocking, under the table's lock: the delta-rs table (for its metadata, protocol
        and schema) and the version a commit is planned on, the latest. From the live files
        when they are kept (no commit since the table was read changed its metadata or
        protocol, or they would have declined), else by bringing the table up to date."""
        index = self._kept(path)
        if index is not None:
            table = self._open.get(path)
            if table is None:  # opened afresh, at the latest version: its metadata is current
                table = self._latest(path)
            return table, index.version
        table = self._latest(path)
        return table, int(table.version())

    def _kept(self, path: Path) -> LiveFiles | None:
        """The table's kept live files brought up to the latest commit, or None (and
        dropped) when there are none or they declined."""
        index = self._live.get(path)
        if index is not None and index.advance(_latest_version(path)):
            return index
        self._live.pop(path, None)
        return None

    def _forget(self, path: Path) -> None:
        """Read the table afresh next time (a write failed: its state is unknown)."""
        self._open.pop(path, None)
        self._live.pop(path, None)

    def _merge_on_read(
        self,
        table: str,
        path: Path,
        target: Any,
        data: Any,
        key: str,
        footprint: Footprint | None,
        written: list[tuple[DataFile, Any]] | None,
        planned: int | None = None,
    ) -> MergeOnRead:
        """Blocking, under the table's lock: write the files and deletion vectors that apply
        the group by merge-on-read to ``target`` (delta-rs, for the table's metadata) at the
        version the commit is planned on (``planned``, None: ``target``'s); the engine commits
        :meth:`.MergeOnRead.actions`, then calls :meth:`_landed`. ``footprint`` None: no live
        file can hold one of the group's keys.

        Raises:
            RewriteUnsupported: the footprint does not list the live files that may hold the
                group's keys (a key without ranges, or statistics delta-rs cannot read).
        """
        if footprint is not None and footprint.files is None:
            raise RewriteUnsupported("no live files listed for the group's keys")
        memory = self._key_columns.setdefault(path, KeyColumns(self.key_memory_bytes))
        if footprint is None:
            candidates, vectors = None, {}
        else:
            candidates = footprint.files
            version = int(target.version()) if planned is None else planned
            vectors = vectors_at(footprint, version, table, self.node_id)
        return write_merge_on_read(target, path, data, key, candidates, vectors, memory, written)

    def _landed(self, path: Path, done: MergeOnRead) -> None:
        """A merge-on-read commit landed: forget the key columns of the files it removed."""
        memory = self._key_columns.get(path)
        if memory is not None:
            memory.forget(done.removed)

    def _latest(self, path: Path) -> Any:
        """Blocking: the delta-rs table at ``path``, at its latest version. Kept open between
        commits and brought up to date by reading only the commits made since (a commit asks
        twice, for its file statistics and its write: the second finds the log unchanged by a
        listing, 0.06 ms, where delta-rs's own no-op update costs 1.6 ms)."""
        from deltalake import DeltaTable

        table = self._open.get(path)
        if table is None:
            table = self._open[path] = DeltaTable(str(path))
        elif table.version() < _latest_version(path):
            table.update_incremental()
        return table

    async def stop(self) -> None:
        for committer in self._tables.values():
            committer.task.cancel()
        for committer in self._tables.values():
            with contextlib.suppress(asyncio.CancelledError):
                await committer.task
            if committer.checkpointing is not None:  # finishes on its thread: wait for it
                await asyncio.wait([committer.checkpointing])
            for staged in committer.queue:
                _settle(staged.future, ServerError("node stopped before commit", node=self.node_id))
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)

    def release(self) -> None:
        """Some ``held`` writes may have become committable (their receiver returned)."""
        for committer in self._tables.values():
            if committer.queue:
                committer.ready.set()
                committer.wake_if_whole()

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def stage(
        self,
        table: str,
        key: Sequence[str],
        rows: Sequence[Any],
        deletes: frozenset[int],
        *,
        abandoned: Callable[[], bool] | None = None,
        mark: tuple[str, Mark] | None = None,
        held: Callable[[], bool] | None = None,
    ) -> asyncio.Future[None]:
        """Validate ``rows`` and queue them for ``table``'s next commit.

        Args:
            key: merge key columns; empty to append (rows are inserted as they are).
            deletes: indexes of rows that delete their key (merge tables only).
            abandoned: checked right before the commit; true drops the write.
            mark: ``(lane, (seq, k))``: the write is skipped if the table already holds it.
            held: true while the write must not be committed yet (its receiver still runs);
                call :meth:`release` when it turns false.

        Returns a future that resolves when the commit holding the rows is durable (or fails
        with the commit's error). Waits while the table's queue is full.

        Raises:
            SchemaError: a row does not fit (the batch is not staged at all).
        """
        if not key and deletes:
            raise SchemaError(
                f"table {table!r} is written by appends; deletes need a key", node=self.node_id
            )
        committer = self._tables.get(table)
        if committer is None:
            committer = self._tables[table] = _TableCommitter(self, table)
        with committer.arriving():
            await committer.load()
            for attempt in (1, 2):
                settings = committer.plan(key)
                try:
                    converted = await asyncio.to_thread(
                        to_arrow_rows,
                        rows,
                        deletes,
                        key,
                        committer.schema,
                        table=table,
                        node=self.node_id,
                        evolve=settings.schema_evolution,
                        buckets=settings.buckets,
                    )
                    break
                except SchemaError as exc:
                    # Checked against what this node last read of the table: if the table changed
                    # since (a column added, evolution allowed), check once more against it.
                    if attempt == 2 or "column" not in exc.details:
                        raise
                    if not await self._in_thread(committer._describe_if_newer):
                        raise
        # Waits for room, unless everything queued is held by running receivers: then nothing
        # could make room until they return (this one among them, perhaps).
        while committer.queued_rows >= self.max_queued_rows and committer._any_takeable():
            committer.room.clear()
            await committer.room.wait()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        staged = _Staged(converted, fut, abandoned, mark, settings.buckets, held)
        committer.queue.append(staged)
        committer.queued_rows += staged.rows
        committer.queued_bytes += staged.nbytes
        self.stats.queued_rows += staged.rows
        committer.ready.set()
        committer.wake_if_whole()
        return fut
