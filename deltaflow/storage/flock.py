"""A cross-process lock on a file (``flock``), with a timeout and fair turns for waiters: the
lock of the commits to a table on disk (:mod:`deltaflow.tables.flock`) and of the records
swapped on disk (:mod:`.records`). ``flock`` locks belong to the open file description, so two
threads of one process exclude each other as well.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final

__all__ = ["POLL_SECONDS", "YIELD_SECONDS", "file_lock", "others_waiting"]


#: How often a waiter retries a held lock, and how long after its release a holder lets the
#: processes that were waiting go first (many retry periods, so a waiter gets its turn).
POLL_SECONDS: Final = 0.005
YIELD_SECONDS: Final = 0.05


@contextlib.contextmanager
def file_lock(
    path: Path, *, timeout: float, what: str, released_at: float | None = None
) -> Iterator[float]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing); yields the seconds spent
    waiting. Polls every ``POLL_SECONDS`` so a timeout can be honoured.

    ``flock`` is not fair: a holder that releases and re-locks at once can starve a polling
    waiter indefinitely. So a waiter leaves a marker next to the lock while it waits
    (:func:`others_waiting`), and a caller that released the lock at ``released_at``
    (``time.monotonic()``) lets the waiters it finds go first, until ``YIELD_SECONDS`` after
    that release. Only the next locking waits: what the caller does meanwhile (the next
    group's preparation) is not held up, and nothing waits when no one else wants the lock.

    Blocking: call it from a worker thread, never on the event loop.

    Raises:
        TimeoutError: the lock was not free within ``timeout`` seconds (names ``what``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    started = time.monotonic()
    if released_at is not None:
        while time.monotonic() < released_at + YIELD_SECONDS and others_waiting(path):
            time.sleep(POLL_SECONDS)
    marker: Path | None = None
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if marker is None:
                    marker = _waiting_dir(path) / f"{_HOST}-{os.getpid()}-{uuid.uuid4().hex}"
                    marker.parent.mkdir(exist_ok=True)
                    marker.touch()
                if time.monotonic() - started > timeout:
                    raise TimeoutError(
                        f"{what} held by another process for more than {timeout}s ({path})"
                    ) from None
                time.sleep(POLL_SECONDS)
        if marker is not None:
            marker.unlink(missing_ok=True)
            marker = None
        try:
            yield time.monotonic() - started
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)
        os.close(fd)


#: This host in waiting markers (no ``-``: markers are ``<host>-<pid>-<random>``).
_HOST: Final = socket.gethostname().replace("-", "_")


def _waiting_dir(path: Path) -> Path:
    return path.parent / f"{path.name}.waiting"


def others_waiting(path: Path) -> bool:
    """Whether another thread or process is waiting for the lock at ``path``. The marker of
    a process of this host that died waiting (SIGKILL skips its removal) is removed instead:
    it would make every holder step aside after each release, for as long as the warehouse
    lives."""
    try:
        markers = list(_waiting_dir(path).iterdir())
    except FileNotFoundError:
        return False
    waiting = False
    for marker in markers:
        if _died_waiting(marker.name):
            marker.unlink(missing_ok=True)
        else:
            waiting = True
    return waiting


def _died_waiting(name: str) -> bool:
    host, _, rest = name.partition("-")
    pid = rest.partition("-")[0]
    if host != _HOST or not pid.isdigit():
        return False  # another host's process (or an unknown name): it cannot be checked here
    try:
        os.kill(int(pid), 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, as another user
        pass
    return False
