"""Spark Structured Streaming as a source: :func:`foreach_batch` makes a query write each
micro-batch through deltaflow, exactly once across restarts from the query's checkpoint.

Exactly-once per micro-batch rests on the nodes' lane marks (``tables/marks.py``):
every table write records its ``(stream id, partition) -> (seq, k)`` in the Delta commit, and a
write whose mark the table already holds is skipped. A replayed micro-batch is therefore
skipped where it already landed if it is streamed under the *same stream ids* and cut into the
*same batches*. This module makes both deterministic: the stream id of Spark partition ``i`` of
micro-batch ``b`` is ``"<query_name>:<b>:<i>"``, and batches are cut by count and bytes only
(``auto_flush_interval=0``). What is left to the query is to give the same rows in the same
partition order when Spark replays a batch, which Spark's file and rate sources do. The streams'
keys are derived from the caller's ``stream_key`` (or the token), the same after a restart. See
``docs/spark.md``.

Importing this module does not import PySpark.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from ..client.options import StreamerOptions
from ..client.stream_keys import stream_key as make_stream_key
from ..client.stream_types import KeyFn
from ..errors import UsageError
from ..security import ClientTls
from .dataframe import (
    DataFrameSummary,
    PartitionStreamer,
    check_target,
    check_tls,
    deterministic_options,
    node_list,
    stream_partitions,
)
from .row_values import checked_schema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["ForeachBatchWriter", "foreach_batch"]

log = logging.getLogger(__name__)

#: A query name for :func:`foreach_batch`: ``:<batch id>:<partition index>`` is appended.
_QUERY_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,80}")


class ForeachBatchWriter:
    """The function :func:`foreach_batch` returns: pass it to ``writeStream.foreachBatch``.

    Attributes:
        query_name: the name every stream id of this query starts with.
        last_summary: the :class:`DataFrameSummary` of the latest micro-batch it wrote, or
            None before the first.
    """

    def __init__(self, query_name: str, streamer: PartitionStreamer) -> None:
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
            self._streamer, base_id=f"{self.query_name}:{int(batch_id)}", schema=checked_schema(df)
        )
        summary = stream_partitions(df, streamer)
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
    tls: ClientTls | None = None,
    stream_key: str | bytes | None = None,
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
        table, key, receiver, receiver_args, options, token, tls: as for
            :func:`stream_dataframe`.
        stream_key: the secret the query's streams are opened with, the same across restarts
            (see :meth:`deltaflow.Client.stream_data`). Default None: derived from ``token``,
            which keeps strangers from replaying or skipping the query's batches, but not other
            clients holding the token.

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
    check_target(table=table, key=key, receiver=receiver)
    check_tls(tls)
    make_stream_key(query_name, stream_key, token=token)  # a bad key fails here, once
    streamer = PartitionStreamer(
        base_id=query_name,
        stream_key=stream_key,
        nodes=node_list(nodes),
        token=token,
        tls=tls,
        table=table,
        key=key,
        receiver=receiver,
        receiver_args=receiver_args,
        options=deterministic_options(options),
        schema=None,
    )
    return ForeachBatchWriter(query_name, streamer)
