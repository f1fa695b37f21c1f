"""Lane marks: which batches a Delta table already holds, recorded in the table's own commits.

Every commit deltaflow makes carries, in its ``commitInfo``, the highest *mark* it applied for
each lane (one (stream, partition)): ``[seq, k]``, the batch's sequence number and the ordinal
of the write within that batch (a receiver may write one table several times per batch). The
marks are in the same commit file as the data, so they land or vanish with it: atomic by
construction, surviving node restarts and visible to whichever node owns the partition next.

Before a commit, while holding the table's lock, a node reads the commits it has not seen yet
and drops every staged write whose mark the table already holds. A batch resent after its
commit landed (lost ack, crash between commit and ack, failover) is therefore never applied
twice, also for writes that are not idempotent (appends). Lanes of one stream are applied in
order, so "the highest mark per lane" is all that needs remembering.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Final

from ..storage.paths import Location, open_input
from .deletion_vectors import descriptor_id
from .log import FETCH_AHEAD, commit_text, commit_versions, fetch_commits, log_dir
from .sequence import Tombstones

__all__ = ["METADATA_KEY", "LaneMarks", "Mark", "checkpoint_vectors", "commit_vectors"]

log = logging.getLogger(__name__)

METADATA_KEY: Final = "deltaflow"

#: (seq, k): the batch's sequence number and the write's ordinal within the batch.
Mark = tuple[int, int]


class LaneMarks:
    """The highest mark per lane found in a table's commits, read incrementally.

    Blocking (file reads): use from a worker thread, under the table's commit lock.
    """

    def __init__(
        self, table_path: Location, *, history: int = 0, tombstones: Tombstones | None = None
    ) -> None:
        self._table = table_path
        #: The deletes the commits record (``sequence_by`` tables), when kept.
        self.tombstones = tombstones
        self._log_dir = log_dir(table_path)
        self._marks: dict[str, Mark] = {}
        self._scanned = -1
        #: The deletion vector of every live file that has one (path -> descriptor), for a
        #: commit that replaces it (merge-on-read): a ``remove`` must name it.
        self.vectors: dict[str, dict[str, Any]] = {}
        # What each of the last ``history`` commits read changed: the paths it removed, and
        # whether it changed the metadata or protocol (see ``changed_since``).
        self._history = history
        self._changes: collections.OrderedDict[int, tuple[frozenset[str], bool]] = (
            collections.OrderedDict()
        )

    @property
    def scanned(self) -> int:
        """The last log version read (-1 before any)."""
        return self._scanned

    def applied(self, lane: str, mark: Mark) -> bool:
        held = self._marks.get(lane)
        return held is not None and mark <= held

    def refresh(self, latest: int | None = None) -> bool:
        """Read the commits written since the last refresh (by any process); ``latest``: up
        to that version, which the caller knows exists (no listing: it committed it).

        Returns whether one of them changed the table's metadata or protocol (its schema or
        properties, for instance): the caller then reads them again.

        Raises:
            OSError: a commit could not be read; the marks stay at the one before it (its
                marks are read next time, never skipped: a batch it applied must not look new).
        """
        if latest is None:
            versions = commit_versions(self._table, self._scanned)
        else:
            versions = list(range(self._scanned + 1, latest + 1))
        vectors_after = -1
        if self._scanned < 0 and versions and versions[0] > 0:
            # The first commits are gone: the vectors of older commits are in a checkpoint.
            vectors_after = _checkpoint_vectors(self._log_dir, self.vectors)
        changed = False
        for i, version in enumerate(versions):
            if i % FETCH_AHEAD == 0:  # the next ones in parallel: one round trip, not one each
                fetch_commits(self._log_dir, versions[i:])
            lanes, metadata, removed, added, deleted = _read_commit(
                self._log_dir / f"{version:020d}.json", self._history > 0
            )
            self.absorb(lanes)
            if deleted is not None and self.tombstones is not None:
                self.tombstones.absorb(*deleted)
            if self._history:
                paths = frozenset(p for p, _ in removed)
                self._changes[version] = (paths, metadata)
                while len(self._changes) > self._history:
                    self._changes.popitem(last=False)
            if version > vectors_after:
                for path, dv in removed:
                    held = self.vectors.get(path)
                    if (
                        held is not None
                        and dv is not None
                        and descriptor_id(dv) == descriptor_id(held)
                    ):
                        del self.vectors[path]
                self.vectors.update(added)
            changed = changed or metadata
            self._scanned = version
        return changed

    def changed_since(self, version: int, paths: frozenset[str]) -> str | None:
        """Why a group prepared at table ``version``, removing ``paths``, no longer fits the
        table as last refreshed (a later commit removed one of those files, or changed the
        metadata or protocol); None when it still does. Needs ``history``.
        """
        if version > self._scanned:
            return f"it was prepared at version {version}, after the {self._scanned} read here"
        if version < self._scanned and version + 1 not in self._changes:
            return f"version {version} is older than the commits remembered here"
        for later in range(version + 1, self._scanned + 1):
            removed, metadata = self._changes[later]
            if metadata:
                return f"version {later} changed the table's schema, settings or protocol"
            if not paths.isdisjoint(removed):
                return f"version {later} replaced a file it replaces"
        return None

    def absorb(self, lanes: Mapping[str, Mark]) -> None:
        for lane, mark in lanes.items():
            if lane not in self._marks or mark > self._marks[lane]:
                self._marks[lane] = mark

    @staticmethod
    def user_metadata(
        node: str,
        lanes: Mapping[str, Mark],
        writers: Iterable[str] | None = None,
        deleted: Mapping[str, list[Any]] | None = None,
    ) -> str:
        """The commit's ``userMetadata`` recording ``lanes``, committed by ``node`` (with
        ``writers``: the nodes whose prepared groups it holds; ``deleted``: the keys it deletes
        from a ``sequence_by`` table and their sequences, :func:`.sequence.recorded`)."""
        meta: dict[str, Any] = {"node": node, "lanes": {k: list(v) for k, v in lanes.items()}}
        if writers is not None:
            meta["writers"] = sorted(set(writers))
        if deleted:
            meta["deleted"] = deleted
        return json.dumps({METADATA_KEY: meta}, separators=(",", ":"))

    @staticmethod
    def highest(marks: Iterable[tuple[str, Mark]]) -> dict[str, Mark]:
        out: dict[str, Mark] = {}
        for lane, mark in marks:
            if lane not in out or mark > out[lane]:
                out[lane] = mark
        return out

    @staticmethod
    def lowest(marks: Iterable[tuple[str, Mark]]) -> dict[str, Mark]:
        out: dict[str, Mark] = {}
        for lane, mark in marks:
            if lane not in out or mark < out[lane]:
                out[lane] = mark
        return out


def _listdir(path: Location) -> list[str]:
    try:
        return [p.name for p in path.iterdir()]
    except FileNotFoundError:
        return []


_Vectors = dict[str, dict[str, Any]]


_Deleted = tuple[Mapping[str, Any], int]


def _read_commit(
    path: Location, every_remove: bool = False
) -> tuple[
    dict[str, Mark], bool, list[tuple[str, dict[str, Any] | None]], _Vectors, _Deleted | None
]:
    """What one commit file records: its lane marks (empty if it has none); whether it has a
    ``metaData`` or ``protocol`` action; the files with deletion vectors it removes (with
    ``every_remove``, every file it removes) and the ones with vectors it adds (path and
    descriptor); the keys it deletes from a ``sequence_by`` table with the commit's time.

    Raises:
        OSError: it cannot be read.
    """
    lanes: dict[str, Mark] = {}
    deleted: _Deleted | None = None
    metadata = False
    removed: list[tuple[str, dict[str, Any] | None]] = []
    added: _Vectors = {}
    try:
        # Lines end at "\n" only: a writer may leave U+2028 raw in a value (a row's stats).
        for line in commit_text(path).split("\n"):
            # Each line is one action, an object with one key.
            if line.startswith(('{"metaData"', '{"protocol"')):
                metadata = True
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
                lanes, deleted = _lanes_of(info)
    except ValueError as exc:  # not as a Delta writer writes it: no marks of ours in it
        log.warning("cannot read lane marks from %s: %s", path, exc)
    return lanes, metadata, removed, added, deleted


def _checkpoint_vectors(log_dir: Location, into: _Vectors) -> int:
    """Read the deletion vectors of the live files the last checkpoint lists into ``into``;
    the checkpoint's version (-1 without one)."""
    try:
        last = json.loads((log_dir / "_last_checkpoint").read_text(encoding="utf-8"))
        version = int(last["version"])
    except (OSError, ValueError, KeyError):
        return -1
    prefix = f"{version:020d}.checkpoint"
    for name in sorted(n for n in _listdir(log_dir) if n.startswith(prefix)):
        if name.endswith(".parquet"):
            into.update(checkpoint_vectors(log_dir / name, ("add",)))
    return version


def commit_vectors(commit: Location) -> list[dict[str, Any]]:
    """The deletion vectors one commit file names, in its adds and its removes."""
    _, _, removed, added, _ = _read_commit(commit)
    return [dv for _, dv in removed if dv is not None] + list(added.values())


def checkpoint_vectors(checkpoint: Location, kinds: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The deletion vectors of the actions of ``kinds`` (``add``, ``remove``) a checkpoint
    file lists: (path, descriptor) pairs."""
    import pyarrow.parquet as pq

    rows = pq.read_table(open_input(checkpoint), columns=list(kinds)).to_pylist()
    return [
        (action["path"], {k: v for k, v in action["deletionVector"].items() if v is not None})
        for row in rows
        for action in (row.get(kind) for kind in kinds)
        if action and action.get("deletionVector")
    ]


def _lanes_of(info: Mapping[str, Any]) -> tuple[dict[str, Mark], _Deleted | None]:
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
