"""Streamer options: one frozen, keyword-only dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from ..errors import UsageError
from ..names import table_name_problem
from ..protocol import DEFAULT_MAX_FRAME_BYTES, LANE_WINDOW
from .accumulator import BatchCreator

__all__ = [
    "DEFAULT_ACK_TIMEOUT",
    "DEFAULT_AUTO_FLUSH_INTERVAL",
    "DEFAULT_DEAD_LETTER_TABLE",
    "DEFAULT_MAX_BATCH_BYTES",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_PER_PARTITION_IN_FLIGHT",
    "DEFAULT_RESULT_BUFFER",
    "DEFAULT_RETRY_LIMIT",
    "DEFAULT_SOURCE_BUFFER",
    "BadRowPolicy",
    "FailurePolicy",
    "StreamerOptions",
]

DEFAULT_PAGE_SIZE: Final = 1000
DEFAULT_MAX_BATCH_BYTES: Final = 4 * 1024 * 1024
DEFAULT_AUTO_FLUSH_INTERVAL: Final = 5.0
DEFAULT_MAX_IN_FLIGHT: Final = 128
DEFAULT_PER_PARTITION_IN_FLIGHT: Final = 4
DEFAULT_RETRY_LIMIT: Final = 16
DEFAULT_RETRY_INITIAL_BACKOFF: Final = 0.05
DEFAULT_RETRY_MAX_BACKOFF: Final = 2.0
DEFAULT_ACK_TIMEOUT: Final = 120.0
DEFAULT_RESULT_BUFFER: Final = 1024
DEFAULT_SOURCE_BUFFER: Final = 1024

FailurePolicy = Literal["fail", "fallback", "drop"]
BadRowPolicy = Literal["fail", "quarantine"]
DEFAULT_DEAD_LETTER_TABLE: Final = "deltaflow_dead_letters"


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamerOptions:
    """How a stream is batched, windowed and retried.

    Attributes:
        page_size: items per batch; a partition's buffer is sent when it holds this many.
            Default 1000 (as Ignite 3).
        max_batch_bytes: a partition's buffer is also sent once its packed items reach this
            many bytes. Default 4 MiB; must stay below the node's frame limit (16 MiB).
        auto_flush_interval: seconds after which a partly filled buffer is sent anyway.
            Default 5.0 (as Ignite 3).
        linger: seconds the source may stay idle (the stream waiting for its next item) before
            every partly filled buffer is sent, as Kafka's ``linger.ms``: a trickle of items
            then reaches the nodes within about two lingers instead of ``auto_flush_interval``,
            while a busy source still fills whole pages. Default 0: off.
        max_in_flight: batches sent and not yet acknowledged, across the whole stream. While
            the window is full the source is not pulled. Default 128.
        per_partition_in_flight: batches of one partition in flight at once (pipelining; the
            owner applies them in sequence order). Default 4; at most 64, the nodes' lane
            window (:data:`deltaflow.protocol.LANE_WINDOW`).
        retry_limit: resends of one batch after a retriable error before it fails. Default 16.
        retry_initial_backoff: seconds before the first resend; doubles each time, with
            jitter. Default 0.05.
        retry_max_backoff: cap on the wait between resends, seconds. Default 2.0.
        ack_timeout: seconds to wait for a batch's acknowledgement before treating the
            connection as lost and resending. Default 120.0 (a large commit can take a while).
        on_failure: what happens to a batch whose retries are exhausted: ``"fail"`` stops the
            stream and raises :class:`~deltaflow.errors.DataStreamerError` listing every item not
            applied; ``"fallback"`` writes its items, with the error, to ``dead_letter_table``
            and carries on; ``"drop"`` counts its items as failed in the summary, logs a
            warning and carries on.
        dead_letter_table: the Delta table failed items go to under ``"fallback"`` (and
            quarantined rows). Default ``"deltaflow_dead_letters"``.
        on_bad_row: for a ``table=`` stream, what becomes of a row that does not fit the table
            (a wrong type, a missing key or sequence, a column the table lacks): ``"fail"``
            (default) fails its whole batch, which then follows ``on_failure``;
            ``"quarantine"`` writes the row alone to ``dead_letter_table`` with its source
            position, key and reason, and the rest of its batch applies
            (``StreamSummary.items_quarantined`` counts them).
        stagger_pages: the first page of partition ``p`` (of the cluster's ``n``) is cut at
            ``page_size * (p + 1) // n`` items, later pages at ``page_size``. Keys hashed
            evenly fill every partition's buffer at one pace, so pages of one size all fall
            due at once: the window takes a burst and then nothing until the buffers fill
            again, and the nodes idle in turns. Staggered once, pages leave evenly spread for
            the rest of the stream. For streams that fill pages (bulk loads): acks come
            sooner and rows reach the table sooner, at the same rows/s. Not for streams whose
            pages are cut by ``auto_flush_interval``: their buffers are cut in step, and
            arrive together as one group per flush, which suits a table engine with a large
            fixed cost per commit (Spark) better. The cuts depend only on the items and their
            order, so a replay cuts the same batches. Default False.
        batch_creator: decides where partition buffers are cut into batches (see
            :class:`~deltaflow.client.accumulator.BatchCreator`); None cuts by
            ``page_size`` and ``max_batch_bytes``.
        result_buffer: per-item results held for a slow ``on_result`` before the stream slows
            down. Default 1024.
        source_buffer: items an Observable may emit ahead of the streamer. Default 1024.
        receiver_wait: a stream to a deployed receiver first checks that every live node
            serves it, and waits up to this many seconds while some do and some do not yet (a
            rolling restart that adds it); then it fails before taking any item from the
            source. A receiver no node serves fails at once (the nodes refuse it). 0: no
            wait. Default 30.
    """

    page_size: int = DEFAULT_PAGE_SIZE
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    auto_flush_interval: float = DEFAULT_AUTO_FLUSH_INTERVAL
    linger: float = 0.0
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    per_partition_in_flight: int = DEFAULT_PER_PARTITION_IN_FLIGHT
    retry_limit: int = DEFAULT_RETRY_LIMIT
    retry_initial_backoff: float = DEFAULT_RETRY_INITIAL_BACKOFF
    retry_max_backoff: float = DEFAULT_RETRY_MAX_BACKOFF
    ack_timeout: float = DEFAULT_ACK_TIMEOUT
    on_failure: FailurePolicy = "fail"
    dead_letter_table: str = DEFAULT_DEAD_LETTER_TABLE
    on_bad_row: BadRowPolicy = "fail"
    stagger_pages: bool = False
    batch_creator: BatchCreator | None = None
    result_buffer: int = DEFAULT_RESULT_BUFFER
    source_buffer: int = DEFAULT_SOURCE_BUFFER
    receiver_wait: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "page_size",
            "max_batch_bytes",
            "max_in_flight",
            "per_partition_in_flight",
            "result_buffer",
            "source_buffer",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"StreamerOptions.{name} must be a positive int, got {value!r}")
        if self.per_partition_in_flight > LANE_WINDOW:
            raise UsageError(
                f"StreamerOptions.per_partition_in_flight={self.per_partition_in_flight} is more "
                f"than a node takes of one partition at once; use at most {LANE_WINDOW} (the "
                "lane window)"
            )
        if self.max_batch_bytes > DEFAULT_MAX_FRAME_BYTES - 64 * 1024:
            raise UsageError(
                f"StreamerOptions.max_batch_bytes={self.max_batch_bytes} leaves no room under the "
                f"{DEFAULT_MAX_FRAME_BYTES}-byte frame limit; use at most "
                f"{DEFAULT_MAX_FRAME_BYTES - 64 * 1024}"
            )
        if not isinstance(self.retry_limit, int) or self.retry_limit < 0:
            raise UsageError(f"StreamerOptions.retry_limit must be >= 0, got {self.retry_limit!r}")
        for name in ("auto_flush_interval", "linger", "retry_initial_backoff", "retry_max_backoff"):
            if getattr(self, name) < 0:
                raise UsageError(f"StreamerOptions.{name} must be >= 0 seconds")
        if not isinstance(self.stagger_pages, bool):
            raise UsageError(
                f"StreamerOptions.stagger_pages must be True or False, got {self.stagger_pages!r}"
            )
        if self.receiver_wait < 0:
            raise UsageError("StreamerOptions.receiver_wait must be >= 0 seconds")
        if self.ack_timeout <= 0:
            raise UsageError("StreamerOptions.ack_timeout must be > 0 seconds")
        if (problem := table_name_problem(self.dead_letter_table)) is not None:
            raise UsageError(f"StreamerOptions.dead_letter_table: {problem}")
        if self.on_bad_row not in ("fail", "quarantine"):
            raise UsageError(
                "StreamerOptions.on_bad_row must be 'fail' or 'quarantine', got "
                f"{self.on_bad_row!r}"
            )
        if self.on_failure not in ("fail", "fallback", "drop"):
            raise UsageError(
                "StreamerOptions.on_failure must be 'fail', 'fallback' or 'drop', got "
                f"{self.on_failure!r}"
            )
