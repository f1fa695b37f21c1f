"""One table as a node knows it: its key, sequence, settings and schema as last read, the
lane marks and tombstones its log holds, and a group's rows as they apply to it (one per key,
conformed to its columns, without the changes its tombstones make old).

:class:`.TableWriter` applies groups on it; :class:`.TableOwner` adds when they are taken
and committed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...errors import SchemaError, TableSettingsError
from ..column_sequences import PREFIX as SEQUENCE_PREFIX
from ..column_sequences import floored, own_sequence_fields
from ..constraints import CONSTRAINT_PREFIX
from ..grouping import conform, last_per_key
from ..layout import live_rows
from ..log import latest_version
from ..marks import LaneMarks, MarkRetention
from ..merging import MergeRule, fold, internal
from ..rows import INTERNAL_COLUMNS, no_evolution_text
from ..sequence import Tombstones, newest_per_key, recorded
from ..settings import (
    BUCKET_COLUMN,
    CHECKPOINT_INTERVAL,
    PROP_CHECKPOINT_INTERVAL,
    TableSettings,
)

if TYPE_CHECKING:
    from .engine import OwnerEngine
    from .staging import Staged

__all__ = ["TableState"]

log = logging.getLogger(__name__)


def _sequence_mismatch(table: str, settings: TableSettings, sequence: Sequence[str]) -> str:
    held = (
        f"orders changes by {list(settings.sequence_by)} (its deltaflow.sequenceBy property)"
        if settings.sequence_by
        else "has no sequence_by (changes apply in arrival order)"
    )
    named = f"sequence_by={list(sequence)}" if sequence else "no sequence_by"
    return (
        f"table {table!r} {held}; this stream names {named}: name the table's, or leave "
        "sequence_by out to use it"
    )


class TableState:
    """One table on this node: what it knows of it (read from the table, blocking: from a
    worker thread) and how a group's rows apply to it."""

    def __init__(self, engine: OwnerEngine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.path = engine.warehouse / name
        self.key: list[str] | None = None  # the key this node's writes use
        # The sequence columns this node's writes named while the table did not exist: the
        # table is created with them.
        self.sequence: tuple[str, ...] | None = None
        self.settings: TableSettings | None = None  # None until the table exists
        self.schema: Any = None  # the data columns (no bucket), None until the table exists
        self.partition_columns: tuple[str, ...] = ()
        #: The table's CHECK constraints (name -> SQL), as last read.
        self.constraints: dict[str, str] = {}
        self.described_version = -1
        #: The deletes the table's commits record (``sequence_by`` tables), read with the marks.
        self.tombstones = Tombstones()
        self.marks = LaneMarks(
            self.path, tombstones=self.tombstones, store=engine.mark_stores.of(self.path)
        )

    def describe_if_newer(self) -> bool:
        """Blocking: read the table again if it has commits newer than the last read (an
        operator may have changed its settings); whether it did."""
        if latest_version(self.path) <= self.described_version:
            return False
        self.describe()
        return True

    def describe(self) -> None:
        """Blocking: read the table's settings and schema (nothing if it does not exist)."""
        version = latest_version(self.path)  # one listing: is_table() is version >= 0
        if version < 0:
            self.settings = self.schema = None
            return
        import pyarrow as pa

        self.described_version = version
        desc = self.engine.describe(self.name, self.path)
        full = pa.schema(desc.schema)
        self.settings = TableSettings.from_table(desc.properties, full.names)
        self.marks.whole_log = bool(self.settings.sequence_by)
        self.marks.snapshot_interval = int(
            desc.properties.get(PROP_CHECKPOINT_INTERVAL) or CHECKPOINT_INTERVAL
        )
        self.marks.retention = MarkRetention.of_table(
            desc.properties, self.engine.settings.random_marks_seconds
        )
        self.schema = pa.schema([f for f in full if f.name != BUCKET_COLUMN])
        self.partition_columns = tuple(desc.partition_columns)
        self.constraints = {
            name.removeprefix(CONSTRAINT_PREFIX): str(expression)
            for name, expression in desc.properties.items()
            if name.startswith(CONSTRAINT_PREFIX)
        }
        if self.settings.buckets and BUCKET_COLUMN not in desc.partition_columns:
            log.warning("table %s: %s is not a partition column", self.name, BUCKET_COLUMN)

    def plan(self, key: Sequence[str], sequence: Sequence[str] | None = None) -> TableSettings:
        """The settings a write with ``key`` (and ``sequence``, the sequence columns it names;
        None: whatever the table has) is staged under: the table's, or the ones this node
        would create it with.

        Raises:
            TableSettingsError: the write's key or sequence is not the table's.
        """
        settings = self.settings
        node = self.engine.node_id
        if settings is not None and settings.managed:
            if list(settings.key) != list(key):
                how = f"merged on key {list(settings.key)}" if settings.key else "appended to"
                raise TableSettingsError(
                    f"table {self.name!r} is {how} (its deltaflow.key property); this write "
                    f"{'appends' if not key else f'merges on {list(key)}'}",
                    node=node,
                )
            if sequence is not None and tuple(sequence) != settings.sequence_by:
                raise TableSettingsError(
                    _sequence_mismatch(self.name, settings, sequence), node=node
                )
        elif settings is not None and sequence:
            raise TableSettingsError(
                f"table {self.name!r} was not created by deltaflow (it has no deltaflow.key "
                "property), so it keeps no sequences: write it without sequence_by, or create "
                "the table with deltaflow.create_table(..., sequence_by=...)",
                node=node,
            )
        elif self.key is not None and self.key != list(key):
            how = f"merged on key {self.key}" if self.key else "appended to"
            raise TableSettingsError(
                f"table {self.name!r} is {how} on this node; this write "
                f"{'appends' if not key else f'merges on {list(key)}'}",
                node=node,
            )
        elif (
            settings is None
            and sequence is not None
            and self.sequence is not None
            and tuple(sequence) != self.sequence
        ):
            raise TableSettingsError(
                f"table {self.name!r} is being created on this node with sequence_by "
                f"{list(self.sequence)}; this write names {list(sequence)}",
                node=node,
            )
        if self.key is None:
            self.key = list(key)
        if settings is not None:
            return settings
        if sequence is not None and self.sequence is None:
            self.sequence = tuple(sequence)
        return self.engine.settings.new_table(tuple(key), self.sequence or ())

    @property
    def rule(self) -> MergeRule:
        """The table's merge mode (``last`` until it exists)."""
        return MergeRule.of(self.settings, self.schema.names if self.schema is not None else ())

    @property
    def sequence_by(self) -> tuple[str, ...]:
        """The sequence columns of the table (or of the table this node will create)."""
        if self.settings is not None:
            return self.settings.sequence_by
        return self.sequence or ()

    def _group_rows(self, group: list[Staged]) -> Any:
        """The group's rows in staging order, one per key: the last, or on a ``sequence_by``
        table the one of the highest sequence; a key's changes folded on a table with another
        merge mode (:func:`.merging.fold`)."""
        import pyarrow as pa

        data = pa.concat_tables([s.table for s in group], promote_options="permissive")
        if not self.key:
            return data
        rule = self.rule
        if rule.history:  # every change is a version (:mod:`.history`)
            return data
        if rule.folds:
            return fold(data, self.key, self.sequence_by, rule)
        if self.sequence_by:
            return newest_per_key(data, self.key, self.sequence_by)
        return last_per_key(data, self.key)

    def _bury(self, data: Any) -> Any:
        """The conformed group ``data`` without the changes a delete the table recorded makes
        old (``sequence_by`` tables; :class:`.Tombstones`)."""
        settings = self.settings
        if settings is None or not settings.sequence_by or not self.key:
            return data
        if settings.history != "none":  # late changes are slotted into the history,
            # with the recorded deletes of its keys (a delete may have found no version).
            self.tombstones.expire(settings.tombstone_retention)
            return self.tombstones.events(data, self.key, settings.sequence_by)
        self.tombstones.expire(settings.tombstone_retention)
        data, dropped = self.tombstones.bury(data, self.key, settings.sequence_by)
        self.engine.stats.changes_superseded += dropped
        sequenced = self.rule.sequenced
        floors = self.tombstones.held(data, self.key, settings.sequence_by) if sequenced else None
        if floors is not None:  # columns of the changes before the delete: not set
            data = floored(data, floors, settings.sequence_by, sequenced)
        return data

    def _deleted(self, data: Any) -> dict[str, list[Any]] | None:
        """What the commit of ``data`` records of its deletes (``sequence_by`` tables)."""
        settings = self.settings
        if settings is None or not settings.sequence_by or not self.key:
            return None
        return recorded(data, self.key, settings.sequence_by)

    def _conform(self, data: Any, *, recompute: bool, evolve: bool = True) -> Any:
        """Blocking, while held (or, with ``evolve`` False, anywhere): the group conformed to
        the table (:func:`.conform`), its new columns added first if the table allows schema
        evolution.

        Raises:
            SchemaError: a column the table lacks (and may not add, or ``evolve`` is False),
                or one whose type does not convert.
        """
        import pyarrow as pa

        settings, schema = self.settings, self.schema
        assert settings is not None and schema is not None
        node = self.engine.node_id
        new = [
            f
            for f in data.schema
            if f.name not in schema.names
            and f.name not in INTERNAL_COLUMNS
            and not internal(f.name)
            and not f.name.startswith(SEQUENCE_PREFIX)  # a fold's: added with their column
        ]
        if new:
            names = [f.name for f in new]
            if not settings.schema_evolution or not evolve:
                raise SchemaError(no_evolution_text(self.name, names), node=node)
            untyped = [f.name for f in new if pa.types.is_null(f.type)]
            if untyped:
                raise SchemaError(
                    f"new column(s) {untyped} of table {self.name!r} are null in every row, so "
                    "their type cannot be inferred; send a non-null value",
                    node=node,
                    details={"column": untyped[0]},
                )
            # On a table whose columns carry their own sequence, so do the new ones.
            types = {c: schema.field(c).type for c in settings.sequence_by}
            rule = self.rule
            if rule.stamps:
                new += own_sequence_fields(new, settings.key, settings.sequence_by, rule, types)
            self.engine.add_columns(self.name, self.path, new)
            self.engine.stats.columns_added += len(new)
            log.info("table %s: added columns %s", self.name, names)
            self.describe()
            schema = self.schema
        data = conform(data, schema, settings, table=self.name, node=node, recompute=recompute)
        if settings.levels is None:
            return data
        # The bucket column holds the keys' partitions: placed at the level of the table's
        # size at the latest version its marks were read at (the log is not listed).
        known = self.marks.scanned
        rows = self.engine.log.live_rows(self.path, known if known >= 0 else None)
        at = data.schema.get_field_index(BUCKET_COLUMN)
        placed = settings.levels.place(data.column(at), settings.levels.size_for(rows))
        return data.set_column(at, data.schema.field(at), placed)

    def _at_level(self, data: Any, files: Any) -> Any:
        """The conformed group ``data`` at the level of a table of live ``files`` (its
        placement at conform time may be of an older version; :mod:`.layout`)."""
        levels = self.settings.levels if self.settings is not None else None
        if levels is None or not data.num_rows or not self.key:
            return data
        size = levels.size_for(live_rows(files))
        at = data.schema.get_field_index(BUCKET_COLUMN)
        if levels.size_of(data.column(at)[0].as_py()) == size:
            return data
        placed = levels.place(levels.partitions(data, self.key, BUCKET_COLUMN), size)
        return data.set_column(at, data.schema.field(at), placed)
