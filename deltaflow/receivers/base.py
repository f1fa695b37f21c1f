"""The receiver base class and the context a receiver runs in."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from ..columnar import ArrowRows
from ..errors import ReceiverError, SchemaError, TableSettingsError
from ..names import table_name_problem
from ..protocol import MAX_ORDINAL, RANDOM_LANE_PREFIX

__all__ = [
    "Receiver",
    "ReceiverContext",
    "SideInputReader",
    "TableHandle",
    "TableWriter",
    "check_table_name",
]


def check_table_name(name: Any) -> str:
    """A table name is a plain identifier (:mod:`deltaflow.names`): it becomes a directory
    under the warehouse."""
    problem = table_name_problem(name)
    if problem is not None:
        raise SchemaError(problem)
    return str(name)


class SideInputReader(Protocol):
    """What the node's side-input store offers receivers (see ``server.side_inputs``)."""

    def get(self, name: str, parse: Callable[[bytes], Any] | None = None) -> Any:
        """The current value of side input ``name``, parsed by ``parse`` (cached per version)."""
        ...


def lane_name(stream_id: str, owner: str | None, partition: int, random: bool) -> str:
    """The lane of a stream's partition in a table's marks: named by the stream's owner too, so
    a batch under another key can never mark, skip or be skipped as one of the owner's; a
    random id's lanes are marked as such (their marks expire sooner, ``tables.marks``)."""
    owned = f"{owner}/" if owner else ""
    return f"{RANDOM_LANE_PREFIX if random else ''}{stream_id}/{owned}{partition}"


class TableWriter(Protocol):
    """What the node's table engine offers receivers (see ``tables.engine``)."""

    async def stage(
        self,
        table: str,
        key: Sequence[str],
        rows: Sequence[Any],
        deletes: frozenset[int],
        *,
        abandoned: Any,
        mark: tuple[str, tuple[int, int]] | None = None,
        held: Callable[[], bool] | None = None,
        sequence: Sequence[str] | None = None,
    ) -> asyncio.Future[None]:
        """Validate and queue rows for the table's next commit (not before ``held()`` turns
        false); the future resolves when the commit holding them is durable."""
        ...

    def release(self) -> None:
        """Writes whose ``held()`` turned false may now be committed."""
        ...

    def forget_lanes(self, tables: Iterable[str], lanes: Sequence[str]) -> None:
        """The marks of ``lanes`` in ``tables`` are needed no more (a stream its client
        closed, whose id it made up: nothing can resend its batches)."""
        ...

    @property
    def warehouse(self) -> Any:
        """Where the node's tables are (a path, or a place on an object store)."""
        ...

    async def read(
        self, table: str, *, columns: Sequence[str] | None = None, where: str | None = None
    ) -> Any:
        """The table's live rows (a pyarrow Table), see :meth:`ReceiverContext.read_table`."""
        ...


