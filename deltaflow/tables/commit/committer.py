"""A table's committer: commits the groups its writers prepared, many in one Delta version.

Every partition owner writes its groups' data files itself (:class:`.PreparedCommit`), in
parallel with the other owners. The committer of a table (one live node, chosen by the cluster
map; :mod:`deltaflow.server.commits`) takes whatever prepared groups have arrived while its
last commit ran and commits them together: one version, one read of the log, no race among
the writers. Their buckets are disjoint, so their actions do not overlap; a group that no
longer fits the table (a later commit replaced one of its files or changed the schema, or a
lane of it moved to another writer and was applied there) is sent back to be prepared again.

A group from another node is committed only if its writer owns, in a map this committer held
of late (:class:`Ownership`), the partition of every lane it marks and a partition placed in
the bucket of every file it adds or removes; what cannot be checked (a file outside the
bucket layout, a lane without a partition) is refused too. A refusal is a ``retry``: the
committer first waits a while for its own map to change, so a map that lags the writer's
after a failover heals instead of failing the group.

The commit is fenced as every deltaflow commit is: it holds the table's commit atomicity, it
lands at exactly the version after the one whose lane marks it checked (create-if-absent), and
it records every group's lane marks. A committer that paused and lost its place, or two nodes
that both believe they commit a table, cannot apply a group twice: the late one finds the
version taken, reads the marks again and answers ``applied``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from ..._faults import fault_point
from ...errors import CommitConflictError
from ...logs import event
from ..marks import LaneMarks, Mark, MarkRetention
from ..sequence import merged_deletes
from ..settings import CHECKPOINT_INTERVAL, PROP_CHECKPOINT_INTERVAL, TableSettings
from .compaction import Compactor
from .holding import CheckpointWriter, finish, hold_table
from .ownership import NotOwned, Ownership, foreign, owned_lanes
from .prepared import Outcome, OutcomeKind, PreparedCommit

if TYPE_CHECKING:
    from ...partitioning import PartitionMap
    from .engine import CommitterEngine

__all__ = ["MAX_COMBINED", "TableCommitter"]

log = logging.getLogger(__name__)

#: The most prepared groups one version combines.
MAX_COMBINED: Final = 256
#: Commits a committer remembers the replaced files of, to check groups prepared that many
#: versions back (a writer's group is normally one or two behind).
HISTORY: Final = 1000
#: Versions a combined commit tries before its groups are sent back (another writer, outside
#: the committer, kept taking the next version).
COMMIT_ATTEMPTS: Final = 20


class TableCommitter:
    """Commits prepared groups to one table on this node (its committer).

    Args:
        engine: the node's table engine: it holds the table's atomicity and commits actions
            (``commit_actions``).
        table: the table's name.
    """

    def __init__(self, engine: CommitterEngine, table: str) -> None:
        self.engine = engine
        self.name = table
        self.path = engine.warehouse / table
        self.marks = LaneMarks(self.path, history=HISTORY, store=engine.mark_stores.of(self.path))
        self._pending: list[tuple[PreparedCommit, asyncio.Future[Outcome]]] = []
        self._arrived = asyncio.Event()
        self._released_at: float | None = None
        self._interval: int | None = None  # the table's checkpoint interval, 0: the default
        self._layout: TableSettings | None = None  # read with the interval
        #: The maps other nodes' groups are checked against (None: they are not checked).
        self.ownership: Ownership | None = None
        self._checkpoint_due: int | None = None
        self.checkpoints = CheckpointWriter(engine, table)
        self.version: int | None = None  # the last version this committer committed
        # Whether the marks were read up to the latest version this committer knows of: after
        # its own commit they are, and the log is not listed again before the next (a commit
        # it did not see holds the next version, so that commit's write fails and lists).
        self._current = False
        self.compactor = Compactor(table, self.path, engine.node_id, engine.settings.compaction)
        self._compactions: set[int] = set()  # ids of the compactions' commits waiting
        self._committing = False  # a combined commit runs (on its thread)
        self._compacted: collections.deque[int] = collections.deque(maxlen=HISTORY)
        self.task = asyncio.create_task(self._run(), name=f"deltaflow-committer-{table}")
        self.maintenance = asyncio.create_task(self._maintain(), name=f"deltaflow-compact-{table}")

    @property
    def waiting(self) -> int:
        """Prepared groups that arrived and wait for the next commit."""
        return len(self._pending)

    async def submit(self, prepared: PreparedCommit, ownership: Ownership | None = None) -> Outcome:
        """Commit ``prepared`` with the others that arrive meanwhile; its outcome.
        ``ownership``: the maps a group of another node is checked against (kept for every
        later group; without one ever given, no group is checked)."""
        if ownership is not None:
            self.ownership = ownership
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while True:
            future: asyncio.Future[Outcome] = loop.create_future()
            self._pending.append((prepared, future))
            self._arrived.set()
            outcome = await asyncio.shield(future)  # a caller that gives up leaves it be
            if not isinstance(outcome, NotOwned) or self.ownership is None:
                return outcome
            # This committer's map may lag the writer's: check again once it changes.
            if deadline is None:
                deadline = loop.time() + self.ownership.wait
            moved = await self.ownership.changed_since(outcome.map_version, deadline - loop.time())
            if not moved:
                log.warning(
                    "table %s: refused a group of node %s: %s", self.name, prepared.writer,
                    outcome.reason,
                )  # fmt: skip
                return Outcome(
                    OutcomeKind.RETRY, reason=outcome.reason, committer=outcome.committer
                )

    async def stop(self) -> None:
        for task in (self.maintenance, self.task):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.checkpoints.wait()
        for _, future in self._pending:
            if not future.done():
                future.set_result(Outcome(OutcomeKind.RETRY, reason="the committer stopped"))

    async def _run(self) -> None:
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            while self._pending:
                batch = self._pending[:MAX_COMBINED]
                del self._pending[:MAX_COMBINED]
                # A compaction is taken last: a writer's group replacing one of its files wins.
                batch.sort(key=lambda waiting: id(waiting[0]) in self._compactions)
                try:
                    outcomes = await self._commit_held(batch)
                except asyncio.CancelledError:
                    for _, future in batch:
                        if not future.done():
                            future.set_result(
                                Outcome(OutcomeKind.RETRY, reason="the committer stopped")
                            )
                    raise
                except Exception as exc:
                    log.exception("table %s: a combined commit failed", self.name)
                    outcomes = [Outcome(OutcomeKind.FAILED, reason=str(exc))] * len(batch)
                for (_, future), outcome in zip(batch, outcomes, strict=True):
                    if not future.done():
                        future.set_result(outcome)

    async def _maintain(self) -> None:
        """Compact the table between commits, throttled (:mod:`.compaction`)."""
        compactor = self.compactor
        stats = self.engine.stats.table(self.name)
        while compactor.settings.enabled:
            await asyncio.sleep(compactor.settings.interval)
            if self._pending or self._committing or self.version is None:
                continue  # groups wait, or this node committed nothing yet: not now
            # The marks' version and vectors, read while no commit runs: the files are
            # listed at that version, and the commit is checked against what came after.
            version, vectors = self.marks.scanned, dict(self.marks.vectors)
            try:
                stats.live_files, compaction = await self.engine.in_thread(
                    compactor.prepare, version, vectors
                )
            except Exception as exc:  # noqa: BLE001 - only the compaction is lost
                log.warning("table %s: a compaction could not be prepared: %s", self.name, exc)
                continue
            if compaction is None:
                continue
            self._compactions.add(id(compaction.commit))
            try:
                outcome = await self.submit(compaction.commit)
            finally:
                self._compactions.discard(id(compaction.commit))
            if outcome.kind is not OutcomeKind.COMMITTED or outcome.version is None:
                stats.compactions_dropped += 1
                log.info("table %s: a compaction was dropped (%s)", self.name, outcome.reason)
                continue
            self._compacted.append(outcome.version)
            stats.compactions += 1
            stats.compacted_files += compaction.files
            stats.compacted_bytes += compaction.bytes
            stats.last_compacted_at = time.time()
            stats.live_files -= compaction.files - 1
            event(
                log,
                "table.compacted",
                f"table {self.name}: version {outcome.version} compacts {compaction.files} "
                f"files ({compaction.bytes} bytes) of bucket {compaction.bucket}",
                table=self.name,
                version=outcome.version,
                files=compaction.files,
                bytes=compaction.bytes,
                bucket=compaction.bucket,
            )

    async def _commit_held(
        self, batch: list[tuple[PreparedCommit, asyncio.Future[Outcome]]]
    ) -> list[Outcome]:
        held = await hold_table(self.engine, self.name, self._released_at)
        maps = self.ownership.maps() if self.ownership is not None else None
        self._committing = True
        try:
            return await finish(
                self.engine.in_thread(self._commit, [prepared for prepared, _ in batch], maps)
            )
        finally:
            self._committing = False
            held.__exit__(None, None, None)
            self._released_at = time.monotonic()
            due, self._checkpoint_due = self._checkpoint_due, None
            if due is not None:
                self.checkpoints.start(due)

    def _commit(
        self, batch: list[PreparedCommit], maps: Sequence[PartitionMap] | None = None
    ) -> list[Outcome]:
        """Blocking, with the table held: commit every group of ``batch`` that still fits the
        table in one version; each group's outcome. ``maps``: the maps other nodes' groups
        are checked against (None: not checked)."""
        node = self.engine.node_id
        for _ in range(COMMIT_ATTEMPTS):
            scanned = self.marks.scanned
            stale = not self._current or any(p.read_version > scanned for p in batch)
            if (stale and self.marks.refresh()) or self._interval is None:
                # (A metadata change also shows in ``changed_since`` for groups read before.)
                described = self.engine.describe(self.name, self.path)
                configured = described.properties
                self.marks.retention = MarkRetention.of_table(
                    configured, self.engine.settings.random_marks_seconds
                )
                self._interval = int(configured.get(PROP_CHECKPOINT_INTERVAL) or 0)
                self._layout = TableSettings.from_table(configured, described.schema.names)
            outcomes, chosen = self._sort(batch, maps)
            if not chosen:
                return outcomes
            lanes: dict[str, Mark] = LaneMarks.highest(
                (lane, mark) for i in chosen for lane, mark in batch[i].lanes.items()
            )
            writers = {batch[i].writer for i in chosen}
            actions: list[dict[str, Any]] = [a for i in chosen for a in batch[i].actions]
            forgotten = [lane for i in chosen for lane in self._forgettable(batch[i], maps)]
            actions += self.marks.carrying(lanes, forgotten)  # where a checkpoint keeps them
            deleted = merged_deletes(batch[i].deleted for i in chosen)
            metadata = LaneMarks.user_metadata(node, lanes, writers, deleted)
            read = self.marks.scanned
            started = time.monotonic()
            fault_point("before_combined_commit")
            try:
                version = self.engine.commit_actions(self.name, self.path, read, actions, metadata)
            except CommitConflictError as exc:
                log.info(
                    "table %s: version %d was taken (%s); reading again", self.name, read + 1, exc
                )
                self.engine.stats.commit_conflicts += 1
                self.engine.stats.table(self.name).commit_conflicts += 1
                self._current = False
                continue
            except Exception as exc:  # noqa: BLE001 - in doubt: it may have landed
                # (A store that did not answer.) The marks tell: each writer prepares again,
                # and finds its group applied or not.
                log.warning("table %s: a combined commit is in doubt: %s", self.name, exc)
                self.engine.stats.commits_in_doubt += 1
                self._current = False
                return [
                    Outcome(
                        OutcomeKind.RETRY,
                        reason=f"the commit of version {read + 1} is in doubt: {exc}",
                        committer=node,
                    )
                    for _ in batch
                ]
            # Its own commit read back (from the node's kept commits, no request): the marks,
            # the files it replaced and its vectors as any other commit's.
            self.marks.refresh(version)
            self.marks.absorb(lanes)  # even if the read back failed
            self._current = self.marks.scanned == version
            if version % (self._interval or CHECKPOINT_INTERVAL) == 0:
                self._checkpoint_due = version
            self._count(batch, chosen, time.monotonic() - started, version)
            fault_point("after_combined_commit")
            self.version = version
            for i in chosen:
                outcomes[i] = Outcome(OutcomeKind.COMMITTED, version, committer=node)
            return outcomes
        return [
            Outcome(
                OutcomeKind.RETRY,
                reason=f"the next version of table {self.name!r} was taken "
                f"{COMMIT_ATTEMPTS} times running",
                committer=node,
            )
            for _ in batch
        ]

    def _forgettable(
        self, prepared: PreparedCommit, maps: Sequence[PartitionMap] | None
    ) -> Sequence[str]:
        """The lanes ``prepared`` asks to forget that its writer may: a peer's in the
        partitions it owns (as its lanes, ``_sort``), this node's all."""
        if maps and prepared.writer != self.engine.node_id:
            return owned_lanes(prepared.forgotten, prepared.writer, maps)
        return prepared.forgotten

    def _sort(
        self, batch: list[PreparedCommit], maps: Sequence[PartitionMap] | None = None
    ) -> tuple[list[Outcome], list[int]]:
        """Each group's outcome if it is not committed now, and the groups that are."""
        node = self.engine.node_id
        outcomes: list[Outcome] = []
        chosen: list[int] = []
        taken: set[str] = set()  # files the chosen groups replace
        applying: set[str] = set()  # lanes the chosen groups apply
        for i, prepared in enumerate(batch):
            # A node's own groups are its own; another's must stay within its partitions.
            if maps and prepared.writer != node:
                refused = foreign(prepared, maps, self._layout)
                if refused is not None:
                    outcomes.append(
                        NotOwned(OutcomeKind.RETRY, None, refused, node, maps[0].version)
                    )
                    continue
            held = self.marks.applied
            if prepared.lanes and all(held(lane, m) for lane, m in prepared.lanes.items()):
                outcomes.append(Outcome(OutcomeKind.APPLIED, committer=node))
                continue
            # A lane's writes in the group are a run of its marks: the table holding the first
            # holds some of them (another owner applied them meanwhile).
            some = [lane for lane, first in prepared.starts.items() if held(lane, first)]
            reason = None
            if some:
                reason = f"lane {some[0]} of it was applied meanwhile"
            elif not applying.isdisjoint(prepared.lanes):
                reason = "another group of this commit applies one of its lanes"
            else:
                reason = self.marks.changed_since(prepared.read_version, prepared.removes)
                if reason is not None and self._compacted_since(prepared):
                    self.engine.stats.table(self.name).groups_sent_back_by_compaction += 1
            if reason is None and not taken.isdisjoint(prepared.removes):
                reason = "another group of this commit replaces one of its files"
            if reason is not None:
                outcomes.append(Outcome(OutcomeKind.RETRY, reason=reason, committer=node))
                continue
            taken |= prepared.removes
            applying |= prepared.lanes.keys()
            chosen.append(i)
            outcomes.append(Outcome(OutcomeKind.COMMITTED, committer=node))  # version set after
        return outcomes, chosen

    def _compacted_since(self, prepared: PreparedCommit) -> bool:
        """Whether a compaction after the group's version replaced one of its files."""
        return any(
            v > prepared.read_version and self.marks.replaced_at(v, prepared.removes)
            for v in self._compacted
        )

    def _count(
        self, batch: list[PreparedCommit], chosen: list[int], seconds: float, version: int
    ) -> None:
        stats = self.engine.stats
        stats.combined_commits += 1
        stats.combined_groups += len(chosen)
        stats.combined_seconds += seconds
        table = stats.table(self.name)
        table.combined_commits += 1
        table.last_version = max(version, table.last_version or -1)
        event(
            log,
            "commit.combined",
            f"table {self.name}: version {version} combines {len(chosen)} groups of "
            f"{len({batch[i].writer for i in chosen})} nodes ({seconds:.3f}s)",
            table=self.name,
            version=version,
            groups=len(chosen),
            writers=sorted({batch[i].writer for i in chosen}),
            seconds=round(seconds, 4),
        )
