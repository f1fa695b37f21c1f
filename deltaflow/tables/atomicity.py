"""The commit-atomicity seam: how every commit deltaflow makes to a table is made atomic with
respect to every other writer, and so exactly-once.

A commit to a Delta table is a read-modify-write of its log: read the latest version and the
lane marks it holds, drop the batches already applied, write version + 1. Two writers doing
that at once could both write the same version (one silently lost) or both apply a batch.
Whatever a warehouse is, one object decides how that cannot happen: :class:`CommitAtomicity`,
asked for by :func:`atomicity_for`. The committer, table creation and maintenance all hold it
around their read-modify-write; nothing else knows how it works.

Today a warehouse is a local directory (or a shared filesystem with working ``flock``), and
atomicity is a cross-process file lock per table (:class:`LocalTableLocks`, on
:mod:`.flock`): Spark's Delta on ``file:`` paths makes a commit file's put-if-absent atomic only
inside one JVM, so the lock is what serialises two node processes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Protocol

from .flock import table_lock

__all__ = ["CommitAtomicity", "LocalTableLocks", "atomicity_for"]

#: How long a commit waits for another writer's commit to the same table, seconds.
DEFAULT_COMMIT_WAIT = 600.0


class CommitAtomicity(Protocol):
    """Makes the read-modify-write of one table's log exclusive among all its writers."""

    def hold(
        self, table: str, *, released_at: float | None = None
    ) -> contextlib.AbstractContextManager[float]:
        """A context manager inside which the caller alone commits to ``table``; it yields
        the seconds spent waiting for that. ``released_at``: when this caller last left it
        (``time.monotonic()``), so a writer that commits back to back lets others in.

        Blocking: enter it from a worker thread, never on the event loop. Leaving it does not
        block.

        Raises:
            TimeoutError: another writer held the table for too long.
        """
        ...


class LocalTableLocks:
    """Atomicity for a warehouse on a filesystem with ``flock``: an exclusive lock per table
    at ``<warehouse>/.deltaflow/locks/<table>.lock``, held for the whole read-modify-write."""

    def __init__(self, warehouse: Path, *, timeout: float = DEFAULT_COMMIT_WAIT) -> None:
        self.warehouse = Path(warehouse)
        self.timeout = timeout

    def hold(
        self, table: str, *, released_at: float | None = None
    ) -> contextlib.AbstractContextManager[float]:
        return table_lock(self.warehouse, table, timeout=self.timeout, released_at=released_at)


def atomicity_for(warehouse: Path) -> CommitAtomicity:
    """How commits to the tables under ``warehouse`` are made atomic."""
    return LocalTableLocks(warehouse)
