"""Spark as a source and as a reader.

- :func:`stream_dataframe` streams a DataFrame's rows through deltaflow *from the executors*:
  every Spark partition runs the blocking client (:func:`deltaflow.stream_data`) over its own
  rows, and only one small summary per partition travels back to the driver.
- :func:`foreach_batch` makes a Structured Streaming query write each micro-batch through
  deltaflow, exactly once across restarts from the query's checkpoint.
- :func:`read_table` and :func:`read_dead_letters` read a deltaflow table (and the dead-letter
  table) back as DataFrames.

Exactly-once per micro-batch rests on the nodes' lane marks (``tables/marks.py``):
every table write records its ``(stream id, partition) -> (seq, k)`` in the Delta commit, and a
write whose mark the table already holds is skipped. A replayed micro-batch is therefore
skipped where it already landed if it is streamed under the *same stream ids* and cut into the
*same batches*. This module makes both deterministic: the stream id of Spark partition ``i`` of
micro-batch ``b`` is ``"<query_name>:<b>:<i>"``, and batches are cut by count and bytes only
(``auto_flush_interval=0``). What is left to the query is to give the same rows in the same
partition order when Spark replays a batch, which Spark's file and rate sources do. See
``docs/spark.md``.

Importing this module does not import PySpark.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ..client.options import DEFAULT_DEAD_LETTER_TABLE, StreamerOptions
from ..client.stream_types import KeyFn
from ..client.sync import stream_data
from ..errors import DataStreamerError, DeltaflowError, SchemaError, UsageError
from ..receivers.base import check_table_name

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType, StructType

__all__ = [
    "DataFrameStreamError",
    "DataFrameSummary",
    "ForeachBatchWriter",
    "PartitionFailure",
    "foreach_batch",
    "read_dead_letters",
    "read_table",
    "stream_dataframe",
]

log = logging.getLogger(__name__)

#: A caller's stream id for :func:`stream_dataframe`: ``:<partition index>`` is appended.
_STREAM_ID: Final = re.compile(r"[A-Za-z0-9._-]{1,100}")
#: A query name for :func:`foreach_batch`: ``:<batch id>:<partition index>`` is appended.
_QUERY_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,80}")

Converter = Callable[[Any], Any]


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


# -- streaming -------------------------------------------------------------------------------


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
    stream_id: str | None = None,
) -> DataFrameSummary:
    """Stream the rows of ``df`` through deltaflow from the executors and return the totals.

    Each Spark partition runs :func:`deltaflow.stream_data` over its own rows, with the stream
    id ``"<stream_id>:<partition index>"``, and sends one small summary back; the rows are never
    collected to the driver. Rows become dicts of msgpack values (see ``docs/spark.md``):
    timestamps become UTC datetimes, structs dicts, arrays lists, binary bytes. Columns of types
    the wire format cannot carry (decimal, date, intervals, user-defined types, all-null
    ``NullType``) are rejected before any job runs, with the cast to apply.

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
        stream_id: the base stream id, 1 to 100 characters of ``A-Z a-z 0-9 . _ -``. Default:
            a random one. Streaming the same DataFrame again under the same id writes only what
            the first run did not (same rows, same partitioning, same options). Never reuse an
            id for other data: rows whose lane marks a table already holds are skipped.

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
    _check_target(table=table, key=key, receiver=receiver)
    if stream_id is None:
        stream_id = uuid.uuid4().hex
    elif not isinstance(stream_id, str) or not _STREAM_ID.fullmatch(stream_id):
        raise UsageError(
            f"stream_id={stream_id!r} is not allowed; use 1 to 100 characters of "
            "A-Z a-z 0-9 . _ - (':<partition index>' is appended per Spark partition)"
        )
    return _stream(
        df,
        _PartitionStreamer(
            base_id=stream_id,
            nodes=_node_list(nodes),
            token=token,
            table=table,
            key=key,
            receiver=receiver,
            receiver_args=receiver_args,
            options=_deterministic(options),
            schema=_checked_schema(df),
        ),
    )


