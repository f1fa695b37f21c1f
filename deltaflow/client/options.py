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
    """How a stream is batched, windowed and retried: ``stream_data(..., options=...)``.

    Every field has a default; a bad value raises :class:`~deltaflow.errors.UsageError` when
    the options are built. Durations are in seconds, sizes in bytes.

    Attributes:
        page_size: items. A partition's buffer is cut into a batch when it holds this many.
            Default 1000 (as Ignite 3).
        max_batch_bytes: bytes of packed items. A buffer is cut before an item would push it
            past this; an item larger than this fails the stream. Default 4 MiB (4,194,304);
            at most 16 MiB - 64 KiB (16,711,680), under the nodes' frame limit.
        auto_flush_interval: seconds. A buffer is cut this long after its first item, even if
            it is not full; 0 turns the timer off. Default 5.0 (as Ignite 3).
        linger: seconds. Once the source has been idle this long (the stream waiting for its
            next item), every partly filled buffer is sent, as Kafka's ``linger.ms``. Checked
            every ``linger`` seconds, so a trickle reaches the nodes within about two lingers
            rather than ``auto_flush_interval``; a source that keeps the stream busy still
            fills whole pages. The batches it cuts depend on timing, so leave it off for a
            replayable ``stream_id``. Default 0: off.
        max_in_flight: batches outstanding across the whole stream. While the window is full,
            the source is not pulled. Default 128.
        per_partition_in_flight: batches of one partition on the wire at once (pipelining; the
            owner applies them in sequence order). Default 4; at most 64, the nodes' lane
            window (:data:`deltaflow.protocol.LANE_WINDOW`).
        retry_limit: resends of one batch after retriable errors before it fails; 0: no
            resend. Default 16.
        retry_initial_backoff: seconds before the first resend. The wait doubles with each
            resend, and a random jitter of 0 to this value is added each time. Default 0.05.
        retry_max_backoff: seconds: the cap on the doubling part of the wait (the jitter comes
            on top). Default 2.0.
        ack_timeout: seconds to wait for a batch's acknowledgement before the batch counts as
            lost and is resent (a large commit can take a while). Each such batch is logged at
            WARNING with its node, stream, partition, batch, attempt and ``base``; a node logs
            at INFO (``-v``) the batches of a lane that have waited 5 s for one that has not
            reached it. Default 120.0.
        on_failure: what happens to a batch that fails for good (a non-retriable error, or
            ``retry_limit`` exhausted). ``"fail"`` (default): the stream stops and raises
            :class:`~deltaflow.errors.DataStreamerError`, whose ``failed_items`` lists every
            item not applied. ``"fallback"``: its items, with the error, are written to
            ``dead_letter_table``, counted in ``StreamSummary.items_dead_lettered``, and the
            stream goes on. ``"drop"``: its items are counted in
            ``StreamSummary.items_failed``, a warning is logged, and the stream goes on. Under
            ``"fallback"`` and ``"drop"`` the later batches of the same partition are still
            applied, in order (``docs/guarantees.md``, "At-least-once, with the exact list of
            failed items").
        dead_letter_table: a table name: the Delta table, in the nodes' warehouse, that
            ``"fallback"`` (and ``on_bad_row="quarantine"``) writes failed items to; its
            columns are in ``docs/guarantees.md`` ("The dead-letter table"). A name that cannot
            name a table raises :class:`~deltaflow.errors.UsageError` when the options are
            built. Default ``"deltaflow_dead_letters"``.
        on_bad_row: for a ``table=`` stream, a row that does not fit the table (a wrong type, a
            missing key or sequence, a column the table lacks). ``"fail"`` (default): its whole
            batch fails and follows ``on_failure``. ``"quarantine"``: the row alone is written
            to ``dead_letter_table`` with its source position, key and reason (its ``error``
            column), and the rest of its batch applies in the same commit; counted in
            ``StreamSummary.items_quarantined`` (and ``items_dead_lettered``). A stream with a
            ``receiver=`` refuses it (``docs/cdc.md``, "Appends and bad rows").
        stagger_pages: True: the first page of partition ``p`` (of the cluster's ``n``) is cut
            at ``page_size * (p + 1) // n`` items, later ones at ``page_size``, so that the
            pages of evenly hashed keys leave spread out instead of all at once (see
            "Staggered first pages" below). False (default): every page holds ``page_size``
            items (or ``max_batch_bytes``). Applies to the default cutting, not to a
            ``batch_creator``.
        batch_creator: a :class:`~deltaflow.client.BatchCreator`: decides where a partition's
            buffer is cut into batches. None (default):
            ``SizeBatchCreator(page_size, max_batch_bytes)``.
        result_buffer: results held for a slow ``on_result`` before the connection's reader
            waits. Default 1024.
        source_buffer: items an Observable may emit ahead of the streamer. Default 1024.
        receiver_wait: seconds. A stream to a deployed receiver first checks that every live
            node serves it, and waits up to this long while some do and some do not yet (a
            rolling restart that adds it); then it fails before taking any item from the
            source. A receiver no node serves is refused by the nodes at once. 0: no wait.
            Default 30 (``docs/receivers.md``, "Registering a receiver: the allow-list").

    Raises:
        UsageError: ``page_size``, ``max_batch_bytes``, ``max_in_flight``,
            ``per_partition_in_flight``, ``result_buffer`` or ``source_buffer`` is not a
            positive int; ``retry_limit`` is not an int >= 0; a backoff,
            ``auto_flush_interval``, ``linger`` or ``receiver_wait`` is negative;
            ``ack_timeout`` is not > 0; ``on_failure`` is not one of its three values,
            ``on_bad_row`` not ``"fail"`` or ``"quarantine"``, ``stagger_pages`` not a bool.

    Retries and failover:
        With the defaults, the waits before resends 1, 2, 3 ... are about 0.05, 0.1, 0.2,
        0.4, 0.8 and 1.6 s, then 2.0 s each, plus jitter. A batch that only ever meets
        retriable errors therefore fails after roughly 23 s of waiting in total, plus the
        time of its 17 attempts. This budget must cover a failover: a batch whose node died
        is resent until the survivors have noticed, which takes about the nodes'
        ``failure_timeout`` (3 s by default; ``docs/cluster.md``, "Failover step by step").
        With a larger ``failure_timeout``, raise ``retry_limit`` or ``retry_max_backoff``.

    Window and group size:
        Under load a node's group for a table is about the rows the client has in flight:
        ``max_in_flight`` x ``page_size``, at most ``per_partition_in_flight`` batches per
        partition (128,000 rows with the defaults). Spark's MERGE has a fixed cost per
        commit, so for a high-volume stream into the Spark engine raise both
        (``max_in_flight=512, per_partition_in_flight=16``), and size ``max_batch_bytes`` so
        the client's memory stays acceptable (it holds up to ``max_in_flight`` batches, each
        item twice). With delta-rs keep about the defaults: a larger window only adds
        queueing.

    Pages for bulk streams:
        Each batch costs a node about the same CPU whatever its size. For a high-volume
        stream, above all from an Arrow source, send the rows in flight in fewer, larger,
        staggered pages: ``page_size=4000, max_in_flight=32, per_partition_in_flight=2,
        stagger_pages=True``. Throughput rises and acks come sooner; the price is a row's
        wait in its partition's buffer before the send, so take larger pages for throughput
        and the defaults (or smaller pages and ``linger``) for latency. A dict source gains
        little: its client is the bottleneck.

    Staggered first pages:
        Keys hashed evenly fill every partition's buffer at one pace, so pages of one size
        fall due together: the window takes a burst, then the nodes idle while the client
        refills it. ``stagger_pages=True`` cuts partition ``p``'s first page at
        ``(p + 1) / n`` of ``page_size``; from then on pages leave evenly spread, and acks
        and time to table shorten at the same rows/s. It is off by default because it does
        not suit a stream whose pages are cut by ``auto_flush_interval``: there, buffers cut
        together reach a node as one group per flush (which suits a table engine with a
        large fixed cost per commit, Spark, better), and staggered timers make pages trickle
        in and wait for the commit in progress. The cuts depend only on the items and their
        order, so a replay cuts the same batches either way.

    The figures behind this advice are in ``bench/README.md`` ("The client's window and
    pages").
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
