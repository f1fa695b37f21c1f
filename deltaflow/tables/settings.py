"""Table settings and the bucket layout, stored in each table's Delta properties.

A table deltaflow creates carries its settings in Delta table properties, so every node (and
every engine) reads the same ones from the table itself:

- ``deltaflow.key``: the merge key columns, a JSON list (``[]`` for an append table);
- ``deltaflow.buckets``: the number of buckets of the layout (``0``: no bucket column);
- ``deltaflow.bucketRows``: the rows per bucket the layout grows by (:mod:`.layout`; absent
  or ``0``: every row is in its bucket of ``buckets`` from the start, as tables made before);
- ``deltaflow.schemaEvolution``: ``true`` if writes may add columns;
- ``deltaflow.sequenceBy``: the sequence columns, a JSON list (absent: changes apply in
  arrival order); ``deltaflow.tombstoneRetention``: how long a deleted key's sequence is kept
  (:mod:`.sequence`);
- ``deltaflow.merge``: how a change merges with the stored row of its key (``last``, the
  default; ``partial``, ``first``, ``aggregate`` with ``deltaflow.aggregates``, a JSON object
  of column to function; :mod:`.merging`);
- ``delta.enableDeletionVectors``: Delta's own switch for deletion vectors;
- ``delta.checkpointInterval``: 100 (:data:`CHECKPOINT_INTERVAL`), not Spark's 10: deltaflow
  commits several times a second under load, and a checkpoint costs many commits' time;
- ``delta.setTransactionRetentionDuration``: 7 days: how long a lane's mark outlives the lane's
  last commit, in checkpoints and in nodes' memory (:mod:`.marks`).

**The bucket layout.** A keyed table gets the int column ``_deltaflow_bucket``, computed on the
node as ``partition_of(key, buckets)``: the function the client routes by. The table is
partitioned by it (Delta ``partitionBy``), and every MERGE names the buckets its group holds,
so a group only reads and rewrites the files of those buckets. With ``buckets`` equal to the
cluster's partition count (64 by default) a bucket *is* a partition, so the group a node
commits touches only files of the partitions it owns; a bucket count that divides the
partition count gives coarser buckets (``partition % buckets``). See docs/tables.md for the
measurements behind the default.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ..errors import UsageError
from ..partitioning import DEFAULT_PARTITIONS
from .layout import Levels
from .sequence import DEFAULT_TOMBSTONE_RETENTION, format_interval, parse_interval

if TYPE_CHECKING:
    from ..storage.paths import Location

__all__ = [
    "BUCKET_COLUMN",
    "DEFAULT_BUCKETS",
    "MAX_BUCKETS",
    "TableSettings",
    "default_buckets",
    "parse_schema",
    "read_table_settings",
    "type_name",
    "with_layout",
]

#: The layout column of keyed tables (an int, the bucket of the row's key).
BUCKET_COLUMN: Final = "_deltaflow_bucket"
#: Buckets of a keyed table unless told otherwise: the default partition count.
DEFAULT_BUCKETS: Final = DEFAULT_PARTITIONS
#: The most buckets a table may have (each is a Delta partition directory).
MAX_BUCKETS: Final = 1024

PROP_KEY: Final = "deltaflow.key"
PROP_BUCKETS: Final = "deltaflow.buckets"
PROP_BUCKET_ROWS: Final = "deltaflow.bucketRows"
PROP_SCHEMA_EVOLUTION: Final = "deltaflow.schemaEvolution"
PROP_SEQUENCE_BY: Final = "deltaflow.sequenceBy"
PROP_TOMBSTONE_RETENTION: Final = "deltaflow.tombstoneRetention"
PROP_MERGE: Final = "deltaflow.merge"
PROP_HISTORY: Final = "deltaflow.history"
PROP_TRACK_HISTORY_ON: Final = "deltaflow.trackHistoryOn"
PROP_AGGREGATES: Final = "deltaflow.aggregates"
#: How a change merges with the row the table holds for its key (``deltaflow.merge``).
MERGE_MODES: Final = ("last", "partial", "first", "aggregate")
#: What an ``aggregate`` table's columns may do (``deltaflow.aggregates``); a column not named
#: keeps its last non-null value.
AGGREGATES: Final = ("sum", "min", "max", "last_non_null")
PROP_DELETION_VECTORS: Final = "delta.enableDeletionVectors"
PROP_CHECKPOINT_INTERVAL: Final = "delta.checkpointInterval"
PROP_EXPIRED_LOG_CLEANUP: Final = "delta.enableExpiredLogCleanup"
#: How long Delta keeps a ``txn`` action (a lane's mark, :mod:`.marks`) in its snapshots.
PROP_TXN_RETENTION: Final = "delta.setTransactionRetentionDuration"
#: The tables deltaflow creates keep a lane's mark this long after its last commit.
TXN_RETENTION: Final = "interval 7 days"
#: Commits between two checkpoints of the tables deltaflow creates (delta-rs's default; see
#: the module docstring). Readers replay at most this many small JSON commits.
CHECKPOINT_INTERVAL: Final = 100


@dataclass(frozen=True, slots=True, kw_only=True)
class TableSettings:
    """How deltaflow writes one table; stored in the table's properties.

    Attributes:
        key: merge key columns; empty for a table written by appends.
        buckets: buckets of the layout; 0 means no bucket column (append tables, tables
            created by other programs).
        bucket_rows: rows per bucket the layout grows by (:class:`.Levels`): a small table
            has one bucket, and ``buckets`` from ``buckets * bucket_rows`` rows. 0: every
            bucket from the first row.
        schema_evolution: writes may add columns the table does not have yet.
        deletion_vectors: Delta deletion vectors are enabled (replaced rows are marked instead
            of their files rewritten; see docs/tables.md).
        managed: the table carries deltaflow's properties (False for a table another program
            created: deltaflow then merges on the key the writer names, without buckets).
        sequence_by: the columns that order the changes to a key (compared in order): a
            change applies only if its sequence is greater than the stored one
            (:mod:`.sequence`). Empty: changes apply in arrival order.
        tombstone_retention: seconds a deleted key's sequence is kept (``sequence_by``
            tables): an older upsert arriving within it does not bring the key back.
    """

    key: tuple[str, ...] = ()
    buckets: int = 0
    bucket_rows: int = 0
    schema_evolution: bool = False
    deletion_vectors: bool = False
    managed: bool = True
    sequence_by: tuple[str, ...] = ()
    tombstone_retention: int = DEFAULT_TOMBSTONE_RETENTION
    merge: str = "last"
    aggregates: tuple[tuple[str, str], ...] = ()
    history: str = "none"
    track_history_on: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.buckets <= MAX_BUCKETS:
            raise UsageError(f"buckets must be between 0 and {MAX_BUCKETS}, got {self.buckets}")
        if self.buckets and not self.key:
            raise UsageError("a bucket layout needs a key: append tables have no buckets")
        if self.bucket_rows < 0 or (self.bucket_rows and not self.buckets):
            raise UsageError(
                f"bucket_rows={self.bucket_rows}: the rows per bucket of a layout, positive "
                "and only with buckets (or 0: all buckets from the first row)"
            )
        if len(set(self.key)) != len(self.key):
            raise UsageError(f"key columns repeat: {list(self.key)}")
        if self.sequence_by:
            if not self.key:
                raise UsageError("sequence_by orders the changes to a key: it needs a key")
            if len(set(self.sequence_by)) != len(self.sequence_by):
                raise UsageError(f"sequence columns repeat: {list(self.sequence_by)}")
            both = [c for c in self.sequence_by if c in self.key]
            if both:
                raise UsageError(f"column(s) {both} cannot be both key and sequence")
        if self.tombstone_retention <= 0:
            raise UsageError("tombstone_retention must be longer than zero")
        if self.merge not in MERGE_MODES:
            raise UsageError(f"merge={self.merge!r}: use one of {', '.join(MERGE_MODES)}")
        if self.merge != "last" and not self.key:
            raise UsageError(f"merge={self.merge!r} merges changes of a key: it needs a key")
        if self.merge == "first" and self.sequence_by:
            raise UsageError(
                "merge='first' keeps the first change of a key to arrive; a sequence_by table "
                "keeps the newest (use merge='last', 'partial' or 'aggregate' with it)"
            )
        if self.history not in ("none", "scd2"):
            raise UsageError(f"history={self.history!r}: use 'scd2' (or 'none')")
        if self.history == "scd2" and (len(self.key) != 1 or len(self.sequence_by) != 1):
            raise UsageError(
                "history='scd2' keeps a key's versions in the order of its sequence: it needs "
                "a one-column key and a one-column sequence_by"
            )
        if self.history == "scd2" and self.merge != "last":
            raise UsageError("history='scd2' keeps every version: its merge mode is 'last'")
        if self.track_history_on and self.history != "scd2":
            raise UsageError("track_history_on= names the columns of a history='scd2' table")
        if self.aggregates and self.merge != "aggregate":
            raise UsageError("aggregates= are the columns of a merge='aggregate' table")
        for column, function in self.aggregates:
            if function not in AGGREGATES:
                raise UsageError(
                    f"aggregate {function!r} of column {column!r}: use one of "
                    f"{', '.join(AGGREGATES)}"
                )
            if column in self.key or column in self.sequence_by:
                raise UsageError(f"column {column!r} is a key or sequence column: not aggregated")

    @property
    def levels(self) -> Levels | None:
        """The layout's levels when it grows with the table (:mod:`.layout`), else None."""
        if not (self.buckets and self.bucket_rows):
            return None
        return Levels(self.buckets, self.bucket_rows)

    def properties(self) -> dict[str, str]:
        """The Delta table properties that record these settings."""
        props = {
            PROP_KEY: json.dumps(list(self.key)),
            PROP_BUCKETS: str(self.buckets),
            PROP_SCHEMA_EVOLUTION: "true" if self.schema_evolution else "false",
            PROP_CHECKPOINT_INTERVAL: str(CHECKPOINT_INTERVAL),
            PROP_TXN_RETENTION: TXN_RETENTION,
        }
        if self.bucket_rows:
            props[PROP_BUCKET_ROWS] = str(self.bucket_rows)
        if self.deletion_vectors:
            props[PROP_DELETION_VECTORS] = "true"
        if self.sequence_by:
            props[PROP_SEQUENCE_BY] = json.dumps(list(self.sequence_by))
            props[PROP_TOMBSTONE_RETENTION] = format_interval(self.tombstone_retention)
        if self.merge != "last":
            props[PROP_MERGE] = self.merge
        if self.aggregates:
            props[PROP_AGGREGATES] = json.dumps(dict(self.aggregates))
        if self.history != "none":
            props[PROP_HISTORY] = self.history
        if self.track_history_on:
            props[PROP_TRACK_HISTORY_ON] = json.dumps(list(self.track_history_on))
        return props

    @classmethod
    def from_table(cls, properties: Mapping[str, str], columns: Sequence[str]) -> TableSettings:
        """The settings of an existing table, from its properties and column names."""
        dv = str(properties.get(PROP_DELETION_VECTORS, "false")).lower() == "true"
        raw_key = properties.get(PROP_KEY)
        if raw_key is None:
            return cls(deletion_vectors=dv, managed=False)
        try:
            key = json.loads(raw_key)
            buckets = int(properties.get(PROP_BUCKETS, "0"))
            bucket_rows = int(properties.get(PROP_BUCKET_ROWS, "0"))
        except ValueError as exc:
            raise UsageError(f"unreadable deltaflow table properties {dict(properties)}") from exc
        if not isinstance(key, list) or not all(isinstance(k, str) for k in key):
            raise UsageError(f"table property {PROP_KEY} must be a JSON list, got {raw_key!r}")
        sequence = _names(properties, PROP_SEQUENCE_BY)
        retention = properties.get(PROP_TOMBSTONE_RETENTION)
        raw_aggregates = properties.get(PROP_AGGREGATES, "{}")
        try:
            aggregates = json.loads(raw_aggregates)
        except ValueError:
            aggregates = None
        if not isinstance(aggregates, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in aggregates.items()
        ):
            raise UsageError(
                f"table property {PROP_AGGREGATES} must be a JSON object of column to "
                f"function, got {raw_aggregates!r}"
            )
        return cls(
            key=tuple(key),
            buckets=buckets if BUCKET_COLUMN in columns else 0,
            bucket_rows=bucket_rows if BUCKET_COLUMN in columns else 0,
            schema_evolution=str(properties.get(PROP_SCHEMA_EVOLUTION, "")).lower() == "true",
            deletion_vectors=dv,
            sequence_by=tuple(sequence),
            tombstone_retention=(
                DEFAULT_TOMBSTONE_RETENTION if retention is None else parse_interval(retention)
            ),
            merge=str(properties.get(PROP_MERGE, "last")),
            aggregates=tuple(sorted(aggregates.items())),
            history=str(properties.get(PROP_HISTORY, "none")),
            track_history_on=tuple(_names(properties, PROP_TRACK_HISTORY_ON)),
        )

    def describe(self) -> str:
        """One line for people: ``key [id], 64 buckets, schema evolution off, ...``."""
        if not self.managed:
            return "not created by deltaflow (no key, layout or evolution settings)"
        parts = [f"key {list(self.key)}" if self.key else "append (no key)"]
        if not self.buckets:
            parts.append("no bucket layout")
        elif self.bucket_rows:
            parts.append(f"up to {self.buckets} buckets of {self.bucket_rows} rows")
        else:
            parts.append(f"{self.buckets} buckets")
        parts.append(f"schema evolution {'on' if self.schema_evolution else 'off'}")
        parts.append(f"deletion vectors {'on' if self.deletion_vectors else 'off'}")
        if self.sequence_by:
            parts.append(
                f"sequence by {list(self.sequence_by)} (tombstones kept "
                f"{format_interval(self.tombstone_retention).removeprefix('interval ')})"
            )
        if self.merge != "last":
            parts.append(f"merge {self.merge}")
        if self.aggregates:
            parts.append(", ".join(f"{c} {f}" for c, f in self.aggregates))
        if self.history != "none":
            on = f" on {list(self.track_history_on)}" if self.track_history_on else ""
            parts.append(f"history {self.history}{on}")
        return ", ".join(parts)