class ForeachBatchWriter:
    """The function :func:`foreach_batch` returns: pass it to ``writeStream.foreachBatch``.

    Attributes:
        query_name: the name every stream id of this query starts with.
        last_summary: the :class:`DataFrameSummary` of the latest micro-batch it wrote, or
            None before the first.
    """

    def __init__(self, query_name: str, streamer: _PartitionStreamer) -> None:
        self.query_name = query_name
        self._streamer = streamer
        self.last_summary: DataFrameSummary | None = None

    def __repr__(self) -> str:
        target = self._streamer.table or self._streamer.receiver
        return f"<ForeachBatchWriter {self.query_name!r} -> {target}>"

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        """Stream micro-batch ``batch_id``; raise if any of its rows was not applied.

        Raises:
            DataFrameStreamError: the query fails; restarted from its checkpoint, Spark runs
                the batch again and the rows that landed are skipped.
        """
        streamer = dataclasses.replace(
            self._streamer, base_id=f"{self.query_name}:{int(batch_id)}", schema=_checked_schema(df)
        )
        summary = _stream(df, streamer)
        log.info(
            "micro-batch %d of %s: %d row(s) applied in %.1fs",
            batch_id,
            self.query_name,
            summary.items_applied,
            summary.seconds,
        )
        self.last_summary = summary


def foreach_batch(
    *,
    nodes: Sequence[str] | str,
    query_name: str,
    table: str | None = None,
    key: str | Sequence[str] | KeyFn | None = None,
    receiver: str | None = None,
    receiver_args: Any = None,
    options: StreamerOptions | None = None,
    token: str | None = None,
) -> ForeachBatchWriter:
    """A ``foreachBatch`` function that writes each micro-batch through deltaflow, exactly once.

    Use as ``df.writeStream.foreachBatch(foreach_batch(nodes=..., query_name="orders",
    table="orders", key="id")).option("checkpointLocation", ...).start()``. Each micro-batch is
    streamed like :func:`stream_dataframe`, with the stream id ``"<query_name>:<batch id>:<Spark
    partition index>"``.

    **The exactly-once contract.** When a query restarts from its checkpoint, Spark runs the
    last micro-batch that did not complete again, with the same batch id. Its rows are streamed
    under the same stream ids and cut into the same batches (by count and bytes only), so every
    table write that landed in the first run is skipped by the nodes' lane marks, and the rest
    is written once. This holds when the replay gives the same rows in the same order in each
    Spark partition: Spark's file sources (the batch's files are in the offset log) and the rate
    source do, given the same Spark settings for splitting files (``spark.sql.files.*``,
    default parallelism) and an unchanged query. It also needs the same ``options`` and the same
    deltaflow partition count on the cluster. A replay in which a partition's rows differ
    (a shuffle without ``sortWithinPartitions``, a non-deterministic function, a changed query)
    can lose or repeat rows. Effects of custom receivers outside the tables are at-least-once.

    Args:
        nodes: node addresses (``"host:port"``), reachable from the executors.
        query_name: 1 to 80 characters of ``A-Z a-z 0-9 . _ -``, stable across restarts and
            unique among the queries writing the same tables (the query's ``queryName`` is a
            good choice). Two queries with one name would skip each other's batches, and so
            would a query started over without its checkpoint (its batch ids start at 0
            again): give it a new name, e.g. ``"clicks-v2"``.
        table, key, receiver, receiver_args, options, token: as for :func:`stream_dataframe`.

    Returns:
        A :class:`ForeachBatchWriter`, a callable ``(df, batch_id) -> None``. A micro-batch
        with rows that were not applied raises :class:`DataFrameStreamError`, which stops the
        query; restart it from its checkpoint once the cause is fixed.
    """
    if not isinstance(query_name, str) or not _QUERY_NAME.fullmatch(query_name):
        raise UsageError(
            f"query_name={query_name!r} is not allowed; use 1 to 80 characters of "
            "A-Z a-z 0-9 . _ - that stay the same when the query restarts"
        )
    _check_target(table=table, key=key, receiver=receiver)
    streamer = _PartitionStreamer(
        base_id=query_name,
        nodes=_node_list(nodes),
        token=token,
        table=table,
        key=key,
        receiver=receiver,
        receiver_args=receiver_args,
        options=_deterministic(options),
        schema=None,
    )
    return ForeachBatchWriter(query_name, streamer)


