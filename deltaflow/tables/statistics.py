"""A table engine's counters, and the histograms its metrics are exported from."""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "BATCH_DURABLE_BUCKETS",
    "COMMIT_SECONDS_BUCKETS",
    "GROUP_ROWS_BUCKETS",
    "MAX_TABLES",
    "OTHER_TABLES",
    "EngineStatistics",
    "Histogram",
    "TableStatistics",
    "table_statistics",
]

#: Upper bounds of the buckets of ``EngineStatistics.commit_seconds_histogram``, seconds.
COMMIT_SECONDS_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Upper bounds of the buckets of ``EngineStatistics.batch_durable_seconds_histogram``:
#: finer than a commit's around the tenths of a second where a loaded node's batches wait.
# fmt: off
BATCH_DURABLE_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
    60.0,
)
# fmt: on
#: Upper bounds of the buckets of ``EngineStatistics.group_rows_histogram``, rows.
GROUP_ROWS_BUCKETS: Final = (1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6)


@dataclass(frozen=True, slots=True)
class Histogram:
    """Observations counted in buckets, as a Prometheus histogram counts them.

    Immutable, so a copied :class:`EngineStatistics` is a true snapshot: :meth:`observe`
    returns a new histogram.

    Attributes:
        bounds: the buckets' inclusive upper bounds, ascending; one unbounded bucket follows.
        counts: observations per bucket (not cumulative), ``len(bounds) + 1`` of them.
        sum: the sum of every observation.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0

    @classmethod
    def empty(cls, bounds: Sequence[float]) -> Histogram:
        """A histogram with the buckets ``bounds`` and no observation."""
        return cls(tuple(bounds), (0,) * (len(bounds) + 1))

    @property
    def count(self) -> int:
        """The number of observations."""
        return sum(self.counts)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1), interpolated within its bucket as Prometheus's
        ``histogram_quantile`` does; None without observations. Past the last bound: that
        bound."""
        total = self.count
        if not total:
            return None
        rank, seen, lower = q * total, 0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            if count and seen + count >= rank:
                return lower + (bound - lower) * (rank - seen) / count
            seen += count
            lower = bound
        return self.bounds[-1] if self.bounds else None

    def observe(self, value: float) -> Histogram:
        """This histogram with ``value`` counted in the first bucket whose bound is >= it."""
        counts = list(self.counts)
        counts[bisect.bisect_left(self.bounds, value)] += 1
        return Histogram(self.bounds, tuple(counts), self.sum + value)


@dataclass(slots=True)
class CommitCounters:
    """What a node counts of its commits, in all (:class:`EngineStatistics`) and per table
    (:class:`TableStatistics`): groups of its batches landed, their rows and batches, batches
    failed and deduplicated, version races lost, versions committed as a table's committer,
    rows queued. Per commit its duration in seconds (its preparation outside the table lock
    included, the wait for the lock not) and its rows (0 when every batch was a duplicate);
    per committed batch the seconds from its staging to its commit landing (the wait for the
    commit in progress, for the table's lock, and its own commit)."""

    commits: int = 0
    rows_committed: int = 0
    batches_committed: int = 0
    batches_failed: int = 0
    batches_deduplicated: int = 0
    commit_conflicts: int = 0
    combined_commits: int = 0
    queued_rows: int = 0
    commit_seconds_histogram: Histogram = dataclasses.field(
        default_factory=lambda: Histogram.empty(COMMIT_SECONDS_BUCKETS)
    )
    group_rows_histogram: Histogram = dataclasses.field(
        default_factory=lambda: Histogram.empty(GROUP_ROWS_BUCKETS)
    )
    batch_durable_seconds_histogram: Histogram = dataclasses.field(
        default_factory=lambda: Histogram.empty(BATCH_DURABLE_BUCKETS)
    )


