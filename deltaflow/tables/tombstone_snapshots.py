"""Snapshots of a ``sequence_by`` table's tombstones, so a starting node need not read the log.

A table's tombstones (:class:`.sequence.Tombstones`: its deleted keys and the sequence of each
delete) are recorded in the deleting commits only, and a Delta checkpoint does not keep a
commit's ``commitInfo``. So the owners of a ``sequence_by`` table write, once per checkpoint
interval of commits they read, every tombstone they hold as of the version they read up to:
``<table>/_deltaflow/tombstones/<version>.json``, created only if absent (two nodes writing one
version write the same deletes). A node that starts restores the newest snapshot and reads the
commits after it (and from the last checkpoint, for the lane marks); without one it reads the
whole log, as before. Each snapshot holds what the table's tombstone retention keeps, so it is
bounded as the tombstones in memory are; a writer deletes all but the newest two. Delta
readers, ``VACUUM`` and the log's clean-up ignore the ``_deltaflow`` directory.

A snapshot is complete as of its version by induction: a node writes one only after reading
every commit up to it from the whole log or from a complete snapshot.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Final

from ..storage.paths import Location, StorePath, create_exclusive
from .log import versions_in
from .sequence import Tombstones

__all__ = ["KEPT_SNAPSHOTS", "newest_snapshot", "snapshot_dir", "write_snapshot"]

log = logging.getLogger(__name__)

#: Snapshots a writer leaves: the newest two (a reader that listed just before a clean-up
#: still finds the one it chose, or the next).
KEPT_SNAPSHOTS: Final = 2
_FORMAT: Final = 1


def snapshot_dir(table: Location) -> Location:
    """Where the table's tombstone snapshots are."""
    return table / "_deltaflow" / "tombstones"


def _versions(table: Location) -> list[int]:
    """The versions of the table's snapshots, in order."""
    try:
        return versions_in(p.name for p in snapshot_dir(table).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def write_snapshot(table: Location, version: int, tombstones: Tombstones) -> bool:
    """Blocking: snapshot ``tombstones``, complete as of commit ``version``, unless one of that
    version exists; then delete all but the newest :data:`KEPT_SNAPSHOTS`. Whether it was
    written. A failure is logged: a snapshot only spares a starting node reading the log."""
    directory = snapshot_dir(table)
    entries = [
        {"at": at, "keys": keys, "seqs": seqs} for at, (keys, seqs) in tombstones.by_time().items()
    ]
    body = json.dumps({"format": _FORMAT, "version": version, "deletes": entries})
    try:
        if not isinstance(directory, StorePath):
            directory.mkdir(parents=True, exist_ok=True)
        create_exclusive(directory / f"{version:020d}.json", body.encode())
    except FileExistsError:
        return False
    except OSError as exc:
        log.warning(
            "table %s: cannot write its tombstones at version %d: %s", table.name, version, exc
        )
        return False
    for old in _versions(table)[:-KEPT_SNAPSHOTS]:
        try:
            (directory / f"{old:020d}.json").unlink(missing_ok=True)
        except OSError:
            pass  # the next writer deletes it
    return True


def newest_snapshot(table: Location) -> tuple[int, list[dict[str, Any]]] | None:
    """The newest readable snapshot of the table's tombstones: its version and its deletes,
    each ``{"at", "keys", "seqs"}`` as :meth:`.Tombstones.absorb` takes them; None without
    one."""
    for version in reversed(_versions(table)):
        try:
            data = json.loads(
                (snapshot_dir(table) / f"{version:020d}.json").read_text(encoding="utf-8")
            )
        except (OSError, ValueError) as exc:
            log.warning(
                "table %s: cannot read its tombstones at version %d: %s", table.name, version, exc
            )
            continue
        if not isinstance(data, dict):
            continue
        deletes = data.get("deletes")
        if (
            data.get("format") == _FORMAT
            and data.get("version") == version
            and isinstance(deletes, list)
        ):
            return version, [
                d for d in deletes if isinstance(d, dict) and isinstance(d.get("at"), int)
            ]
    return None