def _stream(df: DataFrame, streamer: _PartitionStreamer) -> DataFrameSummary:
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
        outcomes: list[_Outcome] = rdd.mapPartitionsWithIndex(streamer).collect()
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


@dataclass(frozen=True, slots=True, kw_only=True)
class _PartitionStreamer:
    """What runs on the executors, once per Spark partition (pickled with its settings)."""

    base_id: str
    nodes: tuple[str, ...]
    token: str | None
    table: str | None
    key: str | Sequence[str] | KeyFn | None
    receiver: str | None
    receiver_args: Any
    options: StreamerOptions
    schema: StructType | None

    def __call__(self, index: int, rows: Iterable[Any]) -> Iterator[_Outcome]:
        sid = f"{self.base_id}:{index}"
        remaining = iter(rows)
        first = next(remaining, None)
        if first is None:  # nothing to send: do not even connect
            yield _Outcome(partition=index, stream_id=sid)
            return
        assert self.schema is not None
        convert = _row_converter(self.schema)
        source = (convert(row) for row in itertools.chain((first,), remaining))
        applied = 0

        def count_applied(items: Sequence[Any]) -> None:
            nonlocal applied
            applied += len(items)

        try:
            summary = stream_data(
                source,
                nodes=list(self.nodes),
                token=self.token,
                table=self.table,
                key=self.key,
                receiver=self.receiver,
                receiver_args=self.receiver_args,
                on_ack=count_applied,
                options=self.options,
                stream_id=sid,
            )
        except DataStreamerError as exc:
            if exc.cause is not None and not isinstance(exc.cause, DeltaflowError):
                # Spark's own iterator failed (an upstream stage, a lost block): a task
                # failure for Spark to retry, under the same stream id, or to report.
                raise exc.cause from exc
            # Items never pulled from the source are in no list: count what is left.
            left = sum(1 for _ in remaining)
            log.warning("stream %s (Spark partition %d) failed: %s", sid, index, exc)
            yield _Outcome(
                partition=index,
                stream_id=sid,
                applied=applied,
                not_applied=len(exc.failed_items) + left,
                error=str(exc),
            )
            return
        except DeltaflowError as exc:  # the stream never started (no node, bad arguments)
            left = sum(1 for _ in remaining) + 1
            log.warning("stream %s (Spark partition %d) did not start: %s", sid, index, exc)
            yield _Outcome(
                partition=index,
                stream_id=sid,
                not_applied=left,
                error=f"{type(exc).__name__}: {exc}",
            )
            return
        yield _Outcome(
            partition=index,
            stream_id=sid,
            sent=summary.items_sent,
            applied=summary.items_acked,
            failed=summary.items_failed,
            dead_lettered=summary.items_dead_lettered,
            batches=sum(n.batches_acked for n in summary.per_node.values()),
            retried=summary.batches_retried,
        )


def _check_target(
    *, table: str | None, key: str | Sequence[str] | KeyFn | None, receiver: str | None
) -> None:
    """The driver-side checks of ``Client.stream_data``, before any Spark job runs."""
    if (table is None) == (receiver is None):
        raise UsageError("pass exactly one of table= (built-in upsert) or receiver=")
    if table is not None and not isinstance(key, (str, tuple, list)):
        raise UsageError(f"table={table!r} needs key= naming the key column(s), not {key!r}")
    if key is None:
        raise UsageError("key= is required: a column name, a tuple of column names, or a callable")


def _node_list(nodes: Sequence[str] | str) -> tuple[str, ...]:
    """Checked on the driver: a typo should fail once, not once per Spark partition."""
    listed = (nodes,) if isinstance(nodes, str) else tuple(nodes)
    if not listed:
        raise UsageError("nodes= needs at least one node address 'host:port'")
    for address in listed:
        host, sep, port = str(address).strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UsageError(f"node address {address!r} must look like 'host:port'")
    return listed


