"""One table's committer on a node: its staging queue, and the task that takes, prepares and
commits group after group.

Every commit holds the table's commit atomicity (:mod:`.atomicity`) for its read-modify-write
of the log and records the group's lane marks (:mod:`.marks`), so a batch is applied once
whoever else writes (what happens while held is :class:`.TableWriter`'s). The group is taken
and prepared (its rows collapsed and conformed, and for merge-on-read its new files written)
before that, so the exclusive part is only the part that reads and writes the log: two nodes
writing one table mostly prepare at the same time. A commit that loses a race is retried.

A table that does not exist is created by the first commit that writes it, with the node's
defaults, in a commit of its own before the group's write.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Final

from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random_exponential,
)

from ..._faults import fault_point
from ...errors import CommitConflictError, LaneFailedError, ServerError
from ...logs import event
from ..atomicity import MAX_CONFLICT_WAIT
from ..footprint import Footprint
from ..group import PreparedGroup
from ..merge_on_read import write_group
from ..settings import BUCKET_COLUMN
from ..statistics import TableStatistics
from .holding import CheckpointWriter, finish, hold_table
from .owner_writes import TableCreated, TableWriter
from .prepared import OutcomeKind
from .staging import Staged, StagingQueue, settle

if TYPE_CHECKING:
    from .engine import OwnerEngine

__all__ = ["COMMITTER_RETRY_SECONDS", "TableOwner"]

log = logging.getLogger(__name__)

#: A committer that failed before taking a group (a bug) tries again after this pause.
COMMITTER_RETRY_SECONDS: Final = 1.0
#: Times a table's committer may send a group back to be prepared again before it fails
#: (each time, another commit had replaced one of its files or changed the table).
SEND_BACK_LIMIT: Final = 20
#: A commit that takes this long logs ``commit.slow`` at WARNING (else ``commit`` at INFO).
SLOW_COMMIT_SECONDS: Final = 10.0


class TableOwner(TableWriter):
    """Owns one table on this node: its staging queue and commit task (what it knows of the
    table, and how a group is applied, are :class:`.TableWriter`'s)."""

    def __init__(self, engine: OwnerEngine, name: str) -> None:
        super().__init__(engine, name)
        self.queue = StagingQueue(engine.settings)
        self.taken: list[Staged] | None = None  # the group being committed, until settled
        self.loaded = False
        self.released_at: float | None = None  # when this node last released the table
        self.checkpoints = CheckpointWriter(engine, name)
        self.task = asyncio.create_task(self._run(), name=f"deltaflow-owner-{name}")

    async def load(self) -> None:
        if not self.loaded:
            await self.engine.in_thread(self.describe)
            self.loaded = True

    def put(self, staged: Staged) -> None:
        self.queue.put(staged)
        self.engine.stats.queued_rows += staged.rows
        self.table_stats.queued_rows += staged.rows

    @property
    def table_stats(self) -> TableStatistics:
        return self.engine.stats.table(self.name)

    def in_flight(self) -> int:
        """Batches staged and not yet settled: queued, or in the group being committed."""
        return len(self.queue.items) + len(self.taken or ())

    async def _run(self) -> None:
        """Commit group after group for as long as the node runs. An error nothing else
        handles (a bug) fails the group taken, if any, and the committer goes on: batches are
        never left waiting for a commit that will not come."""
        while True:
            try:
                await self._commit_next()
            except Exception as exc:  # reported to the batches, then go on
                log.exception("table %s: the committer failed", self.name)
                taken, self.taken = self.taken, None
                if taken:
                    self._fail(
                        taken, f"the committer of table {self.name!r} failed: {exc}", count=True
                    )
                else:  # nothing was taken: try again, after a pause rather than in a spin
                    await asyncio.sleep(COMMITTER_RETRY_SECONDS)

    async def _commit_next(self) -> None:
        """Wait for writes, take the next group, prepare and commit it; again and again."""
        queue = self.queue
        while True:
            self.taken = None  # the last group was settled (committed or failed)
            idle = not queue.ready.is_set()
            await queue.ready.wait()
            if idle and queue.converting:
                await queue.gather()
            await queue.pace()
            if not queue.any_takeable():
                queue.ready.clear()  # only writes of receivers still running: wait for release
                continue
            group = self.taken = queue.take()
            taken_rows = sum(staged.rows for staged in group)
            self.engine.stats.queued_rows -= taken_rows
            self.table_stats.queued_rows -= taken_rows
            fault_point("taken")
            preparing = asyncio.ensure_future(self.engine.in_thread(self._prepare, group))
            try:
                prepared = await asyncio.shield(preparing)
            except asyncio.CancelledError:  # the node stops: the group was taken off the queue
                self._fail(group, "node stopped before commit", count=False)
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. a full disk: the commit does it all
                log.warning("table %s: preparing a group failed (%s)", self.name, exc)
                prepared = None
            await self._apply(group, prepared)

    async def _apply(self, group: list[Staged], prepared: PreparedGroup | None) -> None:
        """Commit ``group``: through the table's committer when there is one and the group
        can be prepared for it, else holding the table here. A held commit that loses the
        race for its version (another node created the table first, say) goes back to the
        committer rather than racing it again."""
        has_committer = self._has_committer
        for attempt in range(self.engine.atomicity.conflict_attempts):
            if attempt:  # a random pause, as between racing commits (a group held each time)
                await asyncio.sleep(random.uniform(0, min(MAX_CONFLICT_WAIT, 0.02 * 2**attempt)))
            if has_committer and await self._through_committer(group, prepared):
                return
            try:
                held = await hold_table(self.engine, self.name, self.released_at)
            except asyncio.CancelledError:  # the node stops
                self._fail(group, "node stopped before commit", count=False)
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. the lock's timeout: fail the group
                self._fail(group, str(exc), count=True)
                return
            try:
                # A commit under way finishes (and settles its batches) even when the node
                # stops, so the table is never released under a running commit.
                sent_back = await finish(self._commit_group(group, prepared, has_committer))
            finally:
                held.__exit__(None, None, None)  # does not block: on the loop
                self.released_at = time.monotonic()
            due = self.engine.checkpoints_due.pop(self.path, None)
            if due is not None:
                self.checkpoints.start(due)
            if not sent_back:
                return
            group, prepared = sent_back, None
        self._fail(
            group,
            f"table {self.name!r}: every commit of this group lost the race for its version",
            count=True,
        )

    def _fail(self, group: list[Staged], message: str, *, count: bool) -> None:
        """Settle a group taken off the queue that will not be committed (``count``: as
        failed batches, not as batches of a stopping node)."""
        for staged in group:
            if staged.future.done():
                continue  # settled already (a failure after part of the group was)
            if count:
                self.engine.stats.batches_failed += 1
                self.table_stats.batches_failed += 1
            settle(staged.future, ServerError(message, node=self.engine.node_id))

    def fail_queued(self, message: str) -> None:
        """Settle every write still queued (the node stops)."""
        for staged in self.queue.items:
            settle(staged.future, ServerError(message, node=self.engine.node_id))

    def _live(self, group: list[Staged]) -> list[Staged]:
        """The writes of ``group`` still to apply; the abandoned ones are settled (checked
        right before every commit attempt)."""
        live = []
        for staged in group:
            if staged.abandoned is not None and staged.abandoned():
                settle(
                    staged.future,
                    LaneFailedError(
                        "not applied: this batch or an earlier one of its partition failed",
                        node=self.engine.node_id,
                    ),
                )
            else:
                live.append(staged)
        return live

    async def _through_committer(self, group: list[Staged], prepared: PreparedGroup | None) -> bool:
        """Apply ``group`` through the table's committer (:mod:`.committer`): prepare its
        files here, send them, settle the writes by the answer. False when this group needs
        the table held instead (the table must be created or given columns, or its writes
        need a MERGE); the caller then commits it itself."""
        sink = self.engine.commit_sink
        assert sink is not None
        stats = self.engine.stats
        for _ in range(SEND_BACK_LIMIT):
            group = self._live(group)
            if not group:
                return True
            started = time.monotonic()
            try:
                ready = await finish(self.engine.in_thread(self._prepare_commit, group, prepared))
            except Exception as exc:  # noqa: BLE001 - the held commit applies it, or says why
                log.debug("table %s: committing this group here (%s)", self.name, exc)
                return False
            if ready is None:
                return False
            outcome = None
            if ready.commit is not None:
                stats.groups_prepared += 1
                try:
                    outcome = await sink.submit(ready.commit)
                except asyncio.CancelledError:  # the node stops: in doubt, the marks decide
                    self._fail(group, "node stopped before commit", count=False)
                    raise
                if outcome.kind is OutcomeKind.RETRY:
                    stats.groups_sent_back += 1
                    log.info("table %s: a group was sent back (%s)", self.name, outcome.reason)
                    prepared = None
                    continue
                if outcome.kind is OutcomeKind.FAILED:
                    self._fail(
                        group,
                        f"committer {outcome.committer} could not commit table {self.name!r}: "
                        f"{outcome.reason}",
                        count=True,
                    )
                    return True
                self.marks.absorb(ready.commit.lanes)
            applied = outcome is not None and outcome.kind is OutcomeKind.COMMITTED
            if outcome is not None and applied and ready.commit is not None:
                self.engine.landed(self.path, ready.done)
                # From this attempt's preparation to the committer's answer.
                elapsed = time.monotonic() - started + (prepared.seconds if prepared else 0.0)
                self._count_commit(
                    ready.commit.rows, len(ready.todo), elapsed, outcome.version, outcome.committer
                )
            deduplicated = len(group) - (len(ready.todo) if applied else 0)
            stats.batches_deduplicated += deduplicated
            self.table_stats.batches_deduplicated += deduplicated
            if applied:
                fault_point("after_commit")
            self._settle(group)
            return True
        self._fail(
            group,
            f"table {self.name!r} changed under this group {SEND_BACK_LIMIT} times running",
            count=True,
        )
        return True

    def _settle(self, group: list[Staged]) -> None:
        """The group's commit landed (or the table held it already)."""
        landed = time.monotonic()
        for stats in (self.engine.stats, self.table_stats):
            durable = stats.batch_durable_seconds_histogram
            for staged in group:
                durable = durable.observe(landed - staged.staged_at)
            stats.batch_durable_seconds_histogram = durable
        stats = self.engine.stats
        queued, committing = (
            stats.batch_queued_seconds_histogram,
            stats.batch_committing_seconds_histogram,
        )
        for staged in group:
            taken = staged.taken_at or landed
            queued = queued.observe(taken - staged.staged_at)
            committing = committing.observe(landed - taken)
        stats.batch_queued_seconds_histogram = queued
        stats.batch_committing_seconds_histogram = committing
        for staged in group:
            settle(staged.future, None)

    async def _commit_group(
        self,
        group: list[Staged],
        prepared: PreparedGroup | None = None,
        has_committer: bool = False,
    ) -> list[Staged]:
        """Commit ``group`` with the table held; the writes that must go to the table's
        committer instead (nothing settled for them): with ``has_committer``, the group lost
        the race for its version, or the table was created (here or by another node) and
        exists now. The others are settled, each with its own error if it failed."""
        group = self._live(group)
        if not group:
            return []
        try:
            await self._commit_with_retries(group, prepared, once=has_committer)
        except (CommitConflictError, TableCreated) as exc:
            if has_committer:
                return group
            return await self._commit_failed(group, exc, has_committer)
        # Whatever the commit raised settles the batches' futures (or isolates the culprit).
        except Exception as exc:  # noqa: BLE001
            return await self._commit_failed(group, exc, has_committer)
        self._settle(group)
        return []

    async def _commit_failed(
        self, group: list[Staged], exc: Exception, has_committer: bool = False
    ) -> list[Staged]:
        """Settle a failed group's writes with its error, or if it held several commit them
        one by one; the writes that must go to the table's committer instead, as
        ``_commit_group`` returns them."""
        if len(group) == 1:
            self.engine.stats.batches_failed += 1
            self.table_stats.batches_failed += 1
            settle(group[0].future, exc)
            return []
        # Isolate the culprit: the others must not fail with it, nor with the table's
        # creation by the first of them (which sends that one to the table's committer).
        log.warning(
            "group commit to %s failed (%s); applying its %d batches one by one",
            self.name,
            exc,
            len(group),
        )
        sent_back: list[Staged] = []
        for staged in group:  # has_committer too: one that creates the table goes on through it
            sent_back += await self._commit_group([staged], has_committer=has_committer)
        return sent_back

    async def _commit_with_retries(
        self, group: list[Staged], prepared: PreparedGroup | None, *, once: bool = False
    ) -> None:
        stats = self.engine.stats
        atomicity = self.engine.atomicity
        retrying = AsyncRetrying(  # a lost race is tried again, after 0.1, 0.2, 0.4, 0.8 s
            retry=retry_if_exception_type(CommitConflictError),
            stop=stop_after_attempt(1 if once else atomicity.conflict_attempts),
            wait=(
                # Racing writers without a lock: random pauses, so they do not meet again.
                wait_random_exponential(multiplier=0.02, max=MAX_CONFLICT_WAIT)
                if atomicity.optimistic
                else wait_exponential(multiplier=0.1)
            ),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                started = time.monotonic()
                try:
                    rows = await self.engine.in_thread(self._commit, group, prepared)
                except CommitConflictError:
                    stats.commit_conflicts += 1
                    self.table_stats.commit_conflicts += 1
                    raise
        # The commit time counts the group's preparation too (not the wait for the table).
        elapsed = time.monotonic() - started + (prepared.seconds if prepared else 0.0)
        self._count_commit(rows, len(group), elapsed)

    def _count_commit(
        self,
        rows: int,
        batches: int,
        seconds: float,
        version: int | None = None,
        committer: str | None = None,
    ) -> None:
        """A group of this node's landed: ``rows`` in ``batches``, ``seconds`` to commit, in
        ``version`` (None: not known here) by ``committer`` (None: this node, holding it)."""
        stats = self.engine.stats
        stats.largest_group_rows = max(stats.largest_group_rows, rows)
        stats.commit_seconds += seconds
        table = self.table_stats
        for counted in (stats, table):
            counted.commits += 1
            counted.rows_committed += rows
            counted.batches_committed += batches
            counted.commit_seconds_histogram = counted.commit_seconds_histogram.observe(seconds)
            counted.group_rows_histogram = counted.group_rows_histogram.observe(rows)
        table.last_commit_at = time.time()
        table.recent.append((table.last_commit_at, rows, batches, seconds, version))
        if version is not None:
            table.last_version = max(version, table.last_version or -1)
        slow = seconds >= SLOW_COMMIT_SECONDS
        event(
            log,
            "commit.slow" if slow else "commit",
            f"table {self.name}: {rows} rows of {batches} batches committed in {seconds:.3f}s"
            + (f" (slow: over {SLOW_COMMIT_SECONDS:g}s)" if slow else ""),
            level=logging.WARNING if slow else logging.INFO,
            table=self.name,
            version=version,
            rows=rows,
            batches=batches,
            seconds=round(seconds, 4),
            committer=committer or self.engine.node_id,
        )

    def _prepare(self, group: list[Staged]) -> PreparedGroup | None:
        """Blocking, before the table is held: the group's rows as its commit will apply them,
        and for merge-on-read its new files written, when the table exists and the group needs
        no change to it; else None (the commit does it all while held, where an error is also
        reported)."""
        prepared = self._prepare_group(group)
        fault_point("prepared")
        return prepared

    def _prepare_group(self, group: list[Staged]) -> PreparedGroup | None:
        started = time.monotonic()
        settings, schema = self.settings, self.schema
        if settings is None or schema is None or not self.key:
            return None
        if settings.managed and list(settings.key) != self.key:
            return None  # reported while held
        try:
            data = self._conform(
                self._group_rows(group),
                recompute=any(s.buckets != settings.buckets for s in group),
                evolve=False,
            )
        except Exception:  # noqa: BLE001 - prepared again while held, which reports it
            return None
        written = None
        if (
            len(self.key) == 1
            and set(self.partition_columns) <= {BUCKET_COLUMN}
            and self.engine.merges_on_read(settings)
            # Its rows are known once the stored ones are read (sequences, merge modes).
            and not settings.sequence_by
            and settings.merge == "last"
            and settings.history == "none"
        ):
            written = write_group(self.path, data, schema, self.key[0])
        footprint = Footprint.of(
            data, self.key, bucketed=bool(settings.buckets), levels=settings.levels
        )
        return PreparedGroup(
            len(group), data, settings, schema, written, time.monotonic() - started, footprint
        )
