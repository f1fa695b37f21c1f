"""Spark as a source: :func:`stream_dataframe` streams a DataFrame's rows through deltaflow
*from the executors*. Every Spark partition runs the blocking client
(:func:`deltaflow.stream_data`) over its own rows, and only one small summary per partition
travels back to the driver.

The stream id of Spark partition ``i`` is ``"<base id>:<i>"``, and batches are cut by count and
bytes only (``auto_flush_interval=0``): a partition that Spark runs again is cut into the same
batches under the same stream id and key, so the nodes' lane marks (``tables/marks.py``) skip
the writes that already landed. The key of each partition's stream is derived from one secret
the driver ships to the executors in the task's closure: random with a random base id, else
the caller's ``stream_key`` (or, without one, the token). :mod:`.streaming` builds Structured
Streaming's exactly-once micro-batches on the same machinery. See ``docs/spark.md``.

Importing this module does not import PySpark.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from ..client.options import StreamerOptions
from ..client.stream_keys import STREAM_KEY_BYTES
from ..client.stream_keys import stream_key as make_stream_key
from ..client.stream_types import KeyFn
from ..client.sync import stream_data
from ..errors import DataStreamerError, DeltaflowError, UsageError
from ..names import table_name_problem
from ..security import ClientTls
from .row_values import checked_schema, row_converter

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = [
    "DataFrameStreamError",
    "DataFrameSummary",
    "PartitionFailure",
    "stream_dataframe",
]

log = logging.getLogger(__name__)

#: A caller's stream id for :func:`stream_dataframe`: ``:<partition index>`` is appended.
_STREAM_ID: Final = re.compile(r"[A-Za-z0-9._-]{1,100}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataFrameSummary:
    """What :func:`stream_dataframe` did, summed over the DataFrame's Spark partitions.

    Attributes:
        stream_id: the base stream id; Spark partition ``i`` streamed as ``"<stream_id>:<i>"``
            (the ``stream_id`` column of dead-letter rows names it).
        partitions: Spark partitions streamed, empty ones included.
        items_sent: rows sent to the nodes at least once.
        items_applied: rows acknowledged as applied (in a committed table version).
        items_failed: rows dropped under ``on_failure="drop"``.
        items_dead_lettered: rows written to the dead-letter table under
            ``on_failure="fallback"``.
        batches: batches acknowledged by the nodes.
        batches_retried: batch resends after retriable errors.
        seconds: wall-clock seconds on the driver, from job submission to the last summary.
    """

    stream_id: str
    partitions: int
    items_sent: int
    items_applied: int
    items_failed: int
    items_dead_lettered: int
    batches: int
    batches_retried: int
    seconds: float

    @property
    def rows_per_second(self) -> float:
        return self.items_applied / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionFailure:
    """One Spark partition whose stream did not apply every row.

    Attributes:
        partition: the Spark partition index.
        stream_id: the partition's stream id (``"<base id>:<partition>"``).
        items_applied: rows of the partition acknowledged as applied before it stopped.
        items_not_applied: rows of the partition that were not applied (the failed ones and
            the ones never sent).
        error: the error that stopped the partition's stream.
    """

    partition: int
    stream_id: str
    items_applied: int
    items_not_applied: int
    error: str


class DataFrameStreamError(DeltaflowError):
    """Some Spark partitions could not apply all their rows.

    The rows themselves stay on the executors (nothing is collected to the driver), so this
    error counts them instead of listing them. Every other partition ran to its end.

    Attributes:
        failures: one :class:`PartitionFailure` per failed partition, by partition index.
        summary: the totals of the whole run, failed partitions included.
    """

    def __init__(
        self, message: str, failures: Sequence[PartitionFailure], summary: DataFrameSummary
    ) -> None:
        super().__init__(message)
        self.failures = list(failures)
        self.summary = summary


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What one Spark partition sends back to the driver: counters, never rows."""

    partition: int
    stream_id: str
    sent: int = 0
    applied: int = 0
    failed: int = 0
    dead_lettered: int = 0
    batches: int = 0
    retried: int = 0
    not_applied: int = 0
    error: str | None = None


#: :class:`_Outcome` as the one-row Arrow batch a partition streamed by ``mapInArrow`` yields.
_OUTCOME_SCHEMA: Final = (
    "partition int, stream_id string, sent long, applied long, failed long, "
    "dead_lettered long, batches long, retried long, not_applied long, error string"
)