def _deterministic(options: StreamerOptions | None) -> StreamerOptions:
    """The options with the flush timer and linger off: batches are cut by count and bytes
    only, so a replay of the same rows is cut into the same batches (and hits the same lane
    marks)."""
    if options is not None and not isinstance(options, StreamerOptions):
        raise UsageError(f"options= must be a StreamerOptions, got {type(options).__name__}")
    return dataclasses.replace(options or StreamerOptions(), auto_flush_interval=0.0, linger=0.0)


# -- rows to msgpack values ------------------------------------------------------------------


def _checked_schema(df: DataFrame) -> StructType:
    """``df``'s schema, after checking every column can travel as a msgpack value."""
    schema = df.schema
    names = [f.name for f in schema.fields]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UsageError(
            f"the DataFrame has duplicate column names {duplicates}; rows become dicts, so "
            "rename or drop them first (e.g. after a join, select the columns you need)"
        )
    problems: list[str] = []
    for field in schema.fields:
        _unsupported(field.dataType, field.name, problems)
    if problems:
        raise UsageError(
            "these columns cannot be streamed as they are: "
            + "; ".join(problems)
            + ". Cast them first, e.g. df.withColumn(name, F.col(name).cast('string'))"
        )
    return schema


def _unsupported(dtype: DataType, path: str, problems: list[str]) -> None:
    from pyspark.sql import types as T

    hint: str | None = None
    if isinstance(dtype, (T.DayTimeIntervalType, T.YearMonthIntervalType)):
        hint = "convert to a number (e.g. seconds or months as 'long')"
    elif isinstance(dtype, T.UserDefinedType):
        hint = "convert it to its underlying SQL type"
    elif isinstance(dtype, T.NullType):
        hint = "it is always null, so its type cannot be inferred; cast to the intended type"
    elif isinstance(dtype, T.StructType):
        for field in dtype.fields:
            _unsupported(field.dataType, f"{path}.{field.name}", problems)
    elif isinstance(dtype, T.ArrayType):
        _unsupported(dtype.elementType, f"{path}[]", problems)
    elif isinstance(dtype, T.MapType):
        _unsupported(dtype.keyType, f"{path}{{key}}", problems)
        _unsupported(dtype.valueType, f"{path}{{value}}", problems)
    if hint is not None:
        problems.append(f"{path!r} is {dtype.simpleString()}: {hint}")


def _row_converter(schema: StructType) -> Converter:
    """A function from a Row of ``schema`` to a dict of msgpack values.

    The same values as ``row.asDict(recursive=True)`` (decimals, dates and ``timestamp_ntz``
    wall-clock times as PySpark gives them), except ``timestamp``: PySpark gives an instant as
    a naive datetime in the worker's local time, which becomes the same instant in UTC (a naive
    datetime would land in a ``timestamp_ntz`` column, or be refused by a ``timestamp`` one).
    """
    convert = _converter(schema)
    assert convert is not None
    return convert


def _converter(dtype: DataType) -> Converter | None:
    """The conversion for values of ``dtype``; None where values pass unchanged."""
    from pyspark.sql import types as T

    if isinstance(dtype, T.TimestampType):
        return _instant_to_utc
    if isinstance(dtype, T.StructType):
        names = tuple(f.name for f in dtype.fields)
        fields = tuple(_converter(f.dataType) for f in dtype.fields)
        if not any(fields):

            def plain_struct(row: Any) -> Any:
                return None if row is None else dict(zip(names, row, strict=True))

            return plain_struct
        pairs = tuple(zip(names, fields, strict=True))

        def struct(row: Any) -> Any:
            if row is None:
                return None
            return {
                name: (value if conv is None else conv(value))
                for (name, conv), value in zip(pairs, row, strict=True)
            }

        return struct
    if isinstance(dtype, T.ArrayType):
        element = _converter(dtype.elementType)
        if element is None:
            return None
        each = element

        def array(values: Any) -> Any:
            return None if values is None else [each(v) for v in values]

        return array
    if isinstance(dtype, T.MapType):
        keys = _converter(dtype.keyType) or _identity
        values = _converter(dtype.valueType) or _identity
        if keys is _identity and values is _identity:
            return None

        def mapping(m: Any) -> Any:
            return None if m is None else {keys(k): values(v) for k, v in m.items()}

        return mapping
    return None


