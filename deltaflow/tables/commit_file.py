"""What one Delta commit file records for deltaflow (:func:`read_commit`): the lane marks of
its ``commitInfo`` and its ``txn`` actions, the deletion vectors it adds and removes, the keys
it deletes from a ``sequence_by`` table. How marks are kept is :mod:`.marks`'."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Final

from ..protocol import MAX_ORDINAL
from ..storage.paths import Location
from .log import commit_text

__all__ = [
    "CARRIED_APP",
    "CARRIED_VERSION",
    "FORGOTTEN_AT",
    "METADATA_KEY",
    "TABLE_CHANGES",
    "TXN_PREFIX",
    "Mark",
    "commit_vectors",
    "lanes_of",
    "mark_of",
    "read_commit",
    "txn_version",
]

log = logging.getLogger(__name__)

METADATA_KEY: Final = "deltaflow"

#: (seq, k): the batch's sequence number and the write's ordinal within the batch.
Mark = tuple[int, int]

#: A lane's ``txn`` action: this ``appId`` prefix and the lane.
TXN_PREFIX: Final = "deltaflow:"
#: The ``txn`` whose presence says every lane's mark is carried by a ``txn`` action.
CARRIED_APP: Final = "deltaflow"
CARRIED_VERSION: Final = 1
_ORDINAL_BITS: Final = MAX_ORDINAL.bit_length() - 1
#: A lane's ``txn`` action with this ``lastUpdated`` forgets the lane: Delta drops it from the
#: table's snapshots and checkpoints (it is older than any retention), and a node that reads it
#: forgets the lane's mark for good (a closed stream of a random id, :mod:`.marks`).
FORGOTTEN_AT: Final = 0
#: How the lines of a commit's actions that change the table's metadata or protocol start.
TABLE_CHANGES: Final = ('{"metaData"', '{"protocol"')


def txn_version(mark: Mark) -> int:
    """A mark as the ``version`` of its lane's ``txn`` action (ordered as the marks are)."""
    return mark[0] << _ORDINAL_BITS | mark[1]


def mark_of(version: int) -> Mark:
    """The mark a ``txn`` action's ``version`` records (:func:`txn_version`'s inverse)."""
    return version >> _ORDINAL_BITS, version & (MAX_ORDINAL - 1)


_Vectors = dict[str, dict[str, Any]]


_Deleted = tuple[Mapping[str, Any], int]


def read_commit(
    path: Location, every_remove: bool = False
) -> tuple[
    dict[str, Mark],
    bool,
    list[tuple[str, dict[str, Any] | None]],
    _Vectors,
    _Deleted | None,
    dict[str, Mark],
    tuple[int | None, bool, list[str]],
]:
    """What one commit file records: its ``commitInfo`` lane marks (empty if it has none);
    whether it has a ``metaData`` or ``protocol`` action; the files with deletion vectors it
    removes (with ``every_remove``, every file it removes) and the ones with vectors it adds
    (path and descriptor); the keys it deletes from a ``sequence_by`` table with the commit's
    time; the marks its ``txn`` actions carry; its time, whether it says every lane is
    carried (the ``deltaflow`` txn), and the lanes it forgets (:data:`FORGOTTEN_AT`).

    Raises:
        OSError: it cannot be read.
    """
    lanes: dict[str, Mark] = {}
    txns: dict[str, Mark] = {}
    forgotten: list[str] = []
    carried = False
    at: int | None = None
    deleted: _Deleted | None = None
    metadata = False
    removed: list[tuple[str, dict[str, Any] | None]] = []
    added: _Vectors = {}
    try:
        # Lines end at "\n" only: a writer may leave U+2028 raw in a value (a row's stats).
        for line in commit_text(path).split("\n"):
            # Each line is one action, an object with one key.
            if line.startswith(TABLE_CHANGES):
                metadata = True
            elif line.startswith('{"txn"'):
                txn = json.loads(line)["txn"]
                app, version = txn.get("appId"), txn.get("version")
                if not isinstance(app, str) or not isinstance(version, int):
                    continue
                if app.startswith(TXN_PREFIX) and txn.get("lastUpdated") == FORGOTTEN_AT:
                    forgotten.append(app[len(TXN_PREFIX) :])
                elif app.startswith(TXN_PREFIX):
                    txns[app[len(TXN_PREFIX) :]] = mark_of(version)
                elif app == CARRIED_APP:
                    carried = True
            elif (every_remove and line.startswith('{"remove"')) or (
                '"deletionVector"' in line and line.startswith(('{"add"', '{"remove"'))
            ):
                kind, action = next(iter(json.loads(line).items()))
                dv = action.get("deletionVector")
                if kind == "add":
                    if dv is not None:
                        added[action["path"]] = dv
                elif dv is not None or every_remove:
                    removed.append((action["path"], dv))
            elif not lanes and '"commitInfo"' in line:
                info = json.loads(line).get("commitInfo") or {}
                lanes, deleted = lanes_of(info)
                stamp = info.get("timestamp")
                at = stamp if isinstance(stamp, int) else None
    except ValueError as exc:  # not as a Delta writer writes it: no marks of ours in it
        log.warning("cannot read lane marks from %s: %s", path, exc)
    return lanes, metadata, removed, added, deleted, txns, (at, carried, forgotten)


def commit_vectors(commit: Location) -> list[dict[str, Any]]:
    """The deletion vectors one commit file names, in its adds and its removes."""
    _, _, removed, added, *_ = read_commit(commit)
    return [dv for _, dv in removed if dv is not None] + list(added.values())


def lanes_of(info: Mapping[str, Any]) -> tuple[dict[str, Mark], _Deleted | None]:
    """A commit's lane marks, and the deletes it records with its time (None without)."""
    raw = info.get("userMetadata")
    meta: Any = None
    if isinstance(raw, str) and METADATA_KEY in raw:
        try:
            meta = json.loads(raw).get(METADATA_KEY)
        except (ValueError, AttributeError):
            meta = None
    elif isinstance(info.get(METADATA_KEY), Mapping):  # written as a top-level field
        meta = info[METADATA_KEY]
    if not isinstance(meta, Mapping) or not isinstance(meta.get("lanes"), Mapping):
        return {}, None
    lanes: dict[str, Mark] = {}
    for lane, mark in meta["lanes"].items():
        if isinstance(mark, list) and len(mark) == 2 and all(isinstance(x, int) for x in mark):
            lanes[str(lane)] = (mark[0], mark[1])
    deleted = meta.get("deleted")
    at = info.get("timestamp")
    if isinstance(deleted, Mapping) and isinstance(at, int):
        return lanes, (deleted, at)
    return lanes, None
