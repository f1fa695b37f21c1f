"""The table engine seam: what a node asks of a Delta implementation, and what every engine
shares.

:class:`TableEngine` validates staged rows (:mod:`.rows`), keeps a committer per table
(:mod:`.committer`: staging queue, group commit, lane marks, commit atomicity) and statistics.
A subclass supplies the blocking calls that touch a table: :meth:`~TableEngine.create`,
:meth:`~TableEngine.add_columns` and :meth:`~TableEngine.write` (one group, one commit). Engines:
delta-rs (:mod:`deltaflow.engines.delta_rs`) and Spark (:mod:`deltaflow.engines.spark`);
:mod:`deltaflow.engines` builds one from a node's options.

Tables carry their settings (key, bucket layout, schema evolution, deletion vectors) in their
Delta properties (:mod:`.settings`). Keyed tables get the bucket column, and each MERGE names
the buckets its group holds, so it touches only their files.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Final

from ..columnar import DELETE_COLUMN
from ..errors import OverloadedError, SchemaError, UsageError
from ..storage.paths import Location, StorePath, location
from .atomicity import CommitAtomicity, atomicity_for
from .commit.committer import TableCommitter
from .commit.owner import TableOwner
from .commit.prepared import CommitSink
from .commit.staging import Staged
from .constraints import check_constraints
from .engine_settings import EngineSettings
from .group import GroupWrite
from .log import commit_info, commit_log_entry, delta_table, is_table
from .log_reader import LogReader, TableDescription
from .mark_store import MarkStores
from .marks import Mark
from .merge_on_read import (
    KEY_MEMORY_BYTES,
    KeyColumns,
    MergeOnRead,
    has_deletion_vectors,
    vectors_at,
    write_merge_on_read,
)
from .rewrite import Rewrite, RewriteUnsupported, write_files
from .rows import to_arrow_rows
from .settings import (
    CHECKPOINT_INTERVAL,
    PROP_CHECKPOINT_INTERVAL,
    PROP_EXPIRED_LOG_CLEANUP,
    TableSettings,
)
from .statistics import EngineStatistics

__all__ = ["DEFAULT_MAX_TABLES", "DELETE_COLUMN", "GroupWrite", "TableDescription", "TableEngine"]

#: Tables a node writes at most (``max_tables``): each keeps its committer while the node runs.
DEFAULT_MAX_TABLES: Final = 1000
#: Most tables :meth:`TableEngine.tables` lists: ~2 MB of ``/v1/cluster``, far below 8 MiB.
_MAX_LISTED_TABLES: Final = 10_000


class TableEngine:
    """Applies staged rows to Delta tables under ``warehouse``; the seam between the node and a
    Delta implementation.

    The base class owns everything that must not differ between engines: validation, group
    commit, table settings and the bucket layout, schema checks and evolution, commit
    atomicity, lane marks (exactly-once) and statistics. A subclass supplies blocking methods
    run in worker threads: :meth:`_start_engine`, :meth:`describe`, :meth:`create`,
    :meth:`add_columns` and :meth:`write`.

    Args:
        warehouse: directory holding one Delta table per sub-directory.
        node_id: for error messages and logs.
        threads: worker threads for engine calls (the event loop never blocks on them).
        settings: the engine's :class:`.EngineSettings` (group bounds, commit pace, the
            settings of tables the node creates on first write); or give its fields instead.
        max_tables: tables it writes at most (one more: OverloadedError). Default 1,000.

    Raises:
        UsageError: a bad setting, or deletion vectors asked of an engine that cannot create
            them.
    """

    #: The name nodes select the engine by (``--engine``).
    name: ClassVar[str] = ""
    #: Whether the engine creates tables with deletion vectors that every engine can read.
    creates_deletion_vectors: ClassVar[bool] = False
    #: Whether this engine's groups go to the table's committer as prepared files (see
    #: :mod:`.commit.committer`); an engine that applies them another way (the Spark SQL writer's
    #: MERGE) commits them itself.
    prepares_groups: bool = True
    #: Bytes of key columns kept per table for merge-on-read (:class:`.KeyColumns`).
    key_memory_bytes: int = KEY_MEMORY_BYTES

    def __init__(
        self,
        warehouse: Location | str,
        *,
        node_id: str,
        threads: int = 2,
        settings: EngineSettings | None = None,
        max_tables: int = DEFAULT_MAX_TABLES,
        **fields: Any,
    ) -> None:
        if settings is not None and fields:
            raise UsageError(f"pass settings or {sorted(fields)}, not both")
        if not (isinstance(max_tables, int) and max_tables >= 1):
            raise UsageError(f"max_tables must be an int of at least 1, got {max_tables!r}")
        self.max_tables = max_tables
        self.settings = settings if settings is not None else EngineSettings(**fields)
        if self.settings.deletion_vectors and not self.creates_deletion_vectors:
            raise UsageError(
                f"the {self.name} engine cannot create tables with deletion vectors (see "
                "docs/tables.md); use the spark engine, or create the table with "
                "`deltaflow table create --engine spark --deletion-vectors`: every engine "
                "writes to it then"
            )
        self.warehouse: Location = location(warehouse)
        self.node_id = node_id
        self.stats = EngineStatistics()
        self.atomicity: CommitAtomicity = atomicity_for(self.warehouse)
        self.log = LogReader()
        #: Each table's lane marks, one store for the owner's side and the committer.
        self.mark_stores = MarkStores()
        # This node's own files (the Spark engine's staged groups): in a local warehouse,
        # beside the tables; a node on an object store keeps them on its own disk.
        self.staging_dir = (
            Path(tempfile.gettempdir()) / f"deltaflow-{node_id}" / "staging"
            if isinstance(self.warehouse, StorePath)
            else self.warehouse / ".deltaflow" / "staging" / node_id
        )
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=f"deltaflow-{self.name}")
        self._owners: dict[str, TableOwner] = {}
        self._key_columns: dict[Location, KeyColumns] = {}  # merge-on-read, per table
        # Tables whose last commit reached their checkpoint interval: the version to write a
        # checkpoint at, once the table is released (set by the engine's commit).
        self.checkpoints_due: dict[Location, int] = {}
        #: Where this node's prepared groups go to be committed (the node's
        #: :class:`~deltaflow.server.commits.CommitRouter`); None: each group is committed by
        #: this node itself while it holds the table (an engine without a node).
        self.commit_sink: CommitSink | None = None
        self._committers: dict[str, TableCommitter] = {}

    async def start(self) -> None:
        """Prepare the warehouse and the engine (Spark takes seconds on first use)."""
        await self.in_thread(self._prepare_warehouse)
        await self.in_thread(self._start_engine)

    def _prepare_warehouse(self) -> None:
        """Blocking: create the warehouse; remove the leftovers of this node's earlier run
        (other nodes may share the warehouse)."""
        self.warehouse.mkdir(parents=True, exist_ok=True)  # nothing to do on a store
        shutil.rmtree(self.staging_dir, ignore_errors=True)

    def _start_engine(self) -> None:
        """Blocking: start the engine."""

    def describe(self, table: str, path: Location) -> TableDescription:
        """Blocking: the schema, partition columns and properties of the table at ``path``,
        read from its log by delta-rs (milliseconds, where Spark takes most of a second)."""
        return self.log.describe(path)

    def create(self, table: str, path: Location, schema: Any, settings: TableSettings) -> None:
        """Blocking, with the table held: create the empty table at ``path``.

        Args:
            schema: the data columns (Arrow); the engine adds the bucket column and partitions
                by it when ``settings.buckets`` > 0.
            settings: stored in the table's properties.
        """
        raise NotImplementedError

    def add_columns(self, table: str, path: Location, fields: Sequence[Any]) -> None:
        """Blocking, with the table held: add nullable columns (Arrow fields), one commit."""
        raise NotImplementedError

    def checkpoint(self, table: str, path: Location, version: int) -> None:
        """Blocking, while other commits may land: write the table's Delta checkpoint at
        ``version``. A commit that reaches the table's ``delta.checkpointInterval`` records
        its version in ``checkpoints_due`` instead of writing the checkpoint while held.

        delta-rs writes it, for either engine (far cheaper than Spark's checkpoint job). Then,
        as Delta does after a checkpoint, it deletes the log's commit files older than the
        table's ``delta.logRetentionDuration`` (unless ``delta.enableExpiredLogCleanup`` is
        false).
        """
        target = delta_table(path, version)
        target.create_checkpoint()
        if target.metadata().configuration.get(PROP_EXPIRED_LOG_CLEANUP, "true") != "false":
            target.cleanup_metadata()

    def _note_checkpoint(self, path: Location, version: int | None) -> None:
        """After a group's commit, while held: record a checkpoint due if the commit's
        ``version`` (None: read from the log) reached the table's interval (written after the
        table is released, see ``checkpoint``). A known version spares reading the table's
        state again; the interval is the table's, as of the commit's read."""
        target = self.log.opened(path)
        if target is None or version is None:
            target = self.log.latest(path)
            version = int(target.version())
        configured = target.metadata().configuration.get(PROP_CHECKPOINT_INTERVAL)
        if version > 0 and version % (int(configured or 0) or CHECKPOINT_INTERVAL) == 0:
            self.checkpoints_due[path] = version

    def write(self, group: GroupWrite) -> None:
        """Blocking, with the table held: apply ``group`` to the existing table in one commit
        whose ``userMetadata`` is ``group.metadata``."""
        raise NotImplementedError

    def merges_on_read(self, settings: TableSettings) -> bool:
        """Whether this engine applies groups to a table with ``settings`` by merge-on-read
        (:mod:`.merge_on_read`): the committer then writes a group's new files before it holds
        the table, and passes them in :attr:`.GroupWrite.written`."""
        return False

    def live_files(self, path: Location) -> tuple[Any, int] | None:
        """Blocking, with the table held: its live files and the version they are of
        (:meth:`.LogReader.live_files`)."""
        return self.log.live_files(path)

    def _merge_on_read(
        self,
        group: GroupWrite,
        target: Any,
        planned: int | None = None,
        *,
        column: str | None = None,
    ) -> MergeOnRead:
        """Blocking, with the table held: write the files and deletion vectors that apply
        ``group`` (keyed on one column) by merge-on-read to ``target`` (delta-rs, for the
        table's metadata) at the version the commit is planned on (``planned``, None:
        ``target``'s), by the key column ``column`` (None: the group's only key column); the
        engine commits :meth:`.MergeOnRead.actions`, then calls :meth:`_landed`.
        ``group.footprint`` None: no live file can hold one of its keys.

        Raises:
            RewriteUnsupported: the footprint does not list the live files that may hold the
                group's keys (a key without ranges, or statistics delta-rs cannot read).
        """
        footprint = group.footprint
        if footprint is not None and footprint.files is None:
            raise RewriteUnsupported("no live files listed for the group's keys")
        memory = self._key_columns.setdefault(group.path, KeyColumns(self.key_memory_bytes))
        if footprint is None:
            candidates, vectors = None, {}
        else:
            candidates = footprint.files
            version = int(target.version()) if planned is None else planned
            vectors = vectors_at(footprint, version, group.table, self.node_id)
        return write_merge_on_read(
            target,
            group.path,
            group.data,
            column or group.key[0],
            candidates,
            vectors,
            memory,
            group.written,
            group.sequence,
            group.rule,
        )

    def _landed(self, path: Location, done: MergeOnRead) -> None:
        """A merge-on-read commit landed: forget the key columns of the files it removed."""
        memory = self._key_columns.get(path)
        if memory is not None:
            memory.forget(done.removed)

    def committer(self, table: str) -> TableCommitter:
        """The committer of ``table`` on this node (made on first use): it commits the groups
        writers prepared (:mod:`.commit.committer`)."""
        committer = self._committers.get(table)
        if committer is None:
            committer = self._committers[table] = TableCommitter(self, table)
        return committer

    def tables(self, limit: int = _MAX_LISTED_TABLES) -> dict[str, dict[str, Any]]:
        """The tables this node writes or commits, the first ``limit`` by name: for each, the
        last version it committed for writers (None: it commits none of them)."""
        names = sorted({*self._owners, *self._committers})[:limit]
        return {
            name: {
                "committed_version": (
                    self._committers[name].version if name in self._committers else None
                )
            }
            for name in names
        }

    async def existing_committer(self, table: str) -> TableCommitter | None:
        """:meth:`committer`, for a table that exists (None for one that does not): a
        peer's commit call cannot make this node keep a committer for any name it sends."""
        if table not in self._committers and not await self.in_thread(
            is_table, self.warehouse / table
        ):
            return None
        return self.committer(table)

    def write_group_files(self, group: GroupWrite, target: Any) -> MergeOnRead | Rewrite:
        """Blocking: write the data files (and deletion vectors) that apply ``group`` to the
        table ``target`` (delta-rs, at the version the commit will follow), nothing committed:
        by merge-on-read on a table with deletion vectors, else by copy-on-write by key range
        (or appended, for a group no live file can hold a key of).

        Raises:
            RewriteUnsupported: the group needs a MERGE (nothing was written).
        """
        key, footprint = group.key, group.footprint
        if footprint is None:  # appended: the key only orders the new files
            column, candidates = (key[0] if len(key) == 1 else None), None
        elif footprint.column is None or footprint.files is None:
            raise RewriteUnsupported("no key range to rewrite by")
        else:
            column, candidates = footprint.column, footprint.files
        merge_on_read = group.written is not None or candidates is not None
        if merge_on_read and column is not None and has_deletion_vectors(target):
            return self._merge_on_read(group, target, group.read_version, column=column)
        return write_files(
            target,
            group.path,
            group.data,
            column,
            candidates,
            group.sequence,
            group.rule,
            None if footprint is None else footprint.levels,
        )

    def commit_actions(
        self, table: str, path: Location, version: int, actions: list[dict[str, Any]], metadata: str
    ) -> int:
        """Blocking, with the table held: commit ``actions`` (data files written by
        :meth:`write_group_files`, this node's or other writers') as version ``version + 1``
        with the ``userMetadata`` ``metadata``; the version committed. Written as the log
        entry itself (the engine's transaction adds nothing these actions need).

        Raises:
            CommitConflictError: another writer committed version ``version + 1`` first.
        """
        info = commit_info(version, actions, metadata, f"deltaflow {self.name}")
        commit_log_entry(path, version + 1, [{"commitInfo": info}, *actions])
        return version + 1

    def statistics(self) -> EngineStatistics:
        """A snapshot of the counters, with each table's batches in flight."""
        snapshot = self.stats.snapshot()
        for name, owner in self._owners.items():
            snapshot.table(name).in_flight_batches += owner.in_flight()
        return snapshot

    def landed(self, path: Location, done: MergeOnRead | Rewrite) -> None:
        """Files written by :meth:`write_group_files` were committed."""
        self.stats.changes_superseded += done.superseded
        if isinstance(done, MergeOnRead):
            self._landed(path, done)

    async def stop(self) -> None:
        # The writers first: one told "the committer stopped" would prepare its group again
        # and make a committer that nothing stops.
        for owner in self._owners.values():
            owner.task.cancel()
        for owner in self._owners.values():
            with contextlib.suppress(asyncio.CancelledError):
                await owner.task
            await owner.checkpoints.wait()  # finishes on its thread
            owner.fail_queued("node stopped before commit")
        for committer in self._committers.values():
            await committer.stop()
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)

    def forget_lanes(self, tables: Iterable[str], lanes: Sequence[str]) -> None:
        """Drop the marks of ``lanes`` in ``tables`` (:meth:`.TableWriter.forget_lanes`)."""
        for table in tables:
            store = self.mark_stores.get(self.warehouse / table)
            if store is not None:
                store.forget(lanes)

    def release(self) -> None:
        """Some ``held`` writes may have become committable (their receiver returned)."""
        for owner in self._owners.values():
            if owner.queue:
                owner.queue.ready.set()
                owner.queue.wake_if_whole()

    def _check_room(self, table: str) -> None:
        """Refuse a table beyond ``max_tables`` (each keeps its owner until the node stops)."""
        if len(self._owners) >= self.max_tables:
            raise OverloadedError(
                f"node {self.node_id} writes {len(self._owners)} tables, its max_tables: table "
                f"{table!r} is refused, the others are written as before. Raise max_tables "
                "(--max-tables, DELTAFLOW_MAX_TABLES or the config file's max_tables) if the "
                "node has the memory (about 70 KB a table), or write fewer tables (a node "
                "forgets the tables it wrote when it restarts)",
                node=self.node_id,
                retriable=False,
            )

    async def read(
        self, table: str, *, columns: Sequence[str] | None = None, where: str | None = None
    ) -> Any:
        """The table's live rows as a pyarrow Table (:func:`.maintenance.read_rows`), read on
        the engine's threads."""
        from .maintenance import read_rows

        return await self.in_thread(
            functools.partial(read_rows, self.warehouse, table, columns=columns, where=where)
        )

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking engine call on the engine's worker threads."""
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
        sequence: Sequence[str] | None = None,
    ) -> asyncio.Future[None]:
        """Validate ``rows`` and queue them for ``table``'s next commit.

        Args:
            key: merge key columns; empty to append (rows are inserted as they are).
            deletes: indexes of rows that delete their key (merge tables only).
            abandoned: checked right before the commit; true drops the write.
            mark: ``(lane, (seq, k))``: the write is skipped if the table already holds it.
            held: true while the write must not be committed yet (its receiver still runs);
                call :meth:`release` when it turns false.
            sequence: the sequence columns the write names (``sequence_by``): the table's
                must be the same, and a table created by this write gets them. None: the
                table's, whatever they are.

        Returns a future that resolves when the commit holding the rows is durable (or fails
        with the commit's error). Waits while the table's queue is full.

        Raises:
            SchemaError: a row does not fit (the batch is not staged at all).
            OverloadedError: ``table`` is one more than ``max_tables`` (not retriable).
        """
        if not key and deletes:
            raise SchemaError(
                f"table {table!r} is written by appends; deletes need a key", node=self.node_id
            )
        owner = self._owners.get(table)
        if owner is None:
            self._check_room(table)
            owner = self._owners[table] = TableOwner(self, table)
        with owner.queue.arriving():
            await owner.load()
            for attempt in (1, 2):
                settings = owner.plan(key, sequence)
                try:
                    converted = await asyncio.to_thread(
                        to_arrow_rows,
                        rows,
                        deletes,
                        key,
                        owner.schema,
                        table=table,
                        node=self.node_id,
                        evolve=settings.schema_evolution,
                        buckets=settings.buckets,
                        sequence=settings.sequence_by,
                    )
                    break
                except SchemaError as exc:
                    # Checked against what this node last read of the table: if the table changed
                    # since (a column added, evolution allowed), check once more against it.
                    if attempt == 2 or "column" not in exc.details:
                        raise
                    if not await self.in_thread(owner.describe_if_newer):
                        raise
        constraints = owner.constraints
        if constraints and settings.merge == "last" and settings.history == "none":
            # Named here, a row breaking a CHECK constraint fails its batch alone (a partial
            # or folded row is only whole in the commit, which enforces them all).
            await asyncio.to_thread(
                check_constraints, converted, constraints, table=table, node=self.node_id
            )
        await owner.queue.wait_for_room()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        owner.put(Staged(converted, fut, abandoned, mark, settings.buckets, held))
        return fut
