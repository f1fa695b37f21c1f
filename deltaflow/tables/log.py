"""Where a table is, and where its Delta log is: the one place that spells ``_delta_log``.

A table's location is a local path or a :class:`~deltaflow.storage.StorePath` on an object
store; both answer the same calls.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from ..errors import CommitConflictError, UsageError
from ..receivers.base import check_table_name
from ..storage.paths import Location, StorePath, create_exclusive, storage_options
from .checkpoints import last_checkpoint

__all__ = [
    "DELTA_LOG",
    "FETCH_AHEAD",
    "commit_info",
    "commit_log_entry",
    "commit_text",
    "commit_versions",
    "delta_table",
    "fetch_commits",
    "fetched",
    "forget_commits",
    "is_table",
    "last_checkpoint_version",
    "latest_version",
    "log_dir",
    "table_path",
    "versions_in",
]

#: The directory of a table that holds its Delta log.
DELTA_LOG: Final = "_delta_log"


def log_dir(path: Location) -> Location:
    """The Delta log directory of the table at ``path``."""
    return path / DELTA_LOG


def delta_table(path: Location, version: int | None = None) -> Any:
    """The delta-rs table at ``path`` (at ``version``, else the latest), with the storage
    options its location needs."""
    from deltalake import DeltaTable

    return DeltaTable(str(path), version=version, storage_options=storage_options(path))


def is_table(path: Location) -> bool:
    """Whether a Delta table exists at ``path``: its log holds a commit (a log directory alone,
    on a store where another writer is creating the table, is not yet a table)."""
    return latest_version(path) >= 0


def table_path(warehouse: Location, table: str) -> Location:
    """The path of the existing table ``table`` under ``warehouse``.

    Raises:
        UsageError: a bad table name, or no Delta table by that name.
    """
    path = warehouse / check_table_name(table)
    if not is_table(path):
        raise UsageError(f"no Delta table {table!r} under {warehouse}")
    return path


def latest_version(path: Location, known: int = -1) -> int:
    """The highest commit version in the table's log directory (-1 if none). ``known``: a
    version the caller saw there; only the commit files after it are looked for (the log only
    grows), so the cost does not grow with the log's length."""
    return max(commit_versions(path, known), default=known)


def commit_versions(path: Location, after: int = -1, *, every: bool = False) -> list[int]:
    """The versions of the table's commit files above ``after``, in order; for ``after`` -1,
    those from the last checkpoint's version on (``every``: all that are kept).

    The log only grows, and its versions are contiguous from the oldest one kept: on a store
    only the keys after ``after`` are listed; on disk the next versions are looked up by name,
    from ``after + 1`` (or the last checkpoint's), so the cost grows with the new commits, not
    with the directory (which holds a month of commits on a busy table). The directory is
    listed only for ``every`` from the start, for a log without a checkpoint, and for an
    ``after`` older than the log's clean-up."""
    directory = log_dir(path)
    if isinstance(directory, StorePath):
        names = directory.names_after(f"{after:020d}.json" if after >= 0 else "")
        return versions_in(names, after)
    if after < 0:
        last = None if every else last_checkpoint_version(directory)
        if last is None or not _commit_exists(directory, last):
            return _listed(directory, after)
        first = last  # the versions before the last checkpoint were not asked for
    else:
        first = after + 1
        if not _commit_exists(directory, first):
            # No new commit (the common case), or ``after`` is older than the log's clean-up
            # (its next commit was removed, which happens only below a later checkpoint).
            last = last_checkpoint_version(directory)
            return _listed(directory, after) if last is not None and last > first else []
    versions = []
    while _commit_exists(directory, first):
        versions.append(first)
        first += 1
    return versions


def last_checkpoint_version(directory: Location) -> int | None:
    """The version ``_last_checkpoint`` in the log directory names (None without one)."""
    last = last_checkpoint(directory)
    return None if last is None or last["version"] < 0 else int(last["version"])


def _commit_exists(directory: Location, version: int) -> bool:
    return (directory / f"{version:020d}.json").exists()


def _listed(directory: Location, after: int) -> list[int]:
    try:
        return versions_in((p.name for p in directory.iterdir()), after)
    except FileNotFoundError:
        return []


def versions_in(names: Iterable[str], after: int = -1) -> list[int]:
    """The versions above ``after`` that names of the form ``<20 digits>.json`` carry, in order
    (commit files, and files deltaflow numbers the same way)."""
    return sorted(
        v
        for n in names
        if len(n) == 25 and n.endswith(".json") and n[:20].isdigit() and (v := int(n[:20])) > after
    )


