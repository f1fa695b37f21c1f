"""A node's table engine settings: the bounds of a group commit and of a table's queue, the
pace of commits, and the settings of the tables the node creates on first write. Each
default lives here once; the node's config and the CLI take theirs from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ..errors import UsageError
from .layout import DEFAULT_BUCKET_ROWS
from .mark_store import DEFAULT_RANDOM_RETENTION
from .settings import DEFAULT_BUCKETS, MAX_BUCKETS, TableSettings

__all__ = [
    "DEFAULT_COMPACT_INTERVAL",
    "DEFAULT_COMPACT_MIN_FILES",
    "DEFAULT_MAX_GROUP_BYTES",
    "DEFAULT_MAX_GROUP_ROWS",
    "DEFAULT_MAX_QUEUED_ROWS",
    "MAX_COMMIT_INTERVAL",
    "CompactionSettings",
    "EngineSettings",
]

DEFAULT_MAX_GROUP_ROWS: Final = 500_000
DEFAULT_MAX_GROUP_BYTES: Final = 256 * 1024 * 1024
DEFAULT_MAX_QUEUED_ROWS: Final = 1_000_000
#: The longest ``min_commit_interval`` (seconds): batches wait up to this for their commit.
MAX_COMMIT_INTERVAL: Final = 600.0
#: A bucket is compacted once it holds this many small files (``compact_min_files``) ...
DEFAULT_COMPACT_MIN_FILES: Final = 8
#: ... at most once per this many seconds per table (``compact_interval``).
DEFAULT_COMPACT_INTERVAL: Final = 30.0
#: The shortest ``random_marks_seconds``: longer than a client's resends of one batch last.
MIN_RANDOM_RETENTION: Final = 60.0


@dataclass(frozen=True, slots=True)
class CompactionSettings:
    """How a table's committer keeps the table's files in shape (:mod:`.commit.compaction`).

    Attributes:
        enabled: compact at all (``auto_compact``).
        min_files: small files one bucket must hold to be compacted.
        small_bytes: a file below this size is small.
        max_bytes: the most bytes of files one compaction reads.
        interval: seconds between two compactions of a table, at least.
    """

    enabled: bool = True
    min_files: int = DEFAULT_COMPACT_MIN_FILES
    small_bytes: int = 32 * 1024 * 1024
    max_bytes: int = 256 * 1024 * 1024
    interval: float = DEFAULT_COMPACT_INTERVAL

    def __post_init__(self) -> None:
        if self.min_files < 2 or self.interval <= 0:
            raise UsageError(
                f"compact_min_files must be at least 2 and compact_interval above 0, got "
                f"{self.min_files} and {self.interval!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """Checked settings of a table engine.

    Attributes:
        max_group_rows: rows per commit at most.
        max_group_bytes: Arrow bytes per commit at most.
        max_queued_rows: rows staged per table and not yet committed; staging waits beyond it
            (backpressure reaches the client through the unacknowledged window).
        min_commit_interval: seconds between the takes of two groups of one table, at least,
            unless a whole group is queued (fewer, larger commits at a steady rate, for a
            little latency). 0: a group is taken as soon as the previous commit ends.
        table_buckets: buckets of the keyed tables the node creates on first write (0: no
            bucket layout).
        table_bucket_rows: rows per bucket those tables' layout grows by (0: every bucket
            from the first row; :mod:`.layout`).
        schema_evolution: tables the node creates on first write allow schema evolution.
        deletion_vectors: tables the node creates on first write have deletion vectors.
        compaction: how the tables this node commits are compacted between commits.
        random_marks_seconds: seconds the node keeps the lane marks of a stream whose id the
            client made up after the lane's last commit (:mod:`.marks`); at least as long as a
            client may resend one batch.

    Raises:
        UsageError: a bound below 1, or a setting out of its range.
    """

    max_group_rows: int = DEFAULT_MAX_GROUP_ROWS
    max_group_bytes: int = DEFAULT_MAX_GROUP_BYTES
    max_queued_rows: int = DEFAULT_MAX_QUEUED_ROWS
    min_commit_interval: float = 0.0
    table_buckets: int = DEFAULT_BUCKETS
    table_bucket_rows: int = DEFAULT_BUCKET_ROWS
    schema_evolution: bool = False
    deletion_vectors: bool = False
    random_marks_seconds: float = DEFAULT_RANDOM_RETENTION
    compaction: CompactionSettings = CompactionSettings()

    def __post_init__(self) -> None:
        if min(self.max_group_rows, self.max_group_bytes, self.max_queued_rows) < 1:
            raise UsageError("max_group_rows, max_group_bytes and max_queued_rows must be >= 1")
        if not 0 <= self.min_commit_interval <= MAX_COMMIT_INTERVAL:
            raise UsageError(
                f"min_commit_interval must be between 0 and {MAX_COMMIT_INTERVAL:g} seconds, "
                f"got {self.min_commit_interval!r}"
            )
        if not 0 <= self.table_buckets <= MAX_BUCKETS:
            raise UsageError(f"table_buckets must be between 0 and {MAX_BUCKETS}")
        if self.table_bucket_rows < 0:
            raise UsageError("table_bucket_rows must be 0 or more")
        if not self.random_marks_seconds >= MIN_RANDOM_RETENTION:
            raise UsageError(
                f"random_marks_seconds must be at least {MIN_RANDOM_RETENTION:g} (a client "
                f"resends a batch for longer), got {self.random_marks_seconds!r}"
            )

    @property
    def group_rows(self) -> int:
        """The rows that make a whole group: a queue can hold no more than its bound."""
        return min(self.max_group_rows, self.max_queued_rows)

    def new_table(self, key: tuple[str, ...], sequence_by: tuple[str, ...] = ()) -> TableSettings:
        """The settings of a table the node creates on first write with ``key`` (and the
        sequence columns the writes name)."""
        return TableSettings(
            key=key,
            buckets=self.table_buckets if key else 0,
            bucket_rows=self.table_bucket_rows if key and self.table_buckets else 0,
            schema_evolution=self.schema_evolution,
            deletion_vectors=self.deletion_vectors,
            sequence_by=sequence_by,
        )
