"""The table engine seam: validate rows, group batches per table, one commit per group.

A Delta MERGE has a fixed cost (one to two seconds with Spark), so no engine commits batch by
batch. Each table has a committer task: while one commit runs, newly staged batches queue up,
and the next commit takes all of them (up to ``max_group_rows``). Under load commits grow and
amortise the fixed cost; under light load a lone batch commits at once.

Within a group, several writes of one key collapse to the last in staging order (deletes
included), which is the order the node's lanes staged them: per (stream, partition) sequence
order. The result equals applying the batches one by one.

Rows are validated and converted to Arrow when staged, so a bad row fails only its own batch
(with the item and column named) and never poisons a group. Every commit holds the table's
cross-process lock (:mod:`.lock`) and records the group's lane marks (:mod:`.marks`).

Engines (subclasses of :class:`TableEngine`): Spark (:mod:`.spark_engine`, the default) and
delta-rs (:mod:`.deltars_engine`), selectable per node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

from .._faults import fault_point
from ..errors import CommitConflictError, LaneFailedError, SchemaError, ServerError
from .lock import table_lock
from .marks import LaneMarks, Mark

__all__ = [
    "DEFAULT_MAX_GROUP_ROWS",
    "DEFAULT_MAX_QUEUED_ROWS",
    "DELETE_COLUMN",
    "EngineStatistics",
    "TableEngine",
    "to_arrow_rows",
]

log = logging.getLogger(__name__)

DELETE_COLUMN: Final = "__deltaflow_delete"
DEFAULT_MAX_GROUP_ROWS: Final = 500_000
DEFAULT_MAX_QUEUED_ROWS: Final = 1_000_000
_COMMIT_ATTEMPTS: Final = 5


@dataclass(slots=True)
class EngineStatistics:
    """Counters of a node's table engine (typed snapshot, see ``Node.statistics()``)."""

    commits: int = 0
    rows_committed: int = 0
    batches_committed: int = 0
    batches_failed: int = 0
    batches_deduplicated: int = 0
    largest_group_rows: int = 0
    commit_seconds: float = 0.0
    queued_rows: int = 0


@dataclass(slots=True)
class _Staged:
    table: Any  # pyarrow.Table incl. DELETE_COLUMN
    future: asyncio.Future[None]
    abandoned: Callable[[], bool] | None
    mark: tuple[str, Mark] | None = None  # (lane, mark) for exactly-once; None: always apply

    @property
    def rows(self) -> int:
        return int(self.table.num_rows)


