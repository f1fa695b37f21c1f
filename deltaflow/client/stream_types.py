"""What a stream takes and gives back: deletes, keys, receiver names, summary and statistics."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..columnar import NULLS_COLUMN
from ..errors import UsageError
from .latency import AckLatency
from .sender import NodeStatistics

__all__ = [
    "DEAD_LETTER_RECEIVER",
    "TABLE_RECEIVER",
    "Delete",
    "KeyFn",
    "StreamStatistics",
    "StreamSummary",
    "key_function",
    "set_null",
    "spread",
]

#: Name of the built-in receiver that upserts into a Delta table (registered on every node).
TABLE_RECEIVER = "deltaflow.receivers.TableUpsert"
#: Name of the built-in receiver that appends failed items to a dead-letter table.
DEAD_LETTER_RECEIVER = "deltaflow.receivers.DeadLetter"


@dataclass(frozen=True, slots=True)
class Delete:
    """Marks an item as a delete of its key (Ignite 3's REMOVE operation).

    For a table stream, ``item`` is a row holding at least the key columns; for a custom
    receiver, whatever the receiver expects. A delete is ordered with the upserts of its key.
    """

    item: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamSummary:
    """What a finished stream did: what :meth:`~deltaflow.client.Client.stream_data` returns.

    Attributes:
        stream_id: the id the nodes saw (in their logs and metrics).
        items_sent: items pulled from the source and sent at least once.
        items_acked: items acknowledged as applied.
        items_failed: items not applied (dropped under ``on_failure="drop"``).
        items_dead_lettered: items written to the dead-letter table (``on_failure="fallback"``,
            and quarantined rows).
        items_quarantined: rows of a table stream that did not fit the table, written alone to
            the dead-letter table while the rest of their batches applied
            (``on_bad_row="quarantine"``); among ``items_dead_lettered``.
        batches_retried: batch resends after retriable errors.
        results: per-item results delivered to ``on_result``.
        duration: seconds from start to the last acknowledgement.
        per_node: a :class:`~deltaflow.client.NodeStatistics` per node id: acknowledged
            batches and items, and errors.
        ack_latency: quantiles of the seconds from a batch's first send to its
            acknowledgement (:class:`~deltaflow.client.AckLatency`).
    """

    stream_id: str
    items_sent: int
    items_acked: int
    items_failed: int
    items_dead_lettered: int
    batches_retried: int
    results: int
    duration: float
    per_node: dict[str, NodeStatistics]
    ack_latency: AckLatency = dataclasses.field(default_factory=AckLatency)
    items_quarantined: int = 0

    @property
    def rows_per_second(self) -> float:
        """Items acknowledged per second of ``duration`` (0.0 for a stream of no time)."""
        return self.items_acked / self.duration if self.duration > 0 else 0.0


KeyFn = Callable[[Any], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamStatistics:
    """A snapshot of a running stream (in :meth:`~deltaflow.client.Client.statistics`).

    Attributes:
        stream_id: the stream's id.
        pulled: items taken from the source so far.
        buffered: items waiting in partition buffers, not yet in a batch.
        in_flight: batches being sent, retries and backoff included.
        acked: items acknowledged as applied.
        failed: items whose batch failed for good, dropped and dead-lettered items included.
        dead_lettered: items acknowledged by the dead-letter table.
        retried: batch resends.
        commit_position: the :class:`~deltaflow.CommitPosition` count (the contiguous settled
            prefix; 0 unless ``on_commit`` was given).
        per_node: a :class:`~deltaflow.client.NodeStatistics` per node id.
        ack_latency: quantiles of the ack latency so far (as :attr:`StreamSummary.ack_latency`).
    """

    stream_id: str
    pulled: int
    buffered: int
    in_flight: int
    acked: int
    failed: int
    dead_lettered: int
    retried: int
    commit_position: int
    per_node: dict[str, NodeStatistics]
    ack_latency: AckLatency = dataclasses.field(default_factory=AckLatency)


def set_null(row: Mapping[str, Any], *columns: str) -> dict[str, Any]:
    """``row`` with ``columns`` set to null on purpose: on a table with ``merge="partial"`` a
    null (or an absent column) keeps the stored value, these replace it with null. On other
    tables the same as a null value.

    Raises:
        UsageError: a column is not a name.
    """
    if not all(isinstance(c, str) and c for c in columns):
        raise UsageError(f"set_null: name the columns to set to null, got {columns!r}")
    named = list(dict.fromkeys([*row.get(NULLS_COLUMN, ()), *columns]))
    return {**{k: v for k, v in row.items() if k not in columns}, NULLS_COLUMN: named}


def spread(item: Any) -> None:
    """The routing of a table stream without a key (appends): no key; admission spreads the
    items over the partitions by a hash of their packed bytes (an Arrow batch by its source
    position), the same for a replay of the same input."""
    return None


def key_function(key: str | Sequence[str] | KeyFn | None) -> KeyFn:
    """Turn ``key=`` (a column name, several, or a callable) into a function of an item."""
    if key is None:
        raise UsageError("key= is required: a column name, a tuple of column names, or a callable")
    if callable(key):
        return key
    if isinstance(key, str):
        return operator.itemgetter(key)
    columns = tuple(key)
    if not columns or not all(isinstance(c, str) for c in columns):
        raise UsageError(f"key= must name columns as strings, got {key!r}")
    # One column routes by its value, as ``key="id"`` does (and as the node's bucket column is
    # computed); several by the tuple of their values.
    return operator.itemgetter(*columns)
