"""A cross-process lock per table around each Delta commit.

Spark's Delta on ``file:`` paths uses HDFSLogStore, whose put-if-absent of a commit file is
atomic only inside one JVM. Two node processes committing to one table could overwrite each
other's commit and silently lose one. Every commit deltaflow makes (table creation and MERGE)
holds an exclusive ``flock`` on ``<warehouse>/.deltaflow/locks/<table>.lock`` for its whole
read-modify-write, so commits to one table are serialized across all processes on the machine
(and on any shared filesystem with working ``flock``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..storage.flock import YIELD_SECONDS, file_lock, others_waiting

__all__ = ["YIELD_SECONDS", "file_lock", "others_waiting", "table_lock", "table_lock_path"]


def table_lock_path(warehouse: Path, table: str) -> Path:
    return warehouse / ".deltaflow" / "locks" / f"{table}.lock"


def table_lock(
    warehouse: Path, table: str, *, timeout: float = 600.0, released_at: float | None = None
) -> contextlib.AbstractContextManager[float]:
    """Hold the table's commit lock (a context manager yielding the seconds spent waiting);
    ``released_at``: when the caller last released it (see :func:`file_lock`).

    Blocking: call it from a worker thread, never on the event loop.

    Raises:
        TimeoutError: the lock was not free within ``timeout`` seconds.
    """
    return file_lock(
        table_lock_path(warehouse, table),
        timeout=timeout,
        what=f"commit lock of table {table!r}",
        released_at=released_at,
    )
