"""A cross-process lock per table around each Delta commit.

Spark's Delta on ``file:`` paths uses HDFSLogStore, whose put-if-absent of a commit file is
atomic only inside one JVM. Two node processes committing to one table could overwrite each
other's commit and silently lose one. Every commit deltaflow makes (table creation and MERGE)
holds an exclusive ``flock`` on ``<warehouse>/.deltaflow/locks/<table>.lock`` for its whole
read-modify-write, so commits to one table are serialized across all processes on the machine
(and on any shared filesystem with working ``flock``). ``flock`` locks belong to the open file
description, so two threads of one process exclude each other as well.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["file_lock", "table_lock"]


@contextlib.contextmanager
def file_lock(path: Path, *, timeout: float, what: str) -> Iterator[float]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing); yields the seconds spent
    waiting. Polls with backoff (1 ms doubling to 50 ms) so a timeout can be honoured.

    Blocking: call it from a worker thread, never on the event loop.

    Raises:
        TimeoutError: the lock was not free within ``timeout`` seconds (names ``what``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    started = time.monotonic()
    try:
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - started > timeout:
                    raise TimeoutError(
                        f"{what} held by another process for more than {timeout}s ({path})"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        try:
            yield time.monotonic() - started
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def table_lock(
    warehouse: Path, table: str, *, timeout: float = 600.0
) -> contextlib.AbstractContextManager[float]:
    """Hold the table's commit lock (a context manager yielding the seconds spent waiting).

    Blocking: call it from a worker thread, never on the event loop.

    Raises:
        TimeoutError: the lock was not free within ``timeout`` seconds.
    """
    path = warehouse / ".deltaflow" / "locks" / f"{table}.lock"
    return file_lock(path, timeout=timeout, what=f"commit lock of table {table!r}")