@dataclass(slots=True)
class EngineStatistics(CommitCounters):
    """Counters of a node's table engine (typed snapshot, see ``Node.statistics()``)."""

    largest_group_rows: int = 0
    commit_seconds: float = 0.0
    #: As a table's committer: the groups in its combined versions, and the seconds their
    #: commits took.
    combined_groups: int = 0
    combined_seconds: float = 0.0
    commits_in_doubt: int = 0
    #: As a writer: groups prepared for a committer, and those it sent back to be prepared
    #: again (the table changed under them).
    groups_prepared: int = 0
    groups_sent_back: int = 0
    tables_created: int = 0
    #: Tables another node created while this one was creating them (its rows then went to
    #: the committer): a race once per table, not one for a version.
    creation_races: int = 0
    columns_added: int = 0
    #: Changes of ``sequence_by`` tables not applied because the table held a change of the
    #: key with a sequence at least as high (a row, or a delete's tombstone): late arrivals.
    changes_superseded: int = 0
    #: Per committed batch, the two halves of ``batch_durable_seconds_histogram``: from its
    #: staging until its group was taken off the table's queue (the wait for the commit in
    #: progress, and for a held receiver), and from then until the commit landed.
    batch_queued_seconds_histogram: Histogram = dataclasses.field(
        default_factory=lambda: Histogram.empty(BATCH_DURABLE_BUCKETS)
    )
    batch_committing_seconds_histogram: Histogram = dataclasses.field(
        default_factory=lambda: Histogram.empty(BATCH_DURABLE_BUCKETS)
    )
    checkpoints: int = 0  # Delta checkpoints written, after the commit, outside the lock
    checkpoint_seconds: float = 0.0
    #: Per table (live; :meth:`snapshot` copies them).
    tables: dict[str, TableStatistics] = dataclasses.field(default_factory=dict)

    def table(self, name: str) -> TableStatistics:
        """Table ``name``'s counters, made on first use."""
        return table_statistics(self.tables, name)

    def snapshot(self) -> EngineStatistics:
        """A copy that later counting does not change."""
        copy = dataclasses.replace(self)
        copy.tables = {
            name: dataclasses.replace(t, recent=collections.deque(t.recent, RECENT_COMMITS))
            for name, t in self.tables.items()
        }
        return copy


#: Most tables whose metrics a node keeps apart; commits to further tables are counted under
#: :data:`OTHER_TABLES` (a metric label per table, and a client names the tables).
MAX_TABLES: Final = 500
#: Commits per table kept for the status page.
RECENT_COMMITS: Final = 60
OTHER_TABLES: Final = "_other"


@dataclass(slots=True)
class TableStatistics(CommitCounters):
    """One table's counters on one node: what ``deltaflow_table_*`` metrics export.

    Attributes:
        commits: groups of this node's batches that landed (committed here or through the
            table's committer).
        rows_committed: rows in them; batches_committed: batches in them.
        batches_failed: batches whose commit failed for good.
        batches_deduplicated: batches the table held already (a resend or a replay).
        commit_conflicts: commits that lost the race for their version and were retried.
        combined_commits: versions this node committed as the table's committer.
        queued_rows: rows staged and not yet taken for a commit.
        in_flight_batches: batches staged and not yet settled.
        last_version: the latest version known to hold this node's rows (None: not known).
        last_commit_at: when (Unix seconds) this node's rows last landed; 0: never.
    """

    in_flight_batches: int = 0
    last_version: int | None = None
    last_commit_at: float = 0.0
    #: As the table's committer: its live files when last counted, the compactions it
    #: committed (files and bytes they rewrote, when the last landed), the ones dropped (a
    #: writer's group replaced a file first) and the writers' groups sent back because a
    #: compaction replaced one of their files.
    live_files: int = 0
    compactions: int = 0
    compacted_files: int = 0
    compacted_bytes: int = 0
    compactions_dropped: int = 0
    groups_sent_back_by_compaction: int = 0
    last_compacted_at: float = 0.0
    #: The latest commits of this node's rows: (Unix time, rows, batches, seconds, version).
    recent: collections.deque[tuple[float, int, int, float, int | None]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECENT_COMMITS)
    )


def table_statistics(tables: dict[str, TableStatistics], name: str) -> TableStatistics:
    """The counters of table ``name`` in ``tables``, made on first use (beyond
    :data:`MAX_TABLES` tables, the shared :data:`OTHER_TABLES` ones)."""
    found = tables.get(name)
    if found is None:
        if len(tables) >= MAX_TABLES:
            name = OTHER_TABLES
        found = tables.setdefault(name, TableStatistics())
    return found
