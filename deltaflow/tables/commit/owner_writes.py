"""How one group is applied to a table while its commit atomicity is held: writes the table
already holds are dropped, the table is created or given new columns if needed, and the rest
lands in one commit that also records the group's lane marks (:mod:`.marks`). What the node
knows of the table is :class:`.TableState`'s.

:class:`.TableOwner` adds when groups are taken and committed, and their retries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..._faults import fault_point
from ...columnar import DELETE_COLUMN, nullable
from ...errors import CommitConflictError, SchemaError, TableSettingsError, UsageError
from ..data_files import DataFile, RewriteUnsupported
from ..footprint import Footprint
from ..group import GroupWrite, PreparedGroup
from ..log import is_table, log_dir
from ..marks import LaneMarks, Mark
from ..merging import internal
from ..rows import INTERNAL_COLUMNS
from ..sequence import check_sequence_type
from .owner_state import TableState

if TYPE_CHECKING:
    from .engine import OwnerEngine
    from .prepared import PreparedCommit
    from .staging import Staged

__all__ = ["ReadyCommit", "TableCreated", "TableWriter"]

log = logging.getLogger(__name__)


#: ``TableWriter._prepare_at``: the table moved on while the group was read; read again.
_AGAIN: Any = object()


class TableCreated(Exception):
    """The table exists now (this writer created it, or another did meanwhile): the group
    goes to the table's committer instead of being committed here, so that no writer races
    the committer for the versions after the creation."""


@dataclass(frozen=True, slots=True)
class ReadyCommit:
    """A group prepared for the table's committer (see ``TableWriter._prepare_commit``).

    Attributes:
        commit: what the committer is sent; None when the table held every write already.
        done: the files written (for the engine once the commit landed).
        todo: the writes the commit applies (the others the table held).
    """

    commit: PreparedCommit | None
    done: Any
    todo: list[Staged]


class TableWriter(TableState):
    """One table on this node: the blocking calls that apply a group to it while held (from a
    worker thread), on what :class:`.TableState` knows of it."""

    def __init__(self, engine: OwnerEngine, name: str) -> None:
        super().__init__(engine, name)
        self._checking: list[Staged] = []  # the writes of the commit under way, see _commit

    def _prepare_commit(
        self, group: list[Staged], prepared: PreparedGroup | None = None
    ) -> ReadyCommit | None:
        """Blocking, without holding the table: write the files that apply ``group`` and
        describe them for the table's committer, pinned to the version they were planned on
        (:class:`.PreparedCommit`); a :class:`ReadyCommit` without a commit when the table
        holds every write already. None when the group needs the table held: the table does
        not exist yet, needs new columns, or the group must be MERGEd (a key of several
        columns or without ranges, a table feature the file writer does not implement).

        Raises:
            SchemaError, ...: the held commit applies the group instead, and reports it.
        """

        key = self.key or []
        if len(key) > 1:
            return None
        # Until the log, the marks, the live files and the table as described agree on one
        # version (a commit landing between two reads starts it again).
        for _ in range(8):
            if self.marks.refresh() or (self.settings is None and is_table(self.path)):
                self.describe()
                continue
            if self.settings is None:
                return None
            # The marks' listing names the latest version: the log is not listed again. The
            # table delta-rs opened may be older than the kept live files; its metadata is
            # that version's (a metadata change drops them), and the files are pinned to it.
            target, version = self.engine.log.planned(self.path, self.marks.scanned)
            if self.marks.scanned < version:
                continue
            ready = self._prepare_at(group, prepared, key, target, version)
            if ready is not _AGAIN:
                return cast("ReadyCommit | None", ready)
        return None

    def _prepare_at(
        self,
        group: list[Staged],
        prepared: PreparedGroup | None,
        key: list[str],
        target: Any,
        version: int,
    ) -> Any:
        """``_prepare_commit`` at table ``version`` (``target``, delta-rs); ``_AGAIN`` when the
        live files are of a later version."""
        from .prepared import PreparedCommit

        settings, schema = self.settings, self.schema
        assert settings is not None
        if settings.managed and list(settings.key) != key:
            return None  # reported while held
        todo = [s for s in group if s.mark is None or not self.marks.applied(*s.mark)]
        if not todo:
            return ReadyCommit(None, None, [])
        footprint: Footprint | None
        if (
            prepared is not None
            and len(todo) == prepared.batches
            and prepared.settings is settings
            and prepared.schema is schema
        ):
            data, written, footprint = prepared.data, prepared.written, prepared.footprint
        else:
            data = self._conform(
                self._group_rows(todo),
                recompute=any(s.buckets != settings.buckets for s in todo),
                evolve=False,
            )
            written = None
            footprint = (
                Footprint.of(data, key, bucketed=bool(settings.buckets), levels=settings.levels)
                if key
                else None
            )
        deleted = self._deleted(data)  # the group's own deletes, before tombstones act
        buried = self._bury(data)
        if buried is not data:  # other rows: their files and footprint are made again
            data, written = buried, None
            footprint = Footprint.of(
                data, key, bucketed=bool(settings.buckets), levels=settings.levels
            )
        if not data.num_rows:  # every change superseded: no MERGE, a commit of its marks
            footprint = None
        if footprint is not None:
            fault_point("before_listing")
            listed = self.engine.log.live_files(self.path, version) if footprint.ranges else None
            if listed is None:
                return None
            files, listed_version = listed
            if listed_version != version:
                return _AGAIN
            if written is None:
                data = self._at_level(data, files)
            vectors = self.marks.vectors if self.marks.scanned == version else None
            footprint = footprint.checked_against(files, vectors, version)
            if footprint.fresh:
                footprint = None  # no key of the group can be in the table: appended
        write = GroupWrite(
            self.name,
            self.path,
            key,
            data,
            "",
            footprint,
            written,
            version,
            settings.sequence_by,
            self.rule,
        )
        try:
            done = self.engine.write_group_files(write, target)
        except RewriteUnsupported:
            return None
        marks = [s.mark for s in todo if s.mark is not None]
        commit = PreparedCommit(
            self.name,
            self.engine.node_id,
            version,
            done.actions(),
            LaneMarks.highest(marks),
            LaneMarks.lowest(marks),
            rows=int(data.num_rows),
            batches=len(todo),
            deleted=deleted,
            forgotten=tuple(self.marks.store.unlogged()),
        )
        fault_point("commit_prepared")
        return ReadyCommit(commit, done, todo)

    def _commit(self, group: list[Staged], prepared: PreparedGroup | None = None) -> int:
        """Blocking, with the table held (see ``_commit_next``): drop writes the table
        already holds, then create the table if needed and apply the rest in one commit that
        also records the group's lane marks."""
        # Another node may have created the table or changed its schema or settings.
        if self.marks.refresh() or (self.settings is None and is_table(self.path)):
            self.describe()
        todo = [s for s in group if s.mark is None or not self.marks.applied(*s.mark)]
        self.engine.stats.batches_deduplicated += len(group) - len(todo)
        if not todo:
            return 0
        self._checking = todo
        if prepared is not None and (
            len(todo) < prepared.batches
            or prepared.settings is not self.settings
            or prepared.schema is not self.schema
        ):
            # Some writes were abandoned or are applied already, or the table changed meanwhile.
            prepared = None
        lanes = LaneMarks.highest(s.mark for s in todo if s.mark is not None)
        rows = self._commit_rows(todo, lanes, prepared)
        self.marks.absorb(lanes)
        fault_point("after_commit")
        return rows

    def _commit_rows(
        self, group: list[Staged], lanes: dict[str, Mark], prepared: PreparedGroup | None
    ) -> int:
        key = self.key or []
        if prepared is not None:
            return self._write(key, prepared.data, lanes, prepared.written, prepared.footprint)
        data = self._group_rows(group)
        if self.settings is None:
            if all(data.column(DELETE_COLUMN).to_pylist()):
                if self.sequence_by:  # its deletes must be recorded, in a table
                    raise SchemaError(
                        f"table {self.name!r} does not exist yet and these batches only delete: "
                        "the deletes of a sequence_by table are recorded in the table, so an "
                        "older change arriving later cannot bring the key back; create the "
                        "table first (deltaflow.create_table(..., sequence_by=...))",
                        node=self.engine.node_id,
                    )
                return 0  # only deletes, and no table: nothing exists to delete
            self._create(data)
            if self._has_committer:
                raise TableCreated(self.name)
        settings = self.settings
        assert settings is not None
        if settings.managed and list(settings.key) != key:
            raise SchemaError(
                f"table {self.name!r} was created with key {list(settings.key)} by another "
                f"writer; these rows merge on {key}",
                node=self.engine.node_id,
            )
        data = self._conform(data, recompute=any(s.buckets != settings.buckets for s in group))
        return self._write(key, data, lanes, None)

    def _write(
        self,
        key: list[str],
        data: Any,
        lanes: dict[str, Mark],
        written: list[tuple[DataFile, Any]] | None,
        footprint: Footprint | None = None,
    ) -> int:
        """Blocking, while held: apply the conformed group ``data`` in one commit that
        records ``lanes`` (``footprint``: its :meth:`.Footprint.of`, if prepared beforehand)."""
        assert self.settings is not None
        # The group's own deletes are recorded, before tombstones act.
        metadata = LaneMarks.user_metadata(self.engine.node_id, lanes, deleted=self._deleted(data))
        buried = self._bury(data)
        if buried is not data:  # other rows: their files and footprint are made again
            data, written, footprint = buried, None, None
        if not data.num_rows:  # every change superseded: no MERGE, a commit of its marks
            footprint = None
        elif key:
            if footprint is None:
                footprint = Footprint.of(
                    data, key, bucketed=bool(self.settings.buckets), levels=self.settings.levels
                )
            fault_point("before_listing")
            listed = self.engine.log.live_files(self.path) if footprint.ranges else None
            if listed is not None:
                files, version = listed
                if written is None:
                    data = self._at_level(data, files)
                # The files' deletion vectors, read from the log up to the same version (a
                # writer outside deltaflow, not holding the table, may have committed since).
                if self.marks.scanned < version:
                    self.marks.refresh()
                vectors = self.marks.vectors if self.marks.scanned == version else None
                footprint = footprint.checked_against(files, vectors, version)
                if footprint.fresh:
                    footprint = None  # no key of the group can be in the table: appended
        read_version = self._read_version() if self.engine.atomicity.optimistic else None
        fault_point("before_write")
        self.engine.write(
            GroupWrite(
                self.name,
                self.path,
                key,
                data,
                metadata,
                footprint,
                written,
                read_version,
                self.settings.sequence_by,
                self.rule,
                self.marks.carrying(lanes),
            )
        )
        return int(data.num_rows)

    def _read_version(self) -> int:
        """Blocking, for an optimistic commit: the version the group's commit must follow.
        The marks are read up to the latest version (the commits since the group was checked
        included: this node's own table creation or new columns, or another writer's); a
        batch of the group one of them applied, or a change of the table's schema or
        settings, sends the group back to be checked again.

        Raises:
            CommitConflictError: the group must be checked again.
        """
        settings, schema = self.settings, self.schema
        if self.marks.refresh():
            self.describe()
            if self.settings != settings or self.schema != schema:
                raise CommitConflictError(
                    f"table {self.name!r} changed its schema or settings meanwhile",
                    node=self.engine.node_id,
                )
        if any(s.mark is not None and self.marks.applied(*s.mark) for s in self._checking):
            raise CommitConflictError(
                f"another writer applied a batch of this group to table {self.name!r}",
                node=self.engine.node_id,
            )
        return self.marks.scanned

    @property
    def _has_committer(self) -> bool:
        """Whether the table's groups go to its committer (:mod:`.committer`)."""
        return self.engine.commit_sink is not None and self.engine.prepares_groups

    def _create(self, data: Any) -> None:
        """Blocking, while held: create the table from the group's columns."""
        import pyarrow as pa

        settings = self.engine.settings.new_table(tuple(self.key or ()), self.sequence or ())
        # Every column nullable, whatever the first rows' source declared (an Arrow batch of
        # Spark's may say NOT NULL): later rows may hold nulls, and a NOT NULL column would
        # refuse them.
        schema = pa.schema(
            [
                nullable(f)
                for f in data.schema
                if f.name not in INTERNAL_COLUMNS and not internal(f.name)
            ]
        )
        for column in settings.sequence_by:
            try:
                check_sequence_type(column, schema.field(column).type)
            except UsageError as exc:
                raise TableSettingsError(
                    f"table {self.name!r} cannot be created: {exc}", node=self.engine.node_id
                ) from exc
        fault_point("creating")
        try:
            self.engine.create(self.name, self.path, schema, settings)
        except Exception as exc:
            # Another writer created it first, or is creating it (its log started, its first
            # commit not there yet): on a store no lock kept them apart. Read it, and go on.
            optimistic = self.engine.atomicity.optimistic
            if is_table(self.path) or (optimistic and log_dir(self.path).is_dir()):
                if self._has_committer:
                    self.engine.stats.creation_races += 1
                    raise TableCreated(self.name) from exc
                raise CommitConflictError(
                    f"table {self.name!r} was created by another writer meanwhile",
                    node=self.engine.node_id,
                ) from exc
            raise
        self.engine.stats.tables_created += 1
        log.info("created table %s (%s)", self.name, settings.describe())
        self.describe()
