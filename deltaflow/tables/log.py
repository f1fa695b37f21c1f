"""Where a table is, and where its Delta log is: the one place that spells ``_delta_log``.

A table's location is a local path or a :class:`~deltaflow.storage.StorePath` on an object
store; both answer the same calls.
"""

from __future__ import annotations

import json
from typing import Any, Final

from ..errors import CommitConflictError, UsageError
from ..receivers.base import check_table_name
from ..storage.paths import Location, StorePath, create_exclusive, storage_options

__all__ = [
    "DELTA_LOG",
    "commit_log_entry",
    "commit_versions",
    "delta_table",
    "is_table",
    "latest_version",
    "log_dir",
    "table_path",
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
    version the caller saw there; on a store only the commit files after it are listed (the
    log only grows), so the listing stays short however long the log."""
    if isinstance(path, StorePath):
        return max(commit_versions(path, known), default=known)
    return max(commit_versions(path), default=-1)


def commit_versions(path: Location, after: int = -1) -> list[int]:
    """The versions of the table's commit files above ``after``, in order (on a store, only
    the keys after it are listed: the log only grows)."""
    directory = log_dir(path)
    if isinstance(directory, StorePath):
        names = directory.names_after(f"{after:020d}.json" if after >= 0 else "")
    else:
        try:
            names = [p.name for p in directory.iterdir()]
        except FileNotFoundError:
            return []
    return sorted(
        v
        for n in names
        if len(n) == 25 and n.endswith(".json") and n[:20].isdigit() and (v := int(n[:20])) > after
    )


def commit_log_entry(path: Location, version: int, actions: list[dict[str, Any]]) -> None:
    """Write Delta log entry ``version`` of the table at ``path`` with ``actions``, if no
    other writer did (:func:`~deltaflow.storage.paths.create_exclusive`: a hard link on disk,
    a create-if-absent put on a store; readers never see a partial entry).

    Raises:
        CommitConflictError: the version exists (another writer's commit won).
    """
    entry = "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions)
    try:
        create_exclusive(log_dir(path) / f"{version:020d}.json", entry.encode())
    except FileExistsError as exc:
        raise CommitConflictError(
            f"table {path.name!r}: another writer committed version {version} first"
        ) from exc
