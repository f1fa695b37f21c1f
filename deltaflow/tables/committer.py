"""One table's committer on a node: its settings and schema as last read, its staging queue,
and the task that commits group after group.

Every commit holds the table's commit atomicity (:mod:`.atomicity`) for its read-modify-write
of the log and records the group's lane marks (:mod:`.marks`), so a batch is applied once
whoever else writes. The group is taken and prepared (its rows collapsed and conformed, and for
merge-on-read its new files written) before that, so the exclusive part is only the part that
reads and writes the log: two nodes writing one table mostly prepare at the same time.

A table that does not exist is created by the first commit that writes it, with the node's
defaults, in a commit of its own before the group's write.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from .._faults import fault_point
from ..columnar import DELETE_COLUMN
from ..errors import CommitConflictError, LaneFailedError, SchemaError, ServerError
from .footprint import Footprint
from .group import GroupWrite, PreparedGroup
from .grouping import conform, last_per_key
from .log import is_table, latest_version
from .marks import LaneMarks
from .merge_on_read import write_group
from .rewrite import DataFile
from .rows import INTERNAL_COLUMNS, no_evolution_text
from .settings import BUCKET_COLUMN, TableSettings
from .staging import Staged, StagingQueue, settle

if TYPE_CHECKING:
    from pathlib import Path

    from .atomicity import CommitAtomicity
    from .engine_settings import EngineSettings
    from .log_reader import LogReader
    from .statistics import EngineStatistics

__all__ = ["COMMITTER_RETRY_SECONDS", "COMMIT_ATTEMPTS", "Engine", "TableCommitter"]

log = logging.getLogger(__name__)

#: Attempts at a group commit that loses races (``CommitConflictError``) before it fails.
COMMIT_ATTEMPTS: Final = 5
#: A committer that failed before taking a group (a bug) tries again after this pause.
COMMITTER_RETRY_SECONDS: Final = 1.0


class Engine(Protocol):
    """What a committer needs of its table engine (:class:`.TableEngine` is one)."""

    warehouse: Path
    node_id: str
    settings: EngineSettings
    stats: EngineStatistics
    atomicity: CommitAtomicity
    log: LogReader
    checkpoints_due: dict[Path, int]

    def in_thread(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]: ...
    def describe(self, table: str, path: Path) -> Any: ...
    def create(self, table: str, path: Path, schema: Any, settings: TableSettings) -> None: ...
    def add_columns(self, table: str, path: Path, fields: Sequence[Any]) -> None: ...
    def checkpoint(self, table: str, path: Path, version: int) -> None: ...
    def merges_on_read(self, settings: TableSettings) -> bool: ...
    def write(self, group: GroupWrite) -> None: ...


class TableCommitter:
    """Owns one table on this node: its settings, schema, staging queue and commit task."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.path = engine.warehouse / name
        self.key: list[str] | None = None  # the key this node's writes use
        self.settings: TableSettings | None = None  # None until the table exists
        self.schema: Any = None  # the data columns (no bucket), None until the table exists
        self.partition_columns: tuple[str, ...] = ()
        self.queue = StagingQueue(engine.settings)
        self.taken: list[Staged] | None = None  # the group being committed, until settled
        self.loaded = False
        self.described_version = -1
        self.marks = LaneMarks(self.path)
        self.released_at: float | None = None  # when this node last released the table
        self.checkpointing: asyncio.Future[None] | None = None  # see _start_checkpoint
        self.task = asyncio.create_task(self._run(), name=f"deltaflow-commit-{name}")

    async def load(self) -> None:
        if not self.loaded:
            await self.engine.in_thread(self.describe)
            self.loaded = True

    def describe_if_newer(self) -> bool:
        """Blocking: read the table again if it has commits newer than the last read (an
        operator may have changed its settings); whether it did."""
        if latest_version(self.path) <= self.described_version:
            return False
        self.describe()
        return True

    def describe(self) -> None:
        """Blocking: read the table's settings and schema (nothing if it does not exist)."""
        if not is_table(self.path):
            self.settings = self.schema = None
            return
        import pyarrow as pa

        self.described_version = latest_version(self.path)
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
        return self.engine.settings.new_table(tuple(key))

    def put(self, staged: Staged) -> None:
        self.queue.put(staged)
        self.engine.stats.queued_rows += staged.rows

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
        queue = self.queue
        while True:
            self.taken = None  # the last group was settled (committed or failed)
            idle = not queue.ready.is_set()
            await queue.ready.wait()
            if idle and queue.converting:
                await queue.gather()
            await queue.pace()
            if not queue.any_takeable():
                queue.ready.clear()  # only writes of receivers still running: wait for release
                continue
            group = self.taken = queue.take()
            self.engine.stats.queued_rows -= sum(staged.rows for staged in group)
            fault_point("taken")
            preparing = asyncio.ensure_future(self.engine.in_thread(self._prepare, group))
            try:
                prepared = await asyncio.shield(preparing)
            except asyncio.CancelledError:  # the node stops: the group was taken off the queue
                self._fail(group, "node stopped before commit", count=False)
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. a full disk: the commit does it all
                log.warning("table %s: preparing a group failed (%s)", self.name, exc)
                prepared = None
            held = self.engine.atomicity.hold(self.name, released_at=self.released_at)
            entering = asyncio.ensure_future(self.engine.in_thread(held.__enter__))
            try:
                await asyncio.shield(entering)
            except asyncio.CancelledError:  # the node stops: release it once it is ours
                entering.add_done_callback(functools.partial(_release_if_taken, held=held))
                self._fail(group, "node stopped before commit", count=False)
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. the lock's timeout: fail the group
                self._fail(group, str(exc), count=True)
                continue
            committing = asyncio.ensure_future(self._commit_group(group, prepared))
            try:
                # Shielded: a commit under way finishes (and settles its batches) even when
                # the node stops, so the table is never released under a running commit.
                await asyncio.shield(committing)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await committing
                raise
            finally:
                held.__exit__(None, None, None)  # does not block: on the loop
                self.released_at = time.monotonic()
            due = self.engine.checkpoints_due.pop(self.path, None)
            if due is not None:
                self._start_checkpoint(due)

    def _start_checkpoint(self, version: int) -> None:
        """Write the checkpoint a commit made due, on a thread of its own: after the commit
        landed and its batches were acknowledged, and outside the table's atomicity, so
        neither this node's next commits nor another node's wait for it. One at a time per
        table: a checkpoint due while one is written is skipped (readers replay a few more
        commits until the next)."""
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

    def _fail(self, group: list[Staged], message: str, *, count: bool) -> None:
        """Settle a group taken off the queue that will not be committed (``count``: as
        failed batches, not as batches of a stopping node)."""
        for staged in group:
            if staged.future.done():
                continue  # settled already (a failure after part of the group was)
            if count:
                self.engine.stats.batches_failed += 1
            settle(staged.future, ServerError(message, node=self.engine.node_id))

    def fail_queued(self, message: str) -> None:
        """Settle every write still queued (the node stops)."""
        for staged in self.queue.items:
            settle(staged.future, ServerError(message, node=self.engine.node_id))

    async def _commit_group(
        self, group: list[Staged], prepared: PreparedGroup | None = None
    ) -> None:
        live = []
        for staged in group:  # checked right before every commit attempt
            if staged.abandoned is not None and staged.abandoned():
                settle(
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
                settle(group[0].future, exc)
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
            settle(staged.future, None)

    async def _commit_with_retries(
        self, group: list[Staged], prepared: PreparedGroup | None
    ) -> None:
        stats = self.engine.stats
        retrying = AsyncRetrying(  # a lost race is tried again, after 0.1, 0.2, 0.4, 0.8 s
            retry=retry_if_exception_type(CommitConflictError),
            stop=stop_after_attempt(COMMIT_ATTEMPTS),
            wait=wait_exponential(multiplier=0.1),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                started = time.monotonic()
                try:
                    rows = await self.engine.in_thread(self._commit, group, prepared)
                except CommitConflictError:
                    stats.commit_conflicts += 1
                    raise
        # The commit time counts the group's preparation too (not the wait for the table).
        elapsed = time.monotonic() - started + (prepared.seconds if prepared else 0.0)
        stats.commits += 1
        stats.rows_committed += rows
        stats.batches_committed += len(group)
        stats.largest_group_rows = max(stats.largest_group_rows, rows)
        stats.commit_seconds += elapsed
        stats.commit_seconds_histogram = stats.commit_seconds_histogram.observe(elapsed)
        stats.group_rows_histogram = stats.group_rows_histogram.observe(rows)

    def _prepare(self, group: list[Staged]) -> PreparedGroup | None:
        """Blocking, before the table is held: the group's rows as its commit will apply them,
        and for merge-on-read its new files written, when the table exists and the group needs
        no change to it; else None (the commit does it all while held, where an error is also
        reported)."""
        prepared = self._prepare_group(group)
        fault_point("prepared")
        return prepared

    def _prepare_group(self, group: list[Staged]) -> PreparedGroup | None:
        started = time.monotonic()
        settings, schema = self.settings, self.schema
        if settings is None or schema is None or not self.key:
            return None
        if settings.managed and list(settings.key) != self.key:
            return None  # reported while held
        try:
            data = self._conform(
                self._group_rows(group),
                recompute=any(s.buckets != settings.buckets for s in group),
                evolve=False,
            )
        except Exception:  # noqa: BLE001 - prepared again while held, which reports it
            return None
        written = None
        if (
            len(self.key) == 1
            and set(self.partition_columns) <= {BUCKET_COLUMN}
            and self.engine.merges_on_read(settings)
        ):
            written = write_group(self.path, data, schema, self.key[0])
        footprint = Footprint.of(data, self.key, bucketed=bool(settings.buckets))
        return PreparedGroup(
            len(group), data, settings, schema, written, time.monotonic() - started, footprint
        )

    def _group_rows(self, group: list[Staged]) -> Any:
        """The group's rows in staging order, the last per key kept."""
        import pyarrow as pa

        data = pa.concat_tables([s.table for s in group], promote_options="permissive")
        return last_per_key(data, self.key) if self.key else data

    def _commit(self, group: list[Staged], prepared: PreparedGroup | None = None) -> int:
        """Blocking, with the table held (see ``_commit_next``): drop writes the table
        already holds, then create the table if needed and apply the rest in one commit that
        also records the group's lane marks."""
        # Another node may have created the table or changed its schema or settings.
        if self.marks.refresh() or (self.settings is None and is_table(self.path)):
            self.describe()
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

    def _commit_rows(
        self, group: list[Staged], metadata: str, prepared: PreparedGroup | None
    ) -> int:
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
        """Blocking, while held: apply the conformed group ``data`` in one commit
        (``footprint``: its :meth:`.Footprint.of`, if prepared beforehand)."""
        assert self.settings is not None
        if key:
            if footprint is None:
                footprint = Footprint.of(data, key, bucketed=bool(self.settings.buckets))
            fault_point("before_listing")
            listed = self.engine.log.live_files(self.path) if footprint.ranges else None
            if listed is not None:
                files, version = listed
                # The files' deletion vectors, read from the log up to the same version (a
                # writer outside deltaflow, not holding the table, may have committed since).
                if self.marks.scanned < version:
                    self.marks.refresh()
                vectors = self.marks.vectors if self.marks.scanned == version else None
                footprint = footprint.checked_against(files, vectors, version)
                if footprint.fresh:
                    footprint = None  # no key of the group can be in the table: appended
        self.engine.write(GroupWrite(self.name, self.path, key, data, metadata, footprint, written))
        return int(data.num_rows)

    def _create(self, data: Any) -> None:
        """Blocking, while held: create the table from the group's columns."""
        import pyarrow as pa

        settings = self.engine.settings.new_table(tuple(self.key or ()))
        schema = pa.schema([f for f in data.schema if f.name not in INTERNAL_COLUMNS])
        self.engine.create(self.name, self.path, schema, settings)
        self.engine.stats.tables_created += 1
        log.info("created table %s (%s)", self.name, settings.describe())
        self.describe()

    def _conform(self, data: Any, *, recompute: bool, evolve: bool = True) -> Any:
        """Blocking, while held (or, with ``evolve`` False, anywhere): the group conformed to
        the table (:func:`.conform`), its new columns added first if the table allows schema
        evolution.

        Raises:
            SchemaError: a column the table lacks (and may not add, or ``evolve`` is False),
                or one whose type does not convert.
        """
        import pyarrow as pa

        settings, schema = self.settings, self.schema
        assert settings is not None and schema is not None
        node = self.engine.node_id
        new = [
            f for f in data.schema if f.name not in schema.names and f.name not in INTERNAL_COLUMNS
        ]
        if new:
            names = [f.name for f in new]
            if not settings.schema_evolution or not evolve:
                raise SchemaError(no_evolution_text(self.name, names), node=node)
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
            self.describe()
            schema = self.schema
        return conform(data, schema, settings, table=self.name, node=node, recompute=recompute)


def _release_if_taken(entering: asyncio.Future[Any], held: Any) -> None:
    if not entering.cancelled() and entering.exception() is None:
        held.__exit__(None, None, None)
