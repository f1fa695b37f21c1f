"""Snapshots of a node's counters: what ``Node.statistics()`` returns and ``/metrics`` reads.

Plain data, so the modules that fill them (dispatcher, side inputs, node) and the one that
reads them (metrics) depend on this module, not on each other.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Final

from ..tables.statistics import BATCH_DURABLE_BUCKETS, EngineStatistics, Histogram

__all__ = [
    "DispatcherStatistics",
    "NodeStatistics",
    "ReceiverStatistics",
    "SideInputStatistics",
]


#: Errors kept for the status page.
RECENT_ERRORS: Final = 20


@dataclass(slots=True)
class ReceiverStatistics:
    """One receiver's counters on a node (its name is on the node's allow-list).

    Attributes:
        batches_acked: batches it applied, acknowledged.
        batches_failed: batches that failed for good in it or in their commit.
        items_applied: items of acknowledged batches applied.
        items_failed: items it marked failed (``ctx.fail``): dead-lettered or quarantined by
            the client, as its options say.
        running: batches in its ``receive`` now.
    """

    batches_acked: int = 0
    batches_failed: int = 0
    items_applied: int = 0
    items_failed: int = 0
    running: int = 0


@dataclass(slots=True)
class DispatcherStatistics:
    """The dispatcher's counters (live: the dispatcher updates them in place)."""

    streams: int = 0
    batches_received: int = 0
    batches_acked: int = 0
    batches_failed: int = 0
    duplicates: int = 0
    items_applied: int = 0
    items_failed: int = 0
    node_retries: int = 0
    #: Per acknowledged batch: seconds from its frame read to its ack queued (the lane's wait
    #: for the batches before it, its receiver, and the commits of its writes).
    batch_seconds_histogram: Histogram = field(
        default_factory=lambda: Histogram.empty(BATCH_DURABLE_BUCKETS)
    )
    #: Per receiver, by class name; and the error frames sent, by code.
    receivers: dict[str, ReceiverStatistics] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    #: The latest errors sent: (Unix time, code, message).
    recent_errors: deque[tuple[float, str, str]] = field(
        default_factory=lambda: deque(maxlen=RECENT_ERRORS)
    )

    def count_error(self, code: str, message: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        message = message.removeprefix(f"[{code}] ")  # the code has a column of its own
        self.recent_errors.append((time.time(), code, message[:300]))

    def time_batch(self, received_at: float) -> None:
        """Count an acknowledged batch's time on the node, from ``received_at`` (monotonic)."""
        spent = time.monotonic() - received_at
        self.batch_seconds_histogram = self.batch_seconds_histogram.observe(spent)

    def receiver(self, name: str) -> ReceiverStatistics:
        return self.receivers.setdefault(name, ReceiverStatistics())

    def snapshot(self) -> DispatcherStatistics:
        """A copy that later counting does not change."""
        copy = replace(self)
        copy.receivers = {name: replace(r) for name, r in self.receivers.items()}
        copy.errors = dict(self.errors)
        copy.recent_errors = deque(self.recent_errors, RECENT_ERRORS)
        return copy


@dataclass(frozen=True, slots=True, kw_only=True)
class SideInputStatistics:
    """A snapshot of one side input on one node.

    Attributes:
        name: the side input's name.
        version: the version this node serves; 0 before it has a value.
        leader: the node id holding the lease at this node's last look; None if none.
        is_leader: whether this node holds the lease (and so runs the retrievals).
        retrievals: ``retrieve()`` calls on this node.
        published: retrievals that made a new version.
        declined: retrievals that returned None (no new version).
        unchanged: retrievals that returned the current value's bytes (no new version).
        failures: retrievals that raised, timed out, or returned a bad value.
        last_error: the latest failure on this node, if any.
    """

    name: str
    version: int
    leader: str | None
    is_leader: bool
    retrievals: int
    published: int
    declined: int
    unchanged: int
    failures: int
    last_error: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStatistics:
    """A snapshot of a node's counters."""

    node_id: str
    state: str
    connections: int
    map_version: int
    owned_partitions: int
    dispatcher: DispatcherStatistics
    engine: EngineStatistics
    side_inputs: tuple[SideInputStatistics, ...] = ()