@dataclass(slots=True, kw_only=True)
class ReceiverContext:
    """Everything a receiver may know or use while applying one batch.

    Attributes:
        stream_id: id of the client's stream, as the client named it (public: any client may
            open a stream of that id under a key of its own).
        stream_owner: who opened the stream: 32 hex digits of a hash of its secret key. The
            stream is ``(stream_id, stream_owner)``: key effects outside the node's tables by
            ``(stream_id, stream_owner, partition, seq)``, or another client's stream of the
            same id could pass for this one.
        random_id: the client made the stream's id up (no ``stream_id=``): only that client
            can resend its batches.
        partition: the partition this batch belongs to (all its items hash there).
        seq: the batch's sequence number within (stream, partition).
        node_id: the node applying the batch.
        args: the ``receiver_args`` the client passed (a msgpack value).
        deletes: indexes of items the client marked as deletes (:class:`deltaflow.Delete`).
        attempt: the delivery attempt of this batch, from 1: higher when the client resent it
            (after a lost ack, a reconnect, a retriable error or a failover) or when the node
            retried an idempotent receiver (see :attr:`Receiver.idempotent`).
    """

    stream_id: str
    partition: int
    seq: int
    node_id: str
    args: Any
    deletes: frozenset[int] = frozenset()
    attempt: int = 1
    stream_owner: str = ""
    random_id: bool = False
    _failed: dict[int, str] = field(default_factory=dict)
    _size: int = 0
    _writer: TableWriter | None = None
    _side_inputs: SideInputReader | None = None
    _durable: list[asyncio.Future[None]] = field(default_factory=list)
    _abandoned: Any = None
    _running: bool = True  # false once receive() returned or raised
    _writes: dict[str, int] = field(default_factory=dict)

    def _next_mark(self, table: str) -> tuple[str, tuple[int, int]]:
        """The lane mark of this batch's next write to ``table`` (see tables.marks). The lane
        is named by the stream's owner too, so a batch under another key can never mark,
        skip or be skipped as one of the owner's, also after a node restart."""
        k = self._writes.get(table, 0)
        if k >= MAX_ORDINAL:
            raise ReceiverError(
                f"batch {self.seq} of stream {self.stream_id!r} wrote table {table!r} "
                f"{MAX_ORDINAL:,} times: a batch may write one table at most that often "
                "(write a batch's rows in one call)",
                node=self.node_id,
            )
        self._writes[table] = k + 1
        lane = lane_name(self.stream_id, self.stream_owner, self.partition, self.random_id)
        return lane, (self.seq, k)

    def side_input(self, name: str, *, parse: Callable[[bytes], Any] | None = None) -> Any:
        """The current value of the side input ``name`` (see ``docs/side-inputs.md``).

        Without ``parse`` the raw bytes are returned; with it, ``parse(bytes)`` is computed once
        per version and cached, so calling this for every item is cheap. The value never changes
        under a running call: read it once per batch for a consistent view.

        Raises:
            SideInputError: the node has no side input of that name.
        """
        if self._side_inputs is None:
            from ..errors import SideInputError

            raise SideInputError(f"node {self.node_id} has no side inputs configured")
        return self._side_inputs.get(name, parse)

    def _is_running(self) -> bool:
        return self._running

    @property
    def redelivered(self) -> bool:
        """Whether this batch may have been seen before (``attempt > 1``): key effects outside
        the node's tables by ``(stream_id, stream_owner, partition, seq)`` or skip them."""
        return self.attempt > 1

    def fail(self, index: int, reason: str | BaseException) -> None:
        """Mark item ``index`` of the batch failed without failing the batch.

        The rest of the batch is applied and acknowledged; the client reports the marked items
        with ``reason`` under its ``on_failure`` policy (``"fail"`` stops the stream with them
        among ``failed_items``, ``"fallback"`` writes them to the dead-letter table, ``"drop"``
        counts them). Do not write a failed item to a table: marking does not undo a write.

        Raises:
            IndexError: ``index`` is not an index of the batch.
        """
        if not isinstance(index, int) or not 0 <= index < self._size:
            raise IndexError(f"item index {index!r} is outside the batch of {self._size} items")
        text = f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else reason
        self._failed[index] = str(text)[:2000]

    def is_delete(self, index: int) -> bool:
        return index in self.deletes

    @property
    def warehouse(self) -> str:
        """The node's warehouse: a directory, or a URI such as ``s3://bucket/prefix``."""
        if self._writer is None:
            raise RuntimeError("this node has no table engine")
        return str(self._writer.warehouse)

    async def read_table(
        self, name: str, *, columns: Sequence[str] | None = None, where: str | None = None
    ) -> Any:
        """The live rows of table ``name`` in the node's warehouse, as a ``pyarrow.Table``:
        ``columns`` (default all but deltaflow's own), the rows matching the SQL condition
        ``where`` (``"region = 'eu'"``). Read through delta-rs's query engine on the engine's
        threads, deletion vectors applied, as of the table's latest version: a lookup table
        written by other streams, say. Rows this batch wrote are not in it before their
        commit.

        Raises:
            UsageError: there is no such table, or no such column.
        """
        if self._writer is None:
            raise RuntimeError("this node has no table engine")
        return await self._writer.read(check_table_name(name), columns=columns, where=where)

    def table(
        self,
        name: str,
        *,
        key: str | Sequence[str] = (),
        sequence_by: str | Sequence[str] | None = None,
    ) -> TableHandle:
        """Access a Delta table in the node's warehouse, merging on ``key`` (or, without a
        key, appending). ``sequence_by``: the columns that order the changes to a key (see
        ``docs/cdc.md``); the table's must be the same, and a table this write creates gets
        them. None: whatever the table has."""
        if self._writer is None:
            raise RuntimeError("this node has no table engine")
        keys = [key] if isinstance(key, str) else list(key)
        sequence = [sequence_by] if isinstance(sequence_by, str) else sequence_by
        return TableHandle(
            self, check_table_name(name), keys, None if sequence is None else tuple(sequence)
        )


