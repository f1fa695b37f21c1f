"""The client facade: ``connect()`` and :class:`Client` (validation and wiring only)."""

from __future__ import annotations

import enum
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ..errors import UsageError
from ..names import table_name_problem
from ..partitioning import PartitionMap
from ..protocol import CALLER_STREAM_ID
from ..security import ClientTls
from .changelog import Changelog, convert_changelog
from .ledger import CommitPosition
from .options import StreamerOptions
from .results import OnResult
from .router import ConnectionFactory, Router
from .stream import StreamRun, run_stream
from .stream_keys import stream_key as make_stream_key
from .stream_types import (
    TABLE_RECEIVER,
    KeyFn,
    StreamStatistics,
    StreamSummary,
    key_function,
    spread,
)

__all__ = ["Client", "ClientState", "ClientStatistics", "ConnectionFactory", "connect"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientStatistics:
    """A snapshot of a client: its view of the cluster and its running streams
    (:meth:`Client.statistics`).

    Attributes:
        state: the client's :class:`ClientState`, by value (``"unopened"``, ``"open"``,
            ``"closed"``).
        map_version: the version of the partition map it holds (None before it has one).
        nodes: the nodes in that map.
        connections: the connections open to them.
        streams: one :class:`~deltaflow.client.StreamStatistics` per running stream.
    """

    state: str
    map_version: int | None
    nodes: int
    connections: int
    streams: list[StreamStatistics]


class ClientState(enum.Enum):
    """Where a client is in its life: ``UNOPENED`` until :meth:`Client.start`, ``OPEN``, then
    ``CLOSED`` for good (a closed client cannot be opened again; connect a new one)."""

    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


class Client:
    """A connection to a deltaflow cluster.

    Create with :func:`connect`. The client learns the partition map from the first node it
    reaches and sends each batch straight to the partition's owner, reconnecting and refreshing
    the map when a node is lost or says it is not the owner. Use it as an async context
    manager (:meth:`start` on entry, :meth:`close` on exit); a closed client is not reused.
    ``repr(client)`` shows its state, the node count, the map version, the open connections
    and the number of running streams.

    Args:
        nodes: as for :func:`connect`.
        token: as for :func:`connect`.
        tls: as for :func:`connect`.
        connection_factory: as for :func:`connect`.
        connect_timeout: seconds; bounds the map fetch, the TCP connect and the wait for the
            node's ``welcome``. Default 10.0 (what :func:`connect` uses).
    """

    def __init__(
        self,
        nodes: Sequence[str],
        *,
        token: str | None = None,
        tls: ssl.SSLContext | ClientTls | None = None,
        connection_factory: ConnectionFactory | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        if isinstance(nodes, str):
            nodes = [nodes]
        bootstrap = [_normalise(a) for a in nodes]
        if not bootstrap:
            raise UsageError("connect() needs at least one node address 'host:port'")
        self._router = Router(
            bootstrap,
            token=token,
            tls=tls,
            connection_factory=connection_factory,
            connect_timeout=connect_timeout,
        )
        self._state = ClientState.UNOPENED
        self._active: dict[str, StreamRun] = {}
        self._token = token  # what a caller-chosen stream id's key is derived from

    def __repr__(self) -> str:
        router = self._router
        return (
            f"<Client {self._state.value} nodes={router.nodes} map_version={router.map_version} "
            f"connections={router.connections} streams={len(self._active)}>"
        )

    @property
    def partition_map(self) -> PartitionMap:
        return self._router.partition_map

    async def start(self) -> None:
        """Reach a node and learn the partition map.

        Raises:
            NodeUnavailableError: none of the given nodes could be reached.
        """
        if self._state is ClientState.CLOSED:
            raise UsageError("this client is closed; create a new one with deltaflow.connect()")
        if self._state is ClientState.OPEN:
            return
        await self._router.start()
        self._state = ClientState.OPEN

    async def close(self) -> None:
        """Close every connection. Streams still running fail with a connection error."""
        self._state = ClientState.CLOSED
        await self._router.close()

    async def __aenter__(self) -> Client:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def stream_data(
        self,
        source: Any,
        *,
        table: str | None = None,
        key: str | Sequence[str] | KeyFn | None = None,
        receiver: str | None = None,
        receiver_args: Any = None,
        on_result: OnResult | None = None,
        on_ack: Callable[[Sequence[Any]], Any] | None = None,
        on_commit: Callable[[CommitPosition], Any] | None = None,
        options: StreamerOptions | None = None,
        stream_id: str | None = None,
        stream_key: str | bytes | None = None,
        sequence_by: str | Sequence[str] | None = None,
        changelog: str | Changelog | None = None,
    ) -> StreamSummary:
        """Stream ``source`` to the cluster and wait until every item is applied.

        Args:
            source: an async iterable, an iterable, or a reactivex Observable of items. Wrap an
                item in :class:`~deltaflow.Delete` to delete its key. Or of
                ``pyarrow.RecordBatch`` / ``pyarrow.Table`` objects, each of whose rows is an
                item (see "Arrow sources" below). Or one table: a ``pyarrow.Table``, a pandas
                or a polars ``DataFrame`` (converted to Arrow in a worker thread: zero-copy for
                polars and most numeric pandas columns; a named pandas index becomes a column).
            table: upsert rows (dicts, or Arrow batches) into this Delta table on the nodes,
                merging on ``key``; without ``key``, append them (an append table, created on
                first write), exactly once per stream id as upserts are. Pass exactly one of
                ``table`` and ``receiver``. A table name is letters, digits and ``_`` (at most
                128, not starting with a digit), checked before anything is sent
                (:class:`~deltaflow.errors.UsageError`, with a name that would do). Names are
                case-sensitive (``Orders`` and ``orders`` are two directories) but fold to one
                on case-insensitive file systems (macOS, Windows) and in catalogs that store
                names in lower case (Hive, Glue, Unity): use lower-case names.
            key: the routing key: a column name, a tuple or list of column names, or a callable
                of an item. With ``table=`` it names the key column(s), or is left out to
                append.
            receiver: the class name of a receiver registered on the nodes (instead of
                ``table``).
            receiver_args: any msgpack value, handed to the receiver as ``ctx.args`` with
                every batch.
            on_result: receives each per-item result the receiver produces: a callable, an
                async callable, or a reactivex Observer. Results of a resent batch may repeat.
                If it raises, the stream fails with that error.
            on_ack: called (synchronously, on the event loop) with the items of each batch once
                it is acknowledged as applied: the place to ack an upstream queue or drive a
                progress bar. Keep it quick. Not called for dropped or dead-lettered items, nor
                for items the receiver marked failed (``ctx.fail``). If it raises, the stream
                fails with that error.
            on_commit: called on the event loop with a :class:`CommitPosition` ``(count,
                last)`` whenever the contiguous prefix of settled source items grows: the
                position an upstream that commits cumulatively (Kafka offsets) may safely
                commit. Tracked only when given. If it raises, the stream fails with that
                error (``docs/guarantees.md``, "Upstream acknowledgement").
            options: batching, window and retry settings (:class:`StreamerOptions`). Default:
                ``StreamerOptions()``.
            stream_id: the stream's id, 1 to 128 characters of ``A-Z a-z 0-9 . _ : -``.
                Default None: a random id. A deterministic id makes a replay of the same input
                exactly-once: the nodes skip every table write whose lane mark (stream id,
                partition, batch sequence) a table already holds, so a stream re-run with the
                same id after a crash writes only what the first run did not. The replay must
                cut the same batches: the same items in the same order, the same options, and
                ``auto_flush_interval=0`` and no ``linger`` (batches cut by count and bytes
                only, never by time). This is how ``foreach_batch`` makes a replayed
                micro-batch exactly-once (``docs/spark.md``). Two streams running at the same
                time on a client must not share an id.
            stream_key: the secret that makes the stream yours, with ``stream_id``: a str or
                bytes of at least 16 bytes (e.g. ``secrets.token_hex(16)``), the same for a
                replay. Nodes know a stream by its id and its key: only connections that opened
                it with the key may feed, close or replay it, and its lane marks are its own,
                so a stream of the same id under another key neither skips nor is skipped for
                yours. Default None: a random stream has a random key; a ``stream_id`` without
                ``stream_key`` has one derived from the token, which keeps strangers out but
                not other clients holding the token (``docs/guarantees.md``, "Streams belong
                to whoever opened them").
            sequence_by: with ``table=``, the column(s) that order the changes to a key (a
                log sequence number, a commit time; several are compared in order): a change
                applies only if its sequence is greater than the one the table holds for the
                key, deletes included, whatever order changes arrive in (``docs/cdc.md``).
                Every row, deletes too, carries them. A table this stream creates gets them;
                an existing table must have the same (else :class:`~deltaflow.errors.
                StreamUsageError`). Default None: the table's, if it has any.
            changelog: the source yields change events rather than rows: ``"debezium"``
                (Debezium envelopes: ``c``/``r``/``u`` upsert ``after``, ``d`` deletes the key
                of ``before``; with ``sequence_by``, a sequence missing from the row is taken
                from the event's ``source`` block, else its ``ts_ms``), or a
                :class:`~deltaflow.Changelog` naming the operation column of flat rows and its
                values that delete (``docs/cdc.md``).

        Returns:
            A :class:`StreamSummary` once every item is acknowledged as applied.

        Raises:
            DataStreamerError: some items were not applied; ``failed_items`` lists exactly those.
            UsageError: the arguments are inconsistent.

        Cancelling the call stops pulling the source and abandons batches in flight; items
        already acknowledged stay applied. The ``CancelledError`` raised then carries
        ``applied`` (count), ``not_applied`` (items never sent, or failed) and ``in_doubt``
        (items sent whose acknowledgement had not arrived: they may or may not be applied).

        Arrow sources:
            A source that yields ``pyarrow.RecordBatch`` or ``pyarrow.Table`` objects streams
            their rows without a Python object per row; ``key=`` must name columns. The client
            computes each row's partition from its key columns (the same ``partition_of`` as
            for dicts), sorts the rows by partition once per source batch, and cuts each
            partition's rows into pages of ``page_size`` rows (and at most
            ``max_batch_bytes``, measured as Arrow bytes); a page travels as one Arrow IPC
            stream (``docs/protocol.md``, "batch (client → node)") and the table engine stages
            its columns as they are. A boolean column :data:`deltaflow.DELETE_COLUMN`
            (``"__deltaflow_delete"``), when present, marks the rows that delete their key.

            Everything else is as for row items: positions count rows in source order,
            ``on_ack`` gets a :class:`deltaflow.ArrowRows` (a sequence of row dicts, built on
            access, with the page as ``.table``), ``DataStreamerError.failed_items`` and the
            dead-letter table hold the rows as dicts. A stream carries either row items or
            Arrow batches; a custom ``batch_creator`` applies to row items only. Rows are
            checked as columns on the node: a column the table lacks, or one whose type does
            not convert, fails the page naming the column; a null key names the row.
        """
        if self._state is not ClientState.OPEN:
            raise UsageError("the client is not open; use 'async with deltaflow.connect(...)'")
        if (table is None) == (receiver is None):
            raise UsageError("pass exactly one of table= (built-in upsert) or receiver=")
        if table is not None and (problem := table_name_problem(table)) is not None:
            raise UsageError(problem)
        if stream_id is not None:
            if not isinstance(stream_id, str) or not CALLER_STREAM_ID.fullmatch(stream_id):
                raise UsageError(
                    f"stream_id={stream_id!r} is not allowed; use 1 to 128 characters of "
                    "A-Z a-z 0-9 . _ : -"
                )
            if stream_id in self._active:
                raise UsageError(
                    f"a stream with id {stream_id!r} is already running on this client; "
                    "streams running at the same time need different ids"
                )
        secret = make_stream_key(stream_id, stream_key, token=self._token)
        route = key_function(key) if key is not None or table is None else spread
        if table is not None:
            if key is not None and not isinstance(key, (str, tuple, list)):
                raise UsageError(
                    f"table={table!r} needs key= naming the key column(s), not {key!r}; "
                    "without key= the rows are appended"
                )
            key_columns = [] if key is None else [key] if isinstance(key, str) else list(key)
            receiver = TABLE_RECEIVER
            receiver_args = {"table": table, "key": key_columns}
            if options is not None and options.on_bad_row == "quarantine":
                receiver_args["on_bad_row"] = "quarantine"
            if sequence_by is not None:
                if not key_columns:
                    raise UsageError("sequence_by orders the changes to a key: pass key= too")
                receiver_args["sequence_by"] = _sequence_columns(sequence_by, key_columns)
        elif options is not None and options.on_bad_row != "fail":
            raise UsageError(
                "StreamerOptions(on_bad_row=...) is for table= streams; a receiver rejects an "
                "item alone with ctx.fail(index, reason)"
            )
        elif sequence_by is not None:
            raise UsageError(
                "sequence_by= orders the changes a table= stream writes; a "
                "receiver's table writes name it in ctx.table(..., sequence_by=)"
            )
        assert receiver is not None
        if changelog is not None:
            sequence = receiver_args.get("sequence_by", ()) if table is not None else ()
            source = convert_changelog(source, changelog, sequence)
        return await run_stream(
            self._router,
            self._active,
            source,
            receiver=receiver,
            receiver_args=receiver_args,
            key=route,
            key_columns=_key_columns(key),
            on_result=on_result,
            on_ack=on_ack,
            on_commit=on_commit,
            options=options or StreamerOptions(),
            stream_id=stream_id,
            stream_key=secret,
        )

    def statistics(self) -> ClientStatistics:
        """A snapshot of the client and of every stream running on it (its ``streams``: one
        :class:`~deltaflow.client.StreamStatistics` each); a finished stream reports through
        the :class:`StreamSummary` its :meth:`stream_data` returned."""
        return ClientStatistics(
            state=self._state.value,
            map_version=self._router.map_version,
            nodes=self._router.nodes,
            connections=self._router.open_connections,
            streams=[run.statistics() for run in self._active.values()],
        )


def _sequence_columns(sequence_by: Any, key: Sequence[str]) -> list[str]:
    """``sequence_by=`` as a list of column names, checked."""
    columns = [sequence_by] if isinstance(sequence_by, str) else sequence_by
    if (
        not isinstance(columns, (list, tuple))
        or not columns
        or not all(isinstance(c, str) and c for c in columns)
    ):
        raise UsageError(
            f"sequence_by={sequence_by!r}: name a column, or a tuple of columns compared in order"
        )
    both = [c for c in columns if c in key]
    if both:
        raise UsageError(f"sequence_by: column(s) {both} are the key; name other columns")
    if len(set(columns)) != len(columns):
        raise UsageError(f"sequence_by: columns repeat in {list(columns)}")
    return list(columns)


def _key_columns(key: Any) -> list[str] | None:
    """The key's column names (what Arrow rows are routed by), if ``key=`` names columns."""
    if isinstance(key, str):
        return [key]
    if isinstance(key, (tuple, list)) and key and all(isinstance(k, str) for k in key):
        return list(key)
    return None


def _normalise(address: str) -> str:
    address = address.strip()
    for prefix in ("http://", "ws://"):
        address = address.removeprefix(prefix)
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"node address {address!r} must look like 'host:port'")
    return address


def connect(
    nodes: Sequence[str] | str,
    *,
    token: str | None = None,
    tls: ssl.SSLContext | ClientTls | None = None,
    connection_factory: ConnectionFactory | None = None,
) -> Client:
    """A client for the cluster reachable at any of ``nodes`` (``"host:port"`` strings).

    Use as ``async with deltaflow.connect(["127.0.0.1:7700"]) as client: ...``: the client
    reaches a node on entry and closes its connections on exit. The connect timeout is 10
    seconds; it bounds the map fetch, the TCP connect and the wait for ``welcome``. Only
    :class:`Client` takes another (``Client(..., connect_timeout=...)``).

    Args:
        nodes: one ``"host:port"`` string or a list of them. One reachable node is enough: the
            client learns the rest from its partition map. A leading ``http://`` or ``ws://``
            is stripped.
        token: the client token, when the nodes run with ``--token-file``. It is sent as
            ``Authorization: Bearer`` on ``/v1/cluster`` and on the WebSocket upgrade (so the
            node reads the connection as a client's from the start and never holds it to its
            strangers' handshake caps), and in ``hello``. In plain text the first
            ``/v1/cluster`` request goes without it: the token goes only to a cluster whose
            node has answered plain HTTP (its 401), never to the port of a node that serves
            TLS.
        tls: None (plain text), an :class:`ssl.SSLContext`, or a :class:`deltaflow.ClientTls`
            (file paths; it pickles, so the Spark helpers can send it to executors): ``ca``,
            the CA that signed the nodes' certificates; ``cert``/``key``, this client's
            certificate for nodes with ``--tls-client-auth``. A TLS failure raises
            :class:`~deltaflow.errors.TlsError` (not retried) saying what to change: an
            untrusted certificate, a missing client certificate, or TLS on one side only
            (``docs/security.md``).
        connection_factory: replaces how connections are opened: a seam for fault injection,
            e.g. :class:`deltaflow.testing.ConnectionDropper`.

    Returns:
        A :class:`Client`, not connected yet (``async with`` or :meth:`Client.start` does).
    """
    if isinstance(nodes, str):
        nodes = [nodes]
    return Client(nodes, token=token, tls=tls, connection_factory=connection_factory)