def _names(properties: Mapping[str, str], name: str) -> list[str]:
    """A table property holding a JSON list of column names (empty when absent)."""
    raw = properties.get(name, "[]")
    try:
        names = json.loads(raw)
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(c, str) for c in names):
        raise UsageError(f"table property {name} must be a JSON list, got {raw!r}")
    return names


def default_buckets(partitions: int) -> int:
    """The bucket count for keyed tables a node creates on first write: the largest divisor of
    ``partitions`` up to :data:`DEFAULT_BUCKETS`, so each bucket lies inside one partition."""
    for b in range(min(partitions, DEFAULT_BUCKETS), 0, -1):
        if partitions % b == 0:
            return b
    return 1


_DECIMAL = re.compile(r"decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)")


def _simple_types() -> dict[str, Any]:
    import pyarrow as pa

    return {
        "byte": pa.int8(),
        "tinyint": pa.int8(),
        "short": pa.int16(),
        "smallint": pa.int16(),
        "int": pa.int32(),
        "integer": pa.int32(),
        "long": pa.int64(),
        "bigint": pa.int64(),
        "float": pa.float32(),
        "real": pa.float32(),
        "double": pa.float64(),
        "boolean": pa.bool_(),
        "bool": pa.bool_(),
        "string": pa.string(),
        "binary": pa.binary(),
        "date": pa.date32(),
        "timestamp": pa.timestamp("us", tz="UTC"),
        "timestamp_ntz": pa.timestamp("us"),
    }