@dataclass(frozen=True, slots=True)
class TableHandle:
    """Writes into one table; every write joins the node's next group commit for that table.

    A write returns once the rows are validated and queued; the batch is acknowledged to the
    client only after the commit holding them is durable, so a receiver need not wait for it.
    The rows join a group commit only once ``receive`` returned: if it raises instead, they
    are dropped, so a failed batch leaves nothing in any table.

    Every write is applied exactly once, even when its batch is delivered again after a lost
    ack, a crash between commit and ack, or a failover: the commit records the write's lane
    mark and a write the table already holds is skipped.
    """

    ctx: ReceiverContext
    name: str
    key: list[str]
    sequence_by: tuple[str, ...] | None = None

    async def upsert(
        self,
        rows: Sequence[Any],
        *,
        deletes: Iterable[int] = (),
        bad_rows: Callable[[int, str], None] | None = None,
    ) -> None:
        """Upsert ``rows`` (dicts) by key; rows at the indexes in ``deletes`` delete their key.

        Args:
            bad_rows: called with the index (in ``rows``) and the reason of each row that does
                not fit the table, which is then left out and the rest written (the built-in
                table receiver passes ``ctx.fail`` under ``on_bad_row="quarantine"``). None:
                a row that does not fit fails the write.

        Raises:
            SchemaError: a row does not fit the table (names the row and the column).
        """
        if not self.key:
            raise SchemaError(f"table {self.name!r} was opened without a key: use append()")
        await self._stage(rows, frozenset(deletes), bad_rows)

    async def append(
        self, rows: Sequence[Any], *, bad_rows: Callable[[int, str], None] | None = None
    ) -> None:
        """Insert ``rows`` as they are (no key, no merge); for tables opened without ``key``.
        ``bad_rows``: as for :meth:`upsert`."""
        if self.key:
            raise SchemaError(f"table {self.name!r} was opened with key {self.key}: use upsert()")
        await self._stage(rows, frozenset(), bad_rows)

    async def _stage(
        self,
        rows: Sequence[Any],
        deletes: frozenset[int],
        bad_rows: Callable[[int, str], None] | None = None,
    ) -> None:
        writer = self.ctx._writer
        assert writer is not None
        mark = self.ctx._next_mark(self.name)  # one per write, whatever rows it keeps
        left = list(range(len(rows)))  # where each row still in ``rows`` came from
        while True:
            try:
                fut = await writer.stage(
                    self.name,
                    self.key,
                    rows,
                    deletes,
                    abandoned=self.ctx._abandoned,
                    mark=mark,
                    held=self.ctx._is_running,
                    sequence=self.sequence_by,
                )
                break
            except SchemaError as exc:
                item = exc.details.get("item")
                if (
                    bad_rows is None
                    or isinstance(exc, TableSettingsError)
                    or not isinstance(item, int)
                    or not 0 <= item < len(rows)
                ):
                    raise
                # That row alone is bad: reported, left out, the rest checked again.
                reason = str(exc.args[0]).replace(f"item #{item} ", f"item #{left[item]} ", 1)
                bad_rows(left[item], reason)
                keep = [j for j in range(len(rows)) if j != item]
                deletes = frozenset(n for n, j in enumerate(keep) if j in deletes)
                rows = rows.take(keep) if isinstance(rows, ArrowRows) else [rows[j] for j in keep]
                left = [left[j] for j in keep]
                if not left:
                    return
        self.ctx._durable.append(fut)

    async def delete(self, rows: Sequence[Any]) -> None:
        """Delete the keys of ``rows`` (each holding at least the key columns)."""
        await self.upsert(rows, deletes=range(len(rows)))


class Receiver:
    """Base class of server-side receivers. Subclass it and register the class on the nodes.

    A node calls :meth:`receive` with each batch of a stream: a list of items (msgpack values
    as the client sent them) and a :class:`ReceiverContext`. The receiver applies them (for
    tables, through ``ctx.table(...)``) and returns per-item results, or yields them from an
    async generator so they stream back to the client while the batch is still running.

    **Allow-list.** A node runs only receivers registered by class name when it starts
    (``deltaflow serve --receiver myapp.receivers.Enrich``). A client names one; it can never
    make a node import anything.

    **Instances.** One instance per stream on each node; keep cross-stream state in class
    attributes only if it is thread- and task-safe.

    **Ordering.** Batches of one (stream, partition) reach ``receive`` one at a time in
    sequence order, so items of one key are seen in the order the client's source produced
    them. Batches of different partitions run concurrently.

    **Retries and idempotency.** A batch may be delivered again: after a lost acknowledgement,
    a reconnect, or a retriable error. Table writes made through ``ctx.table`` are committed
    with the batch and acknowledged only once durable. Effects outside the node's tables (an
    HTTP call, a message) may be repeated on a resend, so make them idempotent or keyed by
    ``(ctx.stream_id, ctx.stream_owner, ctx.partition, ctx.seq)``. Results of a resent batch
    are sent again.

    **Errors.** Raising fails the whole batch: its items are reported to the client as not
    applied and later batches of the same partition are refused. Raise an error whose class
    has ``retriable = True`` (e.g. :class:`deltaflow.errors.OverloadedError`) to have the batch
    retried instead. To reject single items and apply the rest, call ``ctx.fail(index, reason)``.

    **Declarations** (class attributes):

    - ``idempotent`` (default ``False``): running a batch twice has the effect of running it
      once. Only an idempotent receiver is re-run by the node itself when it raises a
      retriable error (up to ``node_retries`` times, with backoff, before the client is told);
      a non-idempotent one is re-run only when the client resends the batch, with
      ``ctx.attempt`` raised, and relies on deltaflow's exactly-once dedup of table writes.
    - ``max_concurrency`` (default ``None``: unbounded): at most this many ``receive`` calls of
      the class run at once on a node, across all streams and partitions. A node's
      ``receiver_concurrency`` setting overrides it.

    **Blocking.** ``receive`` runs on the node's event loop: do blocking work with
    ``await asyncio.to_thread(...)``.
    """

    idempotent: ClassVar[bool] = False
    max_concurrency: ClassVar[int | None] = None
    #: Node-side retries of a retriable error, for idempotent receivers only.
    node_retries: ClassVar[int] = 2

    async def receive(
        self, items: Sequence[Any], ctx: ReceiverContext
    ) -> Iterable[Any] | AsyncIterator[Any] | None:
        raise NotImplementedError
