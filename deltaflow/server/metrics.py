"""Prometheus metrics of a node, served at ``GET /metrics`` (see docs/configuration.md).

Nothing is counted here: at each scrape :class:`NodeCollector` reads the node's
``statistics()`` snapshot and turns it into metric families, so the hot path pays nothing for
metrics beyond the counters it keeps anyway. Each node registers its collector in a registry of
its own (never prometheus-client's global one), as several nodes may share a process; every
sample carries a ``node`` label.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from ..tables.statistics import Histogram
from .statistics import NodeStatistics

__all__ = ["NodeCollector"]


class NodeCollector:
    """A prometheus-client collector of one node's metrics.

    Args:
        statistics: returns the node's current snapshot (``Node.statistics``); called once per
            scrape, on the event loop. The collector knows nothing else of the node.
    """

    def __init__(self, statistics: Callable[[], NodeStatistics]) -> None:
        self._statistics = statistics

    def collect(self) -> Iterator[Metric]:
        """Every metric of the node, read from one statistics snapshot."""
        stats = self._statistics()
        node = stats.node_id
        d, e = stats.dispatcher, stats.engine

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["node"])
            family.add_metric([node], value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["node"])
            family.add_metric([node], value)
            return family

        # Counters (prometheus-client appends the ``_total`` suffix).
        yield counter(
            "deltaflow_batches_received", "Batch frames received from clients.", d.batches_received
        )
        yield counter(
            "deltaflow_batches_acked", "Batches applied and acknowledged.", d.batches_acked
        )
        yield counter(
            "deltaflow_batches_failed",
            "Batches that failed for good in their receiver or commit.",
            d.batches_failed,
        )
        yield counter(
            "deltaflow_batches_duplicate",
            "Resent batches answered from the earlier result, not applied again.",
            d.duplicates,
        )
        yield counter(
            "deltaflow_items_applied", "Items of acknowledged batches applied.", d.items_applied
        )
        yield counter(
            "deltaflow_items_failed",
            "Items of acknowledged batches their receiver marked failed.",
            d.items_failed,
        )
        yield counter(
            "deltaflow_node_retries",
            "Receiver runs retried on this node after a retriable error.",
            d.node_retries,
        )
        yield counter("deltaflow_commits", "Delta commits of grouped batches.", e.commits)
        yield counter("deltaflow_rows_committed", "Rows written by commits.", e.rows_committed)
        yield counter(
            "deltaflow_batches_committed", "Batches made durable by commits.", e.batches_committed
        )
        yield counter(
            "deltaflow_batches_deduplicated",
            "Batches a commit skipped because the table already held them (exactly-once).",
            e.batches_deduplicated,
        )
        yield counter(
            "deltaflow_commit_conflicts",
            "Commits that conflicted with another writer's and were retried.",
            e.commit_conflicts,
        )
        yield counter(
            "deltaflow_combined_commits",
            "Versions this node committed as a table's committer, each holding prepared groups.",
            e.combined_commits,
        )
        yield counter(
            "deltaflow_combined_groups",
            "Prepared groups in those versions (groups per version: this over the commits).",
            e.combined_groups,
        )
        yield counter(
            "deltaflow_combined_commit_seconds",
            "Time the committer spent in those commits.",
            e.combined_seconds,
        )
        yield counter(
            "deltaflow_combined_commits_in_doubt",
            "Combined commits whose write failed without an answer (it may have landed): "
            "their groups were sent back to be checked against the marks.",
            e.commits_in_doubt,
        )
        yield counter(
            "deltaflow_groups_prepared",
            "Groups this node prepared and sent to a table's committer.",
            e.groups_prepared,
        )
        yield counter(
            "deltaflow_groups_sent_back",
            "Prepared groups a committer sent back to be prepared again (the table changed).",
            e.groups_sent_back,
        )
        yield counter(
            "deltaflow_tables_created", "Tables created on first write.", e.tables_created
        )
        yield counter(
            "deltaflow_table_creation_races",
            "Tables another node created while this one was creating them (once per table).",
            e.creation_races,
        )
        yield counter(
            "deltaflow_columns_added", "Columns added by schema evolution.", e.columns_added
        )
        yield counter(
            "deltaflow_changes_superseded",
            "Changes to sequence_by tables not applied: the table held a newer change of the key.",
            e.changes_superseded,
        )
        yield counter(
            "deltaflow_checkpoints",
            "Delta checkpoints written (after their commit, outside the table lock).",
            e.checkpoints,
        )
        yield counter(
            "deltaflow_checkpoint_seconds",
            "Time spent writing those checkpoints.",
            e.checkpoint_seconds,
        )

        yield gauge("deltaflow_streams", "Streams open on this node.", d.streams)
        yield gauge(
            "deltaflow_connections", "Open client connections (WebSockets).", stats.connections
        )
        yield gauge(
            "deltaflow_owned_partitions",
            "Partitions this node owns in its partition map.",
            stats.owned_partitions,
        )
        yield gauge(
            "deltaflow_partition_map_version",
            "Version of this node's partition map.",
            stats.map_version,
        )
        yield gauge(
            "deltaflow_queued_rows", "Rows staged and not yet committed, all tables.", e.queued_rows
        )
        yield gauge(
            "deltaflow_largest_group_rows",
            "Rows of the largest commit so far.",
            e.largest_group_rows,
        )
        state = GaugeMetricFamily(
            "deltaflow_node_state",
            "The node's state (the sample's state label).",
            labels=["node", "state"],
        )
        state.add_metric([node, stats.state], 1)
        yield state

        version = GaugeMetricFamily(
            "deltaflow_side_input_version",
            "Version of the side input this node serves (0: none yet).",
            labels=["node", "side_input"],
        )
        leader = GaugeMetricFamily(
            "deltaflow_side_input_leader",
            "1 if this node holds the side input's lease (and retrieves it), else 0.",
            labels=["node", "side_input"],
        )
        retrievals = CounterMetricFamily(
            "deltaflow_side_input_retrievals",
            "retrieve() calls on this node, by outcome: published (a new version), declined "
            "(None), unchanged (same bytes) or failed (raised, timed out or a bad value).",
            labels=["node", "side_input", "outcome"],
        )
        for side in stats.side_inputs:
            version.add_metric([node, side.name], side.version)
            leader.add_metric([node, side.name], 1 if side.is_leader else 0)
            for outcome, count in (
                ("published", side.published),
                ("declined", side.declined),
                ("unchanged", side.unchanged),
                ("failed", side.failures),
            ):
                retrievals.add_metric([node, side.name, outcome], count)
        yield version
        yield leader
        yield retrievals

        yield from _per_table(node, stats)
        yield from _per_receiver(node, stats)

        yield _histogram(
            "deltaflow_commit_seconds",
            "Duration of each commit, seconds.",
            node,
            e.commit_seconds_histogram,
        )
        yield _histogram(
            "deltaflow_group_rows", "Rows of each commit.", node, e.group_rows_histogram
        )
        yield _histogram(
            "deltaflow_batch_durable_seconds",
            "Seconds from a batch staged on this node to the commit holding it landing "
            "(waiting for the commit in progress and the table lock, then its own commit).",
            node,
            e.batch_durable_seconds_histogram,
        )
        stages = HistogramMetricFamily(
            "deltaflow_batch_stage_seconds",
            "Seconds each batch spent on this node, by stage: queued (staged, until its group "
            "was taken off the table's queue), committing (from then until the commit landed), "
            "node (from its frame read to its ack queued: the lane's wait, the receiver, its "
            "commits).",
            labels=["node", "stage"],
        )
        _observe(stages, [node, "queued"], e.batch_queued_seconds_histogram)
        _observe(stages, [node, "committing"], e.batch_committing_seconds_histogram)
        _observe(stages, [node, "node"], d.batch_seconds_histogram)
        yield stages


def _histogram(name: str, doc: str, node: str, histogram: Histogram) -> HistogramMetricFamily:
    """``histogram`` (counts per bucket) as a metric family (cumulative counts per bound)."""
    family = HistogramMetricFamily(name, doc, labels=["node"])
    _observe(family, [node], histogram)
    return family


def _observe(family: HistogramMetricFamily, labels: list[str], histogram: Histogram) -> None:
    bounds = [*map(floatToGoString, histogram.bounds), "+Inf"]
    cumulative = itertools.accumulate(histogram.counts)
    family.add_metric(labels, list(zip(bounds, cumulative, strict=True)), histogram.sum)


#: Per-table counters: (metric name, help, TableStatistics attribute).
TABLE_COUNTERS: Final = (
    ("deltaflow_table_commits", "Groups of this node's batches that landed in the table.",
     "commits"),
    ("deltaflow_table_rows_committed", "Rows of this node's batches committed to the table.",
     "rows_committed"),
    ("deltaflow_table_batches_committed", "Batches made durable in the table.",
     "batches_committed"),
    ("deltaflow_table_batches_failed", "Batches whose commit to the table failed for good.",
     "batches_failed"),
    ("deltaflow_table_batches_deduplicated",
     "Batches the table held already (a resend or a replay): not written again.",
     "batches_deduplicated"),
    ("deltaflow_table_commit_conflicts",
     "Commits that lost the race for their version and were tried again.", "commit_conflicts"),
    ("deltaflow_table_combined_commits",
     "Versions this node committed as the table's committer.", "combined_commits"),
    ("deltaflow_table_compactions", "Compactions this node committed as the table's "
     "committer.", "compactions"),
    ("deltaflow_table_compacted_files", "Files those compactions rewrote.", "compacted_files"),
    ("deltaflow_table_compacted_bytes", "Bytes of the files those compactions rewrote.",
     "compacted_bytes"),
    ("deltaflow_table_compactions_dropped", "Compactions dropped because a writer's group "
     "replaced one of their files first.", "compactions_dropped"),
    ("deltaflow_table_groups_sent_back_by_compaction", "Writers' groups sent back to be "
     "prepared again because a compaction replaced one of their files.",
     "groups_sent_back_by_compaction"),
)  # fmt: skip
TABLE_GAUGES: Final = (
    ("deltaflow_table_queued_rows", "Rows staged for the table, not yet taken for a commit.",
     "queued_rows"),
    ("deltaflow_table_in_flight_batches", "Batches staged for the table and not yet settled.",
     "in_flight_batches"),
    ("deltaflow_table_last_commit_timestamp_seconds",
     "When this node's rows last landed in the table (Unix time; 0: never).", "last_commit_at"),
    ("deltaflow_table_live_files", "The table's live files, as its committer last counted "
     "them (0 on nodes that do not commit it).", "live_files"),
    ("deltaflow_table_last_compaction_timestamp_seconds", "When this node last compacted the "
     "table (Unix time; 0: never).", "last_compacted_at"),
)  # fmt: skip
TABLE_HISTOGRAMS: Final = (
    ("deltaflow_table_commit_seconds", "Seconds each commit of this node's rows took.",
     "commit_seconds_histogram"),
    ("deltaflow_table_rows_per_commit", "Rows of each commit of this node's rows.",
     "group_rows_histogram"),
    ("deltaflow_table_time_to_table_seconds",
     "Seconds from a batch staged on this node to the commit holding it landing.",
     "batch_durable_seconds_histogram"),
)  # fmt: skip
RECEIVER_COUNTERS: Final = (
    ("deltaflow_receiver_batches_acked", "Batches the receiver applied, acknowledged.",
     "batches_acked"),
    ("deltaflow_receiver_batches_failed", "Batches that failed for good in the receiver or "
     "their commit.", "batches_failed"),
    ("deltaflow_receiver_items_applied", "Items of acknowledged batches applied.",
     "items_applied"),
    ("deltaflow_receiver_items_failed", "Items the receiver marked failed (dead-lettered or "
     "quarantined by the client).", "items_failed"),
)  # fmt: skip


def _labelled(
    node: str,
    label: str,
    items: list[tuple[str, Any]],
    specs: tuple[tuple[str, str, str], ...],
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
) -> Iterator[Metric]:
    """One family per (name, help, attribute) of ``specs``, a sample per item of ``items``."""
    for name, doc, attribute in specs:
        family = kind(name, doc, labels=["node", label])
        for value, counted in items:
            family.add_metric([node, value], getattr(counted, attribute))
        yield family


def _per_table(node: str, stats: NodeStatistics) -> Iterator[Metric]:
    """The ``deltaflow_table_*`` families: one sample per table this node wrote."""
    tables = sorted(stats.engine.tables.items())
    yield from _labelled(node, "table", tables, TABLE_COUNTERS, CounterMetricFamily)
    yield from _labelled(node, "table", tables, TABLE_GAUGES, GaugeMetricFamily)
    labels = ["node", "table"]
    version = GaugeMetricFamily(
        "deltaflow_table_version",
        "The latest version known to hold this node's rows.",
        labels=labels,
    )
    for table, counted in tables:
        if counted.last_version is not None:
            version.add_metric([node, table], counted.last_version)
    yield version
    for name, doc, attribute in TABLE_HISTOGRAMS:
        histogram = HistogramMetricFamily(name, doc, labels=labels)
        for table, counted in tables:
            _observe(histogram, [node, table], getattr(counted, attribute))
        yield histogram


def _per_receiver(node: str, stats: NodeStatistics) -> Iterator[Metric]:
    """The ``deltaflow_receiver_*`` families, and the error frames sent by code."""
    receivers = sorted(stats.dispatcher.receivers.items())
    labels = ["node", "receiver"]
    yield from _labelled(node, "receiver", receivers, RECEIVER_COUNTERS, CounterMetricFamily)
    running = GaugeMetricFamily(
        "deltaflow_receiver_running_batches", "Batches in the receiver now.", labels=labels
    )
    for receiver, counted in receivers:
        running.add_metric([node, receiver], counted.running)
    yield running
    errors = CounterMetricFamily(
        "deltaflow_errors",
        "Error frames this node sent to clients, by code (docs/protocol.md).",
        labels=["node", "code"],
    )
    for code, count in sorted(stats.dispatcher.errors.items()):
        errors.add_metric([node, code], count)
    yield errors
