"""Lane marks: which batches a Delta table already holds, recorded in the table's own commits.

Every commit deltaflow makes carries the highest *mark* it applied for each lane (one (stream,
partition)): ``[seq, k]``, the batch's sequence number and the ordinal of the write within
that batch (a receiver may write one table several times per batch). The marks are in the same
commit file as the data, so they land or vanish with it: atomic by construction, surviving
node restarts and visible to whichever node owns the partition next.

Each mark is written twice in its commit: in the ``commitInfo`` (``userMetadata``, readable by
people and by deltaflow before this format) and as a Delta ``txn`` action (SetTransaction),
``appId`` ``deltaflow:<lane>`` and ``version`` ``seq << 20 | k``, which every Delta checkpoint
keeps (the newest per ``appId``) until ``delta.setTransactionRetentionDuration`` expires it. So
a node that starts reads the last checkpoint and the commits from it on, never the whole log.
A table is read that way once a commit carries the ``txn`` ``deltaflow`` (version 1): every
lane whose mark was only in a ``commitInfo`` (a table written before this format, or a commit
of Spark's SQL writer) is carried into the next commit's ``txn`` actions, and that commit says
so. Until then a node reads the whole log, as before.

A node keeps a lane's mark in memory until the lane has been idle for its retention: the
table's ``delta.setTransactionRetentionDuration`` (7 days on the tables deltaflow creates), or,
for a stream whose id the client made up (its lanes start with ``~``), ``random_marks_seconds``
(an hour): only that client could resend its batches, and it stops long before. When such a
stream closes, its lanes are forgotten at once, in memory and in the log: the next commits of
the tables it wrote carry a ``txn`` of each lane with ``lastUpdated`` 0, which Delta drops from
the table's snapshots and checkpoints and every node that reads it forgets. So neither a node's
memory nor a checkpoint grows with the streams a cluster has served.

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
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from ..protocol import RANDOM_LANE_PREFIX
from ..storage.paths import Location
from .checkpoints import (
    checkpoint_files,
    checkpoint_txns,
    checkpoint_vectors,
    last_checkpoint,
    vectors_of_last_checkpoint,
)
from .commit_file import (
    CARRIED_APP,
    CARRIED_VERSION,
    FORGOTTEN_AT,
    METADATA_KEY,
    TXN_PREFIX,
    Mark,
    commit_vectors,
    mark_of,
    read_commit,
    txn_version,
)
from .deletion_vectors import descriptor_id
from .log import commit_versions, fetched, log_dir
from .mark_store import (
    MINUTES,
    MarkRetention,
    MarkStore,
    minute_of,
)
from .sequence import Tombstones
from .tombstone_snapshots import newest_snapshot, write_snapshot

__all__ = [
    "CARRIED_APP",
    "METADATA_KEY",
    "TXN_PREFIX",
    "LaneMarks",
    "Mark",
    "MarkRetention",
    "commit_vectors",
    "mark_of",
    "txn_version",
]

log = logging.getLogger(__name__)

#: How often, at most, kept marks are checked for expiry (seconds).
_EXPIRY_CHECK: Final = 60.0


class LaneMarks:
    """The highest mark per lane found in a table's commits (and its last checkpoint), read
    incrementally.

    Blocking (file reads): use from a worker thread, under the table's commit lock.
    """

    def __init__(
        self,
        table_path: Location,
        *,
        history: int = 0,
        tombstones: Tombstones | None = None,
        retention: MarkRetention | None = None,
        clock: Callable[[], float] = time.time,
        store: MarkStore | None = None,
    ) -> None:
        self._table = table_path
        self._clock = clock  # wall-clock seconds: lanes expire by commit times
        #: The deletes the commits record (``sequence_by`` tables), when kept.
        self.tombstones = tombstones
        #: Read the whole log, or the newest snapshot of the tombstones, not only from the last
        #: checkpoint: the table's tombstones are in its commits (a ``sequence_by`` table; its
        #: reader says so).
        self.whole_log = False
        #: Versions between two snapshots of the tombstones this reader writes (0: none).
        self.snapshot_interval = 0
        self._snapshot_at = -1  # the version of the newest snapshot read or written here
        self._tombstones_kept = False
        self._log_dir = log_dir(table_path)
        #: The marks read, shared with the node's other readers of the table's log.
        self.store = store if store is not None else MarkStore()
        self._scanned = -1
        #: How long idle lanes are kept (the table's txn retention is set by its reader).
        self.retention = retention or MarkRetention()
        self._expiry_checked = clock()
        #: Lanes whose mark no ``txn`` action carries yet (see the module): the next commit's.
        self._uncarried: dict[str, Mark] = {}
        #: Whether the table's marks are all carried by ``txn`` actions (see the module).
        self.carried = False
        #: Where the last refresh started reading: the checkpoint's version (None: the log).
        self.started_at: int | None = None
        #: The deletion vector of every live file that has one (path -> descriptor), for a
        #: commit that replaces it (merge-on-read): a ``remove`` must name it.
        self.vectors: dict[str, dict[str, Any]] = {}
        # What each of the last ``history`` commits read changed: the paths it removed, and
        # whether it changed the metadata or protocol (see ``changed_since``).
        self._history = history
        self._changes: collections.OrderedDict[int, tuple[frozenset[str], bool]] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        """Lanes kept."""
        return len(self.store)

    @property
    def scanned(self) -> int:
        """The last log version read (-1 before any)."""
        return self._scanned

    def applied(self, lane: str, mark: Mark) -> bool:
        return self.store.applied(lane, txn_version(mark))

    def refresh(self, latest: int | None = None) -> bool:
        """Read the commits written since the last refresh (by any process); ``latest``: up
        to that version, which the caller knows exists (no listing: it committed it).

        Returns whether one of them changed the table's metadata or protocol (its schema or
        properties, for instance): the caller then reads them again.

        Raises:
            OSError: a commit could not be read; the marks stay at the one before it (its
                marks are read next time, never skipped: a batch it applied must not look new).
        """
        vectors_after = -1
        if self._scanned < 0 and latest is None:
            # Tombstones are complete only when read from the whole log or a snapshot.
            self._tombstones_kept = self.whole_log and self.tombstones is not None
            vectors_after = self._from_snapshot() if self.whole_log else self._from_checkpoint()
        if latest is None:
            versions = commit_versions(self._table, self._scanned, every=self._scanned < 0)
        else:
            versions = list(range(self._scanned + 1, latest + 1))
        if self._scanned < 0 and versions and versions[0] > 0:
            # The first commits are gone: the vectors of older commits are in a checkpoint.
            vectors_after = vectors_of_last_checkpoint(self._log_dir, self.vectors)
        changed = False
        for version, commit_file in zip(versions, fetched(self._log_dir, versions), strict=True):
            commit = read_commit(commit_file, self._history > 0)
            lanes, metadata, removed, added, deleted = commit[:5]
            self._absorb_commit(lanes, commit[5], commit[6])
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
        if self.carried:
            self.store.through = max(self.store.through, self._scanned)
        self._expire()
        self._snapshot_tombstones()
        return changed

    def _from_snapshot(self) -> int:
        """A ``sequence_by`` table: its tombstones from their newest snapshot and its marks from
        the last checkpoint (:mod:`.tombstone_snapshots`); the commits from the earlier of the
        two on are left to read. The checkpoint's version, or -1 (the whole log is read)."""
        snapshot = newest_snapshot(self._table) if self.tombstones is not None else None
        if snapshot is None:
            return -1
        version = self._from_checkpoint()
        if version < 0:
            return -1
        assert self.tombstones is not None
        taken, deletes = snapshot
        for deleted in deletes:
            self.tombstones.absorb(deleted, deleted["at"])
        self._scanned = min(self._scanned, taken)
        self._snapshot_at = taken
        return version

    def _snapshot_tombstones(self) -> None:
        """Write the tombstones as of the version read, once per :attr:`snapshot_interval`
        versions, when they are complete (read from the whole log or a snapshot)."""
        interval = self.snapshot_interval
        if not (self._tombstones_kept and interval > 0 and self.tombstones is not None):
            return
        if self._scanned // interval > self._snapshot_at // interval:
            write_snapshot(self._table, self._scanned, self.tombstones)
            self._snapshot_at = self._scanned

    def _from_checkpoint(self) -> int:
        """Start from the last checkpoint when it carries every lane's mark: its ``txn``
        actions and live files' vectors read, the commits from its version on left to read.
        The checkpoint's version, or -1 (the whole log is read)."""
        last = last_checkpoint(self._log_dir)
        if last is None:
            return -1
        version = int(last["version"])
        parts = checkpoint_files(self._log_dir, last)
        # The node's other reader of the table may have read this checkpoint's marks already,
        # or every commit up to it (a new committer, after a failover, reads none of them).
        txns = self.store.checkpoint != version and self.store.through < version
        tables = []
        vectors: dict[str, dict[str, Any]] = {}
        try:
            for part in parts:
                if txns:
                    tables.append(checkpoint_txns(part))
                vectors.update(checkpoint_vectors(part, ("add",)))
        except Exception as exc:  # noqa: BLE001 - an unreadable checkpoint: read the log
            log.warning(
                "cannot read the checkpoint at version %d of %s: %s", version, self._table, exc
            )
            return -1
        if not parts or (txns and not self._load_txns(tables)):
            return -1  # its marks are not all carried: the whole log is read
        self.store.checkpoint = version
        self.carried = True
        self.vectors.update(vectors)
        self.started_at = version
        # The checkpoint's own commit is read as well: a commitInfo mark no txn carried.
        self._scanned = version - 1
        return version

    def _load_txns(self, tables: list[Any]) -> bool:
        """Keep the marks of a checkpoint's ``txn`` actions (Arrow tables, see
        :func:`.checkpoint_txns`) that their retention still keeps, if the checkpoint carries
        every lane's mark; whether it does. Filtered in Arrow: it may hold a lane per stream."""
        import pyarrow as pa
        import pyarrow.compute as pc

        txns = pa.concat_tables(tables)
        apps = txns.column("appId")
        if not pc.any(pc.equal(apps, CARRIED_APP)).as_py():
            return False
        now = self._minute()
        minutes = pc.min_element_wise(
            pc.fill_null(pc.divide(txns.column("lastUpdated"), 60_000), now), MINUTES
        )
        random = pc.starts_with(apps, TXN_PREFIX + RANDOM_LANE_PREFIX)
        retention = pc.if_else(random, self.retention.random, self.retention.durable)
        idle = pc.multiply(pc.subtract(now, minutes), 60)
        kept = pc.and_(pc.starts_with(apps, TXN_PREFIX), pc.less_equal(idle, retention))
        lanes = pc.utf8_slice_codeunits(apps.filter(kept), len(TXN_PREFIX))
        # Through numpy: a fraction of the time of ``to_pylist`` for 100,000 values.
        self.store.load(
            lanes.to_numpy(zero_copy_only=False).tolist(),
            txns.column("version").filter(kept).to_numpy().tolist(),
            minutes.filter(kept).to_numpy().tolist(),
        )
        return True

    def _minute(self) -> int:
        return minute_of(self._clock() * 1000)

    def _absorb_commit(
        self,
        lanes: Mapping[str, Mark],
        txns: Mapping[str, Mark],
        info: tuple[int | None, bool, list[str]],
    ) -> None:
        """One commit's marks: its ``commitInfo``'s ``lanes`` and its ``txn`` actions', and
        the lanes it forgets."""
        at, carried, forgotten = info
        if forgotten:
            self.store.forget(forgotten, logged=True)
            for lane in forgotten:
                self._uncarried.pop(lane, None)
        minute = self._minute() if at is None else minute_of(at)
        self.store.keep((lane, txn_version(mark), minute) for lane, mark in txns.items())
        self.store.keep((lane, txn_version(mark), minute) for lane, mark in lanes.items())
        for lane, mark in txns.items():
            pending = self._uncarried.get(lane)
            if pending is not None and pending <= mark:
                del self._uncarried[lane]
        for lane, mark in lanes.items():
            if txns.get(lane, (-1, -1)) < mark and self._uncarried.get(lane, (-1, -1)) < mark:
                self._uncarried[lane] = mark
        if carried:
            self.carried = True

    def _expire(self) -> None:
        """Forget the lanes idle for longer than their retention (at most once a minute)."""
        clock = self._clock()
        if clock - self._expiry_checked < _EXPIRY_CHECK:
            return
        self._expiry_checked = clock
        self.store.expire(self._minute(), self.retention)
        if any(lane not in self.store for lane in self._uncarried):
            self._uncarried = {k: v for k, v in self._uncarried.items() if k in self.store}

    def carrying(
        self, lanes: Mapping[str, Mark], forgotten: Iterable[str] = ()
    ) -> list[dict[str, Any]]:
        """The ``txn`` actions of a commit that applies ``lanes``: theirs, every mark not yet
        carried, the table's ``deltaflow`` one while it is not, and one that forgets each lane
        of a closed random-id stream, forgotten here or by a writer (``forgotten``), that the
        log still keeps: Delta then drops it from the table's checkpoints."""
        now = int(self._clock() * 1000)
        marks = dict(self._uncarried)
        for lane, mark in lanes.items():
            if marks.get(lane, (-1, -1)) < mark:
                marks[lane] = mark
        actions = [
            {"txn": {"appId": TXN_PREFIX + lane, "version": txn_version(m), "lastUpdated": now}}
            for lane, m in marks.items()
        ]
        gone = dict.fromkeys(self.store.unlogged()) | dict.fromkeys(forgotten)
        actions += [
            {"txn": {"appId": TXN_PREFIX + lane, "version": 0, "lastUpdated": FORGOTTEN_AT}}
            for lane in gone
            if lane not in marks and lane.startswith(RANDOM_LANE_PREFIX)
        ]
        if not self.carried:
            actions.append(
                {"txn": {"appId": CARRIED_APP, "version": CARRIED_VERSION, "lastUpdated": now}}
            )
        return actions

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

    def replaced_at(self, version: int, paths: frozenset[str]) -> bool:
        """Whether commit ``version`` (remembered, see ``history``) removed one of ``paths``."""
        change = self._changes.get(version)
        return change is not None and not paths.isdisjoint(change[0])

    def absorb(self, lanes: Mapping[str, Mark]) -> None:
        """``lanes`` were applied by a commit of this node (read back later)."""
        minute = self._minute()
        self.store.keep((lane, txn_version(mark), minute) for lane, mark in lanes.items())

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