def _identity(value: Any) -> Any:
    return value


def _instant_to_utc(value: Any) -> Any:
    if value is None or value.tzinfo is not None:
        return value
    # PySpark built it with datetime.fromtimestamp (local time, fold set): astimezone reads it
    # back as the same local time, so the instant is exact, also around DST changes.
    return value.astimezone(datetime.UTC)


# -- readers ---------------------------------------------------------------------------------


def read_table(
    spark: SparkSession,
    warehouse: str | os.PathLike[str],
    name: str,
    *,
    all_columns: bool = False,
) -> DataFrame:
    """The deltaflow table ``name`` under ``warehouse`` as a DataFrame.

    A table lives at ``<warehouse>/<name>``, the nodes' ``--warehouse`` directory. The
    SparkSession needs Delta (``deltaflow.spark_integration.get_spark()`` gives one).
    deltaflow's bucket column (``_deltaflow_bucket``, the layout of keyed tables) is left out
    unless ``all_columns`` is true.

    Raises:
        UsageError: ``name`` is not a table name, or there is no Delta table at that path
            (the message names the path and the tables that do exist).
    """
    path = _table_path(
        warehouse,
        name,
        missing="a table is created by its first write, so stream into it first",
    )
    return _load(spark, path, all_columns=all_columns)


def read_dead_letters(
    spark: SparkSession,
    warehouse: str | os.PathLike[str],
    table: str = DEFAULT_DEAD_LETTER_TABLE,
) -> DataFrame:
    """The dead-letter table (``StreamerOptions.dead_letter_table``) as a DataFrame.

    Columns: ``stream_id``, ``position``, ``partition``, ``seq``, ``error_code``, ``error``,
    ``node``, ``payload`` (the item, msgpack-packed: ``msgpack.unpackb(payload, timestamp=3)``),
    ``deleted`` and ``failed_at`` (see ``docs/guarantees.md``). For rows streamed with
    :func:`stream_dataframe`, ``stream_id`` is ``"<base id>:<Spark partition>"`` and
    ``position`` the row's index in that partition.

    Raises:
        UsageError: there is no such table (nothing was dead-lettered into it yet).
    """
    path = _table_path(
        warehouse,
        table,
        missing=(
            "the dead-letter table is created when the first item is set aside under "
            "StreamerOptions(on_failure='fallback'); if that happened, check the table name "
            "(StreamerOptions.dead_letter_table)"
        ),
    )
    return _load(spark, path, all_columns=False)


def _load(spark: SparkSession, path: Path, *, all_columns: bool) -> DataFrame:
    from ..tables.settings import BUCKET_COLUMN

    df = spark.read.format("delta").load(str(path))
    if not all_columns and BUCKET_COLUMN in df.columns:
        df = df.drop(BUCKET_COLUMN)
    return df


def _table_path(warehouse: str | os.PathLike[str], name: str, *, missing: str) -> Path:
    try:
        check_table_name(name)
    except SchemaError as exc:
        raise UsageError(str(exc)) from exc
    root = Path(warehouse)
    path = root / name
    if (path / "_delta_log").is_dir():
        return path
    if not root.is_dir():
        where = f"the warehouse directory {root} does not exist; pass the nodes' --warehouse"
    else:
        tables = sorted(p.name for p in root.iterdir() if (p / "_delta_log").is_dir())
        where = f"tables under {root}: {', '.join(tables) if tables else 'none'}; {missing}"
    raise UsageError(f"no deltaflow table {name!r} at {path} (no _delta_log there); {where}")