def stream_dataframe(
    df: DataFrame,
    *,
    nodes: Sequence[str] | str,
    table: str | None = None,
    key: str | Sequence[str] | KeyFn | None = None,
    receiver: str | None = None,
    receiver_args: Any = None,
    options: StreamerOptions | None = None,
    token: str | None = None,
    tls: ClientTls | None = None,
    stream_id: str | None = None,
    stream_key: str | bytes | None = None,
) -> DataFrameSummary:
    """Stream the rows of ``df`` through deltaflow from the executors and return the totals.

    Each Spark partition runs :func:`deltaflow.stream_data` over its own rows, with the stream
    id ``"<stream_id>:<partition index>"``, and sends one small summary back; the rows are never
    collected to the driver. Rows upserted into ``table`` by key columns travel as the
    partition's Arrow record batches (``mapInArrow``: no Python row is made, and a table made
    by the first write gets the DataFrame's types exactly). Otherwise (a receiver, a key
    callable) rows become dicts of msgpack values (see ``docs/spark.md``):
    timestamps become UTC datetimes, structs dicts, arrays lists, binary bytes. Columns of types
    a table cannot take as they are (intervals, user-defined types, all-null ``NullType``) are
    rejected before any job runs, with the cast to apply.

    Batches are cut by count and bytes only (``auto_flush_interval`` and ``linger`` are set to
    0), so a partition that Spark runs again (a task retry) is cut the same way and, under the same
    stream id, skipped where its writes already landed, provided the partition yields the same
    rows in the same order.

    Args:
        df: the DataFrame (classic Spark; Spark Connect DataFrames have no ``rdd``).
        nodes: node addresses (``"host:port"``), reachable from the executors.
        table: upsert the rows into this Delta table, merging on ``key``.
        key: the routing key: a column name, a sequence of column names, or a callable of a
            row dict (pickled to the executors). With ``table`` it must name the key column(s).
        receiver: a receiver registered on the nodes, instead of ``table``.
        receiver_args: a msgpack value handed to the receiver with every batch.
        options: batching, window and retry settings; each partition uses them as they are,
            except ``auto_flush_interval`` and ``linger``, which are 0. Default
            ``StreamerOptions()``.
        token: the cluster's shared secret, if the nodes require one.
        tls: reach the nodes over TLS, a :class:`deltaflow.ClientTls` (its files must be
            readable at the same paths on every executor; an ``ssl.SSLContext`` does not pickle).
        stream_id: the base stream id, 1 to 100 characters of ``A-Z a-z 0-9 . _ -``. Default:
            a random one. Streaming the same DataFrame again under the same id writes only what
            the first run did not (same rows, same partitioning, same options). Never reuse an
            id for other data: rows whose lane marks a table already holds are skipped.
        stream_key: with ``stream_id``, the secret that makes the streams the caller's (see
            :meth:`deltaflow.Client.stream_data`); a rerun needs the same. Default None: derived
            from ``token``. Each partition's stream gets a key of its own derived from it.
            Without ``stream_id``, the driver makes a random one.

    Returns:
        A :class:`DataFrameSummary` once every partition's stream has ended.

    Raises:
        DataFrameStreamError: some partitions did not apply all their rows; ``failures``
            says which and how many, ``summary`` holds the totals. The other partitions ran
            to their end.
        UsageError: inconsistent arguments, an unsupported column type, duplicate column
            names, or a streaming DataFrame (use :func:`foreach_batch`).

    Blocking: call it from a plain thread, never on a running event loop (wrap it in
    ``asyncio.to_thread``). A failure of Spark itself (an executor lost for good) propagates
    as Spark's exception.
    """
    check_target(table=table, key=key, receiver=receiver)
    check_tls(tls)
    if stream_id is None:
        make_stream_key(None, stream_key, token=token)  # refuses a key without an id
        # Shipped in the closure, so a retried task opens its stream with the same key.
        stream_id, stream_key = uuid.uuid4().hex, secrets.token_bytes(STREAM_KEY_BYTES)
    elif not isinstance(stream_id, str) or not _STREAM_ID.fullmatch(stream_id):
        raise UsageError(
            f"stream_id={stream_id!r} is not allowed; use 1 to 100 characters of "
            "A-Z a-z 0-9 . _ - (':<partition index>' is appended per Spark partition)"
        )
    else:
        make_stream_key(stream_id, stream_key, token=token)  # a bad key fails here, once
    return stream_partitions(
        df,
        PartitionStreamer(
            base_id=stream_id,
            stream_key=stream_key,
            nodes=node_list(nodes),
            token=token,
            tls=tls,
            table=table,
            key=key,
            receiver=receiver,
            receiver_args=receiver_args,
            options=deterministic_options(options),
            schema=checked_schema(df),
        ),
    )