#: Commit files read from a store, kept (the newest ``_KEPT_COMMITS`` of at most
#: ``_KEPT_COMMIT_CHARS`` characters each): a node's readers of one table's log (its lane
#: marks, its live files, its committer's marks) read each new commit once per node, not once
#: each, which on a store is a round trip each. A commit file never changes once written (a
#: create-if-absent put), so a kept one is never stale; a table deleted and made again
#: restarts its log, which the readers notice (:meth:`.LogReader.forget` drops its commits).
#: At most 32 MiB kept on a node: a commit of a few dozen groups' files is some tens of KiB; a
#: larger one is read again when needed.
_KEPT_COMMITS: Final = 256
_KEPT_COMMIT_CHARS: Final = 128 * 1024
_kept_commits: collections.OrderedDict[str, str] = collections.OrderedDict()
_kept_lock = threading.Lock()


def commit_text(commit: Location) -> str:
    """The text of the commit file ``commit`` (``<log>/<version>.json``), kept after a read
    from a store.

    Raises:
        OSError: it cannot be read.
    """
    if not isinstance(commit, StorePath):
        return commit.read_text(encoding="utf-8")
    name = _kept_name(commit)
    with _kept_lock:
        text = _kept_commits.get(name)
        if text is not None:
            _kept_commits.move_to_end(name)
            return text
    text = commit.read_text(encoding="utf-8")
    _keep(commit, text)
    return text


#: Commit files fetched at once by :func:`fetch_commits` (a store's requests wait together).
FETCH_AHEAD: Final = 16
_FETCH_POOL: Final = ThreadPoolExecutor(FETCH_AHEAD, thread_name_prefix="deltaflow-log")


def fetch_commits(log: Location, versions: Sequence[int]) -> None:
    """Blocking: fetch the commit files ``versions`` of the log directory ``log`` that are not
    kept, in parallel (the first :data:`FETCH_AHEAD`), so that reading them in order next costs
    one round trip, not one each. A file that cannot be read is left to that reading."""
    if not isinstance(log, StorePath) or len(versions) < 2:
        return
    with _kept_lock:
        missing = [
            log / f"{v:020d}.json"
            for v in versions[:FETCH_AHEAD]
            if _kept_name(log / f"{v:020d}.json") not in _kept_commits
        ]

    def fetch(commit: Location) -> None:
        with contextlib.suppress(OSError):
            commit_text(commit)

    list(_FETCH_POOL.map(fetch, missing))


def fetched(log: Location, versions: Sequence[int]) -> Iterator[Location]:
    """The commit files ``versions`` of the log directory ``log``, in order, each
    :data:`FETCH_AHEAD` of them fetched together first (:func:`fetch_commits`)."""
    for i, version in enumerate(versions):
        if i % FETCH_AHEAD == 0:  # the next ones in parallel: one round trip, not one each
            fetch_commits(log, versions[i:])
        yield log / f"{version:020d}.json"


def _kept_name(commit: Location) -> str:
    """A kept commit's name: its whole URI (the same version of two tables differs)."""
    return str(commit)


def _keep(commit: Location, text: str) -> None:
    if isinstance(commit, StorePath) and len(text) <= _KEPT_COMMIT_CHARS:
        with _kept_lock:
            _kept_commits[_kept_name(commit)] = text
            while len(_kept_commits) > _KEPT_COMMITS:
                _kept_commits.popitem(last=False)


def forget_commits(path: Location) -> None:
    """Drop the kept commit files of the table at ``path``."""
    prefix = f"{log_dir(path)}/"
    with _kept_lock:
        for name in [n for n in _kept_commits if n.startswith(prefix)]:
            del _kept_commits[name]


def commit_info(
    read: int, actions: list[dict[str, Any]], metadata: str, engine: str
) -> dict[str, Any]:
    """The ``commitInfo`` of a version deltaflow writes itself after version ``read``, with
    ``actions`` and the ``userMetadata`` ``metadata``."""
    removes = any("remove" in a for a in actions)
    # A version of a compaction alone changes no rows: readers of changes skip it.
    moved = removes and not any(b.get("dataChange", True) for a in actions for b in a.values())
    return {
        "timestamp": int(time.time() * 1000),
        "operation": "OPTIMIZE" if moved else "MERGE" if removes else "WRITE",
        "operationParameters": {"mode": f"deltaflow {'compaction' if moved else 'committer'}"},
        "readVersion": read,
        "isBlindAppend": not removes,
        "userMetadata": metadata,
        "engineInfo": engine,
    }


def commit_log_entry(path: Location, version: int, actions: list[dict[str, Any]]) -> None:
    """Write Delta log entry ``version`` of the table at ``path`` with ``actions``, if no
    other writer did (:func:`~deltaflow.storage.paths.create_exclusive`: a hard link on disk,
    a create-if-absent put on a store; readers never see a partial entry).

    Raises:
        CommitConflictError: the version exists (another writer's commit won).
    """
    entry = "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions)
    commit = log_dir(path) / f"{version:020d}.json"
    try:
        create_exclusive(commit, entry.encode())
    except FileExistsError as exc:
        raise CommitConflictError(
            f"table {path.name!r}: another writer committed version {version} first"
        ) from exc
    _keep(commit, entry)  # it landed: this node's readers of the log need not fetch it