def _arrow_type(name: str) -> Any:
    import pyarrow as pa

    simple = _simple_types()
    text = name.strip().lower()
    if text in simple:
        return simple[text]
    if m := _DECIMAL.fullmatch(text):
        return pa.decimal128(int(m.group(1)), int(m.group(2)))
    raise UsageError(
        f"unknown column type {name!r}; use one of {', '.join(sorted(simple))} or decimal(p,s)"
    )


#: The Delta name of each Arrow type deltaflow creates columns with (the first of its names).
_NAMES: Final = ("byte", "short", "int", "long", "float", "double", "boolean", "string")
_MORE_NAMES: Final = ("binary", "date", "timestamp", "timestamp_ntz")


def type_name(t: Any) -> str:
    """The Delta (Spark SQL) name of Arrow type ``t``, as ``deltaflow table create`` takes it:
    ``long``, ``decimal(10,2)``, ``timestamp_ntz``; Arrow's own name for other types."""
    import pyarrow as pa

    if t is None:
        return "this type"
    if pa.types.is_decimal(t):
        return f"decimal({t.precision},{t.scale})"
    if pa.types.is_timestamp(t):
        return "timestamp" if t.tz is not None else "timestamp_ntz"
    simple = _simple_types()
    for name in (*_NAMES, *_MORE_NAMES):
        if simple[name] == t:
            return name
    return str(t)