def stream_partitions(df: DataFrame, streamer: PartitionStreamer) -> DataFrameSummary:
    """Run ``streamer`` on every partition of ``df`` and sum the outcomes on the driver."""
    if df.isStreaming:
        raise UsageError(
            "this is a streaming DataFrame; write it with "
            "df.writeStream.foreachBatch(foreach_batch(...)) instead of stream_dataframe()"
        )
    try:
        rdd = df.rdd
    except Exception as exc:
        raise UsageError(
            "stream_dataframe needs a DataFrame of a classic SparkSession (DataFrame.rdd); "
            f"Spark Connect DataFrames have none ({type(exc).__name__}: {exc})"
        ) from exc
    df.sparkSession.sparkContext.setJobDescription(f"deltaflow: stream {streamer.base_id}")
    started = time.monotonic()
    try:
        outcomes: list[_Outcome]
        if streamer.columnar:
            summaries = df.mapInArrow(streamer.stream_batches, _OUTCOME_SCHEMA).collect()
            outcomes = [_Outcome(**row.asDict()) for row in summaries]
        else:
            outcomes = rdd.mapPartitionsWithIndex(streamer).collect()
    finally:
        df.sparkSession.sparkContext.setJobDescription(None)  # type: ignore[arg-type]
    outcomes.sort(key=lambda o: o.partition)
    summary = DataFrameSummary(
        stream_id=streamer.base_id,
        partitions=len(outcomes),
        items_sent=sum(o.sent for o in outcomes),
        items_applied=sum(o.applied for o in outcomes),
        items_failed=sum(o.failed for o in outcomes),
        items_dead_lettered=sum(o.dead_lettered for o in outcomes),
        batches=sum(o.batches for o in outcomes),
        batches_retried=sum(o.retried for o in outcomes),
        seconds=time.monotonic() - started,
    )
    failures = [
        PartitionFailure(
            partition=o.partition,
            stream_id=o.stream_id,
            items_applied=o.applied,
            items_not_applied=o.not_applied,
            error=o.error,
        )
        for o in outcomes
        if o.error is not None
    ]
    if failures:
        first = failures[0]
        raise DataFrameStreamError(
            f"stream {streamer.base_id}: {len(failures)} of {len(outcomes)} Spark partition(s) "
            f"failed, {sum(f.items_not_applied for f in failures)} row(s) not applied "
            f"({summary.items_applied} applied); first, partition {first.partition} "
            f"(stream {first.stream_id}): {first.error}",
            failures,
            summary,
        )
    return summary


def _named(exc: BaseException) -> str:
    """An error as ``Class: message``, a nested stream's own wrapping peeled off."""
    while isinstance(exc, DataStreamerError) and exc.cause is not None:
        exc = exc.cause
    return f"{type(exc).__name__}: {exc}"


