"""The commit-atomicity seam: how every commit deltaflow makes to a table is made atomic with
respect to every other writer, and so exactly-once.

A commit to a Delta table is a read-modify-write of its log: read the latest version and the
lane marks it holds, drop the batches already applied, write version + 1. Two writers doing
that at once could both write the same version (one silently lost) or both apply a batch.
Whatever a warehouse is, one object decides how that cannot happen: :class:`CommitAtomicity`,
asked for by :func:`atomicity_for`. The committer, table creation and maintenance all hold it
around their read-modify-write; nothing else knows how it works.

A warehouse in a local directory (or on a shared filesystem with working ``flock``) gets a
cross-process file lock per table (:class:`LocalTableLocks`, on :mod:`.flock`): Spark's Delta
on ``file:`` paths makes a commit file's put-if-absent atomic only inside one JVM, so the lock
is what serialises two node processes.

A warehouse on an object store has no lock every host can see. There commits are optimistic
(:class:`OptimisticCommits`): nothing is held; the committer reads the lane marks of every
commit up to some version V and the engine commits at exactly V + 1 by the store's
create-if-absent write of ``_delta_log/<V+1>.json``. A writer that lost the race (or finds the
table past V) gets ``CommitConflictError`` and reads the marks again before it retries, so a
batch two owners race to apply lands once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from ..storage.paths import Location, StorePath
from .flock import table_lock

__all__ = ["CommitAtomicity", "LocalTableLocks", "OptimisticCommits", "atomicity_for"]

#: How long a commit waits for another writer's commit to the same table, seconds.
DEFAULT_COMMIT_WAIT = 600.0


class CommitAtomicity(Protocol):
    """Makes the read-modify-write of one table's log exclusive among all its writers, or
    (``optimistic``) lets the commit at the next version decide."""

    #: Whether commits are optimistic: each group is committed at exactly the version after
    #: the one its marks were read at (``GroupWrite.read_version``), conflicts retried.
    optimistic: bool
    #: Attempts at a group commit that loses races before it fails.
    conflict_attempts: int

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

    optimistic = False
    conflict_attempts = 5

    def __init__(self, warehouse: Path, *, timeout: float = DEFAULT_COMMIT_WAIT) -> None:
        self.warehouse = Path(warehouse)
        self.timeout = timeout

    def hold(
        self, table: str, *, released_at: float | None = None
    ) -> contextlib.AbstractContextManager[float]:
        return table_lock(self.warehouse, table, timeout=self.timeout, released_at=released_at)


class OptimisticCommits:
    """Atomicity for a warehouse on an object store: no lock, the store's create-if-absent
    decides which of two commits at one version lands (see the module docstring)."""

    optimistic = True
    #: Three nodes committing to one table on the same tick lose most races: a group keeps
    #: trying, after a random pause that grows to :data:`MAX_CONFLICT_WAIT` (tenacity's
    #: ``wait_random_exponential``), long before it would fail.
    conflict_attempts = 40

    @contextlib.contextmanager
    def _nothing(self) -> Iterator[float]:
        yield 0.0

    def hold(
        self, table: str, *, released_at: float | None = None
    ) -> contextlib.AbstractContextManager[float]:
        return self._nothing()


#: The longest pause between two attempts of an optimistic commit, seconds.
MAX_CONFLICT_WAIT = 0.5


def atomicity_for(warehouse: Location) -> CommitAtomicity:
    """How commits to the tables under ``warehouse`` are made atomic."""
    if isinstance(warehouse, StorePath):
        return OptimisticCommits()
    return LocalTableLocks(warehouse)