def parse_schema(schema: Any) -> Any:
    """A pyarrow schema from a pyarrow schema, ``{column: type}`` or ``"id:long,name:string"``.

    Type names are Delta's (Spark SQL's): byte, short, int, long, float, double, boolean,
    string, binary, date, timestamp (UTC), timestamp_ntz, decimal(p,s).

    Raises:
        UsageError: an unknown type, an empty schema or a reserved column name.
    """
    import pyarrow as pa

    if isinstance(schema, pa.Schema):
        result = schema
    else:
        if isinstance(schema, str):
            pairs = []
            for part in re.split(r",(?![^()]*\))", schema):
                name, sep, type_ = part.partition(":")
                if not sep or not name.strip():
                    raise UsageError(f"schema entry {part!r} is not 'column:type'")
                pairs.append((name.strip(), type_))
        elif isinstance(schema, Mapping):
            pairs = [(str(k), str(v)) for k, v in schema.items()]
        else:
            raise UsageError(
                "schema must be a pyarrow schema, a {column: type} dict or 'col:type,...'"
            )
        result = pa.schema([pa.field(name, _arrow_type(t)) for name, t in pairs])
    if not len(result):
        raise UsageError("the schema has no columns")
    if len(set(result.names)) != len(result.names):
        raise UsageError(f"the schema repeats a column: {result.names}")
    if BUCKET_COLUMN in result.names:
        raise UsageError(f"column {BUCKET_COLUMN!r} is reserved for deltaflow's bucket layout")
    return result


def with_layout(schema: Any, settings: TableSettings) -> tuple[Any, list[str]]:
    """The table's full schema (data columns plus the bucket column) and partition columns."""
    import pyarrow as pa

    if not settings.buckets:
        return schema, []
    return schema.append(pa.field(BUCKET_COLUMN, pa.int32())), [BUCKET_COLUMN]


def read_table_settings(warehouse: Location | str, name: str) -> TableSettings:
    """The settings of an existing table, read with delta-rs (no JVM).

    Raises:
        UsageError: no such table.
    """
    from ..storage.paths import location
    from .log import delta_table, table_path

    dt = delta_table(table_path(location(warehouse), name))
    columns = _column_names(dt.schema().to_arrow())
    return TableSettings.from_table(dt.metadata().configuration, columns)


def _column_names(schema: Any) -> list[str]:
    import pyarrow as pa

    return list(pa.schema(schema).names)