def check_tls(tls: object) -> None:
    """The executors build their own SSL context from files: only a ClientTls travels there."""
    if tls is not None and not isinstance(tls, ClientTls):
        raise UsageError(
            f"tls= for Spark must be a deltaflow.ClientTls (file paths the executors can read), "
            f"not {type(tls).__name__}: an ssl.SSLContext cannot be sent to executors"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionStreamer:
    """What runs on the executors, once per Spark partition (pickled with its settings)."""

    base_id: str
    #: What each partition's stream key is derived from (None: the token).
    stream_key: str | bytes | None = field(default=None, repr=False)
    nodes: tuple[str, ...]
    token: str | None
    tls: ClientTls | None
    table: str | None
    key: str | Sequence[str] | KeyFn | None
    receiver: str | None
    receiver_args: Any
    options: StreamerOptions
    schema: StructType | None

    @property
    def columnar(self) -> bool:
        """Whether the partitions stream their Arrow record batches (``mapInArrow``): rows
        upserted into a table by key columns. A receiver's rows, or rows routed by a callable,
        travel as dicts."""
        return self.table is not None and isinstance(self.key, (str, tuple, list))

    def __call__(self, index: int, rows: Iterable[Any]) -> Iterator[_Outcome]:
        """Stream Spark partition ``index``'s rows as dicts of msgpack values."""
        remaining = iter(rows)
        first = next(remaining, None)
        if first is None:  # nothing to send: do not even connect
            yield _Outcome(partition=index, stream_id=f"{self.base_id}:{index}")
            return
        assert self.schema is not None
        convert = row_converter(self.schema)
        source = (convert(row) for row in itertools.chain((first,), remaining))
        yield self._stream(index, source, lambda: sum(1 for _ in remaining), first_rows=1)

    def stream_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``mapInArrow``'s function: stream this Spark partition's record batches as they
        are (column types exact, no row made in Python) and yield its outcome as one row."""
        import pyarrow as pa
        from pyspark import TaskContext

        context = TaskContext.get()
        index = context.partitionId() if context is not None else 0
        remaining = (b for b in batches if b.num_rows)
        first = next(remaining, None)
        if first is None:
            outcome = _Outcome(partition=index, stream_id=f"{self.base_id}:{index}")
        else:
            source = itertools.chain((first,), remaining)
            outcome = self._stream(
                index, source, lambda: sum(b.num_rows for b in remaining), first.num_rows
            )
        counters = [(f.name, pa.int64()) for f in dataclasses.fields(_Outcome)][2:-1]
        schema = pa.schema(
            [("partition", pa.int32()), ("stream_id", pa.string()), *counters],
        ).append(pa.field("error", pa.string()))
        yield pa.RecordBatch.from_pylist([dataclasses.asdict(outcome)], schema=schema)

    def _stream(
        self, index: int, source: Iterator[Any], left: Callable[[], int], first_rows: int
    ) -> _Outcome:
        """Stream ``source`` as Spark partition ``index``'s stream; ``left`` counts the rows
        the partition still holds once the stream stopped early, ``first_rows`` those of the
        source's first item (taken from the partition before the stream began)."""
        sid = f"{self.base_id}:{index}"
        applied = 0

        def count_applied(items: Sequence[Any]) -> None:
            nonlocal applied
            applied += len(items)

        try:
            summary = stream_data(
                source,
                nodes=list(self.nodes),
                token=self.token,
                tls=self.tls,
                table=self.table,
                key=self.key,
                receiver=self.receiver,
                receiver_args=self.receiver_args,
                on_ack=count_applied,
                options=self.options,
                stream_id=sid,
                stream_key=self.stream_key,
            )
        except DataStreamerError as exc:
            if exc.cause is not None and not isinstance(exc.cause, DeltaflowError):
                # Spark's own iterator failed (an upstream stage, a lost block): a task
                # failure for Spark to retry, under the same stream id, or to report.
                raise exc.cause from exc
            log.warning("stream %s (Spark partition %d) failed: %s", sid, index, exc)
            # Items never pulled from the source are in no list: count what is left.
            return _Outcome(
                partition=index,
                stream_id=sid,
                applied=applied,
                not_applied=sum(map(_count, exc.failed_items)) + left(),
                # The cause alone: the failure names its partition and stream already.
                error=_named(exc.cause if exc.cause is not None else exc),
            )
        except DeltaflowError as exc:  # the stream never started (no node, bad arguments)
            log.warning("stream %s (Spark partition %d) did not start: %s", sid, index, exc)
            return _Outcome(
                partition=index,
                stream_id=sid,
                not_applied=first_rows + left(),
                error=_named(exc),
            )
        return _Outcome(
            partition=index,
            stream_id=sid,
            sent=summary.items_sent,
            applied=summary.items_acked,
            failed=summary.items_failed,
            dead_lettered=summary.items_dead_lettered,
            batches=sum(n.batches_acked for n in summary.per_node.values()),
            retried=summary.batches_retried,
        )


def _count(item: Any) -> int:
    """Rows in a failed item: a record batch's (never sent), or one row."""
    rows = getattr(item, "num_rows", None)
    return 1 if rows is None else int(rows)


def check_target(
    *, table: str | None, key: str | Sequence[str] | KeyFn | None, receiver: str | None
) -> None:
    """The driver-side checks of ``Client.stream_data``, before any Spark job runs."""
    if (table is None) == (receiver is None):
        raise UsageError("pass exactly one of table= (built-in upsert) or receiver=")
    if table is not None and (problem := table_name_problem(table)) is not None:
        raise UsageError(problem)
    if table is not None and key is not None and not isinstance(key, (str, tuple, list)):
        raise UsageError(
            f"table={table!r} needs key= naming the key column(s), not {key!r}; without key= "
            "the rows are appended"
        )
    if key is None:
        raise UsageError("key= is required: a column name, a tuple of column names, or a callable")


def node_list(nodes: Sequence[str] | str) -> tuple[str, ...]:
    """Checked on the driver: a typo should fail once, not once per Spark partition."""
    listed = (nodes,) if isinstance(nodes, str) else tuple(nodes)
    if not listed:
        raise UsageError("nodes= needs at least one node address 'host:port'")
    for address in listed:
        host, sep, port = str(address).strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UsageError(f"node address {address!r} must look like 'host:port'")
    return listed


def deterministic_options(options: StreamerOptions | None) -> StreamerOptions:
    """The options with the flush timer and linger off: batches are cut by count and bytes
    only, so a replay of the same rows is cut into the same batches (and hits the same lane
    marks)."""
    if options is not None and not isinstance(options, StreamerOptions):
        raise UsageError(f"options= must be a StreamerOptions, got {type(options).__name__}")
    return dataclasses.replace(options or StreamerOptions(), auto_flush_interval=0.0, linger=0.0)