class _TableCommitter:
    """Owns one table on this node: its schema, key, staging queue and commit task."""

    def __init__(self, engine: TableEngine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.path = engine.warehouse / name
        self.key: list[str] | None = None
        self.arrow_schema: Any = None  # None until the table exists
        self.queue: deque[_Staged] = deque()
        self.queued_rows = 0
        self.ready = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()
        self.loaded = False
        self.marks = LaneMarks(self.path)
        self.session: Any = None
        self.task = asyncio.create_task(self._run(), name=f"deltaflow-commit-{name}")

    async def load(self) -> None:
        if not self.loaded:
            self.arrow_schema = await self.engine._in_thread(self._read_schema)
            self.loaded = True

    def _read_schema(self) -> Any:
        if not (self.path / "_delta_log").is_dir():
            return None
        return self.engine.read_schema(self.name, self.path)

    async def _run(self) -> None:
        while True:
            await self.ready.wait()
            group: list[_Staged] = []
            rows = 0
            while self.queue and (
                not group or rows + self.queue[0].rows <= self.engine.max_group_rows
            ):
                staged = self.queue.popleft()
                rows += staged.rows
                group.append(staged)
            self.queued_rows -= rows
            self.engine.stats.queued_rows -= rows
            if not self.queue:
                self.ready.clear()
            if self.queued_rows < self.engine.max_queued_rows:
                self.room.set()
            await self._commit_group(group)

    async def _commit_group(self, group: list[_Staged]) -> None:
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
            await self._commit_with_retries(group)
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
        for staged in group:
            _settle(staged.future, None)

    async def _commit_with_retries(self, group: list[_Staged]) -> None:
        for attempt in range(1, _COMMIT_ATTEMPTS + 1):
            try:
                started = time.monotonic()
                rows = await self.engine._in_thread(self._commit, group)
            except CommitConflictError:
                if attempt == _COMMIT_ATTEMPTS:
                    raise
                await asyncio.sleep(0.05 * 2**attempt)
                continue
            stats = self.engine.stats
            stats.commits += 1
            stats.rows_committed += rows
            stats.batches_committed += len(group)
            stats.largest_group_rows = max(stats.largest_group_rows, rows)
            stats.commit_seconds += time.monotonic() - started
            return

    def _commit(self, group: list[_Staged]) -> int:
        """Blocking: under the table lock, drop writes the table already holds, then stage the
        rest as Parquet and create the table, MERGE into it, or append to it, in one commit
        that also records the group's lane marks."""
        with table_lock(self.engine.warehouse, self.name):
            self.marks.refresh()
            todo = [s for s in group if s.mark is None or not self.marks.applied(*s.mark)]
            self.engine.stats.batches_deduplicated += len(group) - len(todo)
            if not todo:
                return 0
            lanes = LaneMarks.highest(s.mark for s in todo if s.mark is not None)
            rows = self._commit_rows(todo, LaneMarks.user_metadata(self.engine.node_id, lanes))
            self.marks.absorb(lanes)
        fault_point("after_commit")
        if self.arrow_schema is None:
            self.arrow_schema = self._read_schema()
        return rows

    def _commit_rows(self, group: list[_Staged], metadata: str) -> int:
        import pyarrow as pa

        table = pa.concat_tables([s.table for s in group], promote_options="permissive")
        if self.key:
            table = _last_per_key(table, self.key)
        exists = (self.path / "_delta_log").is_dir()
        if not exists and all(table.column(DELETE_COLUMN).to_pylist()):
            return 0  # only deletes, and no table: nothing exists to delete
        self.engine.write(self.name, self.path, self.key or [], table, exists, metadata)
        if not exists:
            self.arrow_schema = None  # reloaded as the engine stored it
        return int(table.num_rows)


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _last_per_key(table: Any, key: Sequence[str]) -> Any:
    """Rows of ``table`` keeping only the last occurrence of each key (order preserved)."""
    columns = [table.column(k).to_pylist() for k in key]
    keys = columns[0] if len(columns) == 1 else list(zip(*columns, strict=True))
    seen: set[Any] = set()
    keep: list[int] = []
    for i in range(len(keys) - 1, -1, -1):
        k = keys[i]
        if k not in seen:
            seen.add(k)
            keep.append(i)
    if len(keep) == len(keys):
        return table
    keep.reverse()
    return table.take(keep)


def to_arrow_rows(
    rows: Sequence[Any],
    deletes: frozenset[int],
    key: Sequence[str],
    schema: Any,
    *,
    table: str,
    node: str,
) -> Any:
    """Validate rows and build an Arrow table (with the delete flag column).

    Args:
        schema: the table's Arrow schema, or None when the table does not exist yet (the
            schema is then inferred from these rows).

    Raises:
        SchemaError: naming the first bad item (its index in the batch) and column.
    """
    import pyarrow as pa

    columns = set(schema.names) if schema is not None else None
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
        if columns is not None and i not in deletes:
            unknown = [c for c in row if c not in columns]
            if unknown:
                raise SchemaError(
                    f"item #{i} of the batch has column(s) {unknown} that table {table!r} does "
                    f"not have (columns: {sorted(columns)})",
                    node=node,
                    details={"item": i, "column": unknown[0]},
                )
    try:
        if schema is None:
            # Infer per column over every row (from_pylist would take the first row's keys).
            names = list(dict.fromkeys(c for row in rows for c in row))
            data = pa.Table.from_pydict({c: [row.get(c) for row in rows] for c in names})
        else:
            data = pa.Table.from_pylist(list(rows), schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        raise _locate_bad_row(rows, schema, table, node, exc) from exc
    if schema is None:
        missing = [k for k in key if k not in data.column_names]
        if missing:
            raise SchemaError(f"rows for table {table!r} lack key column(s) {missing}", node=node)
        for field in data.schema:
            if pa.types.is_null(field.type):
                raise SchemaError(
                    f"column {field.name!r} is null in every row of the first write to table "
                    f"{table!r}, so its type cannot be inferred; send a non-null value in the "
                    "first batch",
                    node=node,
                    details={"column": field.name},
                )
    flags = pa.array([i in deletes for i in range(len(rows))], type=pa.bool_())
    return data.append_column(DELETE_COLUMN, flags)


def _locate_bad_row(
    rows: Sequence[Any], schema: Any, table: str, node: str, exc: Exception
) -> SchemaError:
    import pyarrow as pa

    if schema is not None:
        for i, row in enumerate(rows):
            for field in schema:
                if field.name not in row:
                    continue
                try:
                    pa.array([row[field.name]], type=field.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
                    return SchemaError(
                        f"item #{i} of the batch: column {field.name!r} of table {table!r} is "
                        f"{field.type}, got {type(row[field.name]).__name__} "
                        f"{row[field.name]!r:.80}",
                        node=node,
                        details={"item": i, "column": field.name},
                    )
    return SchemaError(f"rows do not fit table {table!r}: {exc}", node=node)


class TableEngine:
    """Applies staged rows to Delta tables under ``warehouse``; the seam between the node and a
    Delta implementation (Spark: :class:`~.spark_engine.SparkTableEngine`; delta-rs:
    :class:`~.deltars_engine.DeltaRsTableEngine`).

    The base class owns everything that must not differ between engines: validation, group
    commit, the per-table commit lock, lane marks (exactly-once) and statistics. A subclass
    supplies three blocking methods run in worker threads: :meth:`_start_engine`,
    :meth:`read_schema` and :meth:`write`.

    Args:
        warehouse: directory holding one Delta table per sub-directory.
        node_id: for error messages and logs.
        max_group_rows: rows per commit at most. Default 500,000.
        max_queued_rows: rows staged per table and not yet committed; staging waits beyond it
            (backpressure reaches the client through the unacknowledged window). Default
            1,000,000.
        threads: worker threads for engine calls (the event loop never blocks on them).
    """

    #: The name nodes select the engine by (``--engine``).
    name: ClassVar[str] = ""

    def __init__(
        self,
        warehouse: Path,
        *,
        node_id: str,
        max_group_rows: int = DEFAULT_MAX_GROUP_ROWS,
        max_queued_rows: int = DEFAULT_MAX_QUEUED_ROWS,
        threads: int = 2,
    ) -> None:
        self.warehouse = Path(warehouse)
        self.node_id = node_id
        self.max_group_rows = max_group_rows
        self.max_queued_rows = max_queued_rows
        self.stats = EngineStatistics()
        self.staging_dir = self.warehouse / ".deltaflow" / "staging" / node_id
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=f"deltaflow-{self.name}")
        self._tables: dict[str, _TableCommitter] = {}

    async def start(self) -> None:
        """Prepare the warehouse and the engine (Spark takes seconds on first use)."""
        self.warehouse.mkdir(parents=True, exist_ok=True)
        # Leftovers of this node's earlier run (other nodes may share the warehouse).
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        await self._in_thread(self._start_engine)

    def _start_engine(self) -> None:
        """Blocking: start the engine."""

    def read_schema(self, table: str, path: Path) -> Any:
        """Blocking: the Arrow schema of the existing table at ``path``."""
        raise NotImplementedError

    def write(
        self, table: str, path: Path, key: list[str], data: Any, exists: bool, metadata: str
    ) -> None:
        """Blocking, under the table's lock: apply ``data`` in one commit.

        Args:
            key: merge key columns, or empty to append.
            data: a pyarrow Table with the ``DELETE_COLUMN`` flag, at most one row per key.
            exists: whether the table exists (else create it from the non-deleted rows).
            metadata: the commit's ``userMetadata`` (lane marks): it must land in the same
                commit as the data.
        """
        raise NotImplementedError

    async def stop(self) -> None:
        for committer in self._tables.values():
            committer.task.cancel()
        for committer in self._tables.values():
            with contextlib.suppress(asyncio.CancelledError):
                await committer.task
            for staged in committer.queue:
                _settle(staged.future, ServerError("node stopped before commit", node=self.node_id))
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)

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
    ) -> asyncio.Future[None]:
        """Validate ``rows`` and queue them for ``table``'s next commit.

        Args:
            key: merge key columns; empty to append (rows are inserted as they are).
            deletes: indexes of rows that delete their key (merge tables only).
            abandoned: checked right before the commit; true drops the write.
            mark: ``(lane, (seq, k))``: the write is skipped if the table already holds it.

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
        await committer.load()
        if committer.key is None:
            committer.key = list(key)
        elif committer.key != list(key):
            how = f"merged on key {committer.key}" if committer.key else "appended to"
            raise SchemaError(
                f"table {table!r} is {how} on this node; this write "
                f"{'appends' if not key else f'merges on {list(key)}'}",
                node=self.node_id,
            )
        converted = await asyncio.to_thread(
            to_arrow_rows,
            rows,
            deletes,
            key,
            committer.arrow_schema,
            table=table,
            node=self.node_id,
        )
        while committer.queued_rows >= self.max_queued_rows:
            committer.room.clear()
            await committer.room.wait()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        committer.queue.append(_Staged(converted, fut, abandoned, mark))
        committer.queued_rows += converted.num_rows
        self.stats.queued_rows += converted.num_rows
        committer.ready.set()
        return fut
