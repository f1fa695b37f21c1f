"""The table engines, in one package: the one list of them, a node's engine built from its
options, and creating a table through either.

:mod:`.options` names the engines and types their settings (:class:`SparkOptions`,
:class:`DeltaRsOptions`); :mod:`.delta_rs` and :mod:`.spark` are the engines, subclasses of
:class:`~deltaflow.tables.engine.TableEngine`. They sit above :mod:`deltaflow.tables`
(engine-neutral Delta machinery) and :mod:`deltaflow.spark_integration` (the SparkSession
the Spark engine uses), which import nothing from here; the node and the CLI choose an engine
here. An engine is imported only when it is chosen, so importing this package loads neither
Spark nor delta-rs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..columnar import INTERNAL_PREFIXES
from ..errors import CommitConflictError, UsageError
from ..receivers.base import check_table_name
from ..storage.paths import Location, location
from ..tables.atomicity import atomicity_for
from ..tables.column_sequences import own_sequence_fields
from ..tables.history import END, START, with_history_columns
from ..tables.layout import DEFAULT_BUCKET_ROWS
from ..tables.log import is_table
from ..tables.merging import MergeRule, check_aggregate_type
from ..tables.sequence import DEFAULT_TOMBSTONE_RETENTION, check_sequence_type, parse_interval
from ..tables.settings import DEFAULT_BUCKETS, TableSettings, parse_schema
from .options import (
    DEFAULT_ENGINE,
    DELTA_RS,
    ENGINE_NAMES,
    SPARK,
    DeltaRsOptions,
    EngineOptions,
    SparkOptions,
    check_engine,
    engine_options,
)

if TYPE_CHECKING:
    from ..tables.engine import TableEngine

__all__ = [
    "DEFAULT_ENGINE",
    "DELTA_RS",
    "ENGINE_NAMES",
    "SPARK",
    "DeltaRsOptions",
    "EngineOptions",
    "SparkOptions",
    "check_engine",
    "create_table",
    "engine_options",
    "new_engine",
]


def new_engine(options: EngineOptions, warehouse: Location, **settings: Any) -> TableEngine:
    """A node's table engine over ``warehouse``, the one ``options`` names with its settings;
    ``settings`` go to :class:`~deltaflow.tables.engine.TableEngine` (node id, group bounds,
    defaults of new tables)."""
    if isinstance(options, SparkOptions):
        from .spark import SparkTableEngine

        return SparkTableEngine(warehouse, spark=options.config, writer=options.writer, **settings)
    from .delta_rs import DeltaRsTableEngine

    return DeltaRsTableEngine(warehouse, **settings)


def create_table(
    warehouse: Location | str,
    name: str,
    *,
    schema: Any,
    key: str | Sequence[str] = (),
    buckets: int | None = None,
    bucket_rows: int | None = None,
    allow_schema_evolution: bool = False,
    deletion_vectors: bool = False,
    engine: str | EngineOptions = DELTA_RS,
    sequence_by: str | Sequence[str] = (),
    tombstone_retention: int | str | timedelta = DEFAULT_TOMBSTONE_RETENTION,
    merge: str = "last",
    aggregates: Mapping[str, str] | None = None,
    history: str = "none",
    track_history_on: Sequence[str] = (),
) -> TableSettings:
    """Create an empty deltaflow table under ``warehouse`` (blocking; run it in a thread from
    async code).

    Args:
        warehouse: the nodes' warehouse directory.
        name: the table name (a directory under the warehouse).
        schema: the columns: a pyarrow schema, ``{column: type}`` or ``"id:long,name:string"``
            (types as in :func:`parse_schema`).
        key: merge key column(s). Empty (default) makes an append table.
        buckets: buckets of the layout. Default: 64 for a keyed table (one per partition of a
            default cluster; use the cluster's partition count or a divisor of it), 0 for an
            append table. 0 turns the layout off.
        bucket_rows: rows per bucket the layout grows by (default 4,096): the table has one
            bucket while it is small, 2, 4 ... as it grows, and ``buckets`` from
            ``buckets * bucket_rows`` rows (``docs/tables.md``). 0: every bucket from the
            first row.
        allow_schema_evolution: writes may add columns (default False: rows with unknown
            columns are rejected).
        deletion_vectors: enable Delta deletion vectors (default False): Spark's MERGE marks
            the rows it replaces, and the delta-rs engine applies groups by merge-on-read
            (see docs/tables.md). Readers need Delta reader version 3.
        engine: the engine that creates it: ``"delta-rs"`` (default; no JVM), ``"spark"``,
            or :data:`EngineOptions` (``SparkOptions(config=SparkConfig(...))`` for a Spark
            session of your own).
        sequence_by: the column(s) that order the changes to a key (a log sequence number,
            a commit time; several are compared in order): a change applies only if its
            sequence is greater than the one the table holds for the key, deletes included
            (``docs/cdc.md``). Integers, strings, dates or timestamps. Default: none, changes
            apply in arrival order.
        tombstone_retention: with ``sequence_by``, how long a deleted key's sequence is kept
            (seconds, a ``timedelta`` or text like ``"7 days"``; default 7 days): within it,
            an older change arriving late does not bring the key back.
        merge: how a change merges with the row the table holds for its key (``docs/cdc.md``):
            ``"last"`` (default: it replaces the row), ``"partial"`` (its non-null columns
            replace the row's, the others keep the stored values), ``"first"`` (the first
            change of a key wins), ``"aggregate"`` (per column, as ``aggregates`` says). With
            ``sequence_by``, ``partial`` and ``aggregate`` merge column by column: each column
            keeping the last value set gets ``_deltaflow_seq_<column>``, the sequence of the
            change that set it.
        aggregates: with ``merge="aggregate"``, column -> ``"sum"``, ``"min"``, ``"max"`` or
            ``"last_non_null"`` (the default for a column not named).
        history: ``"scd2"`` keeps every version of a key (needs a one-column ``key`` and
            ``sequence_by``): the table gets the columns ``__start_at`` and ``__end_at`` (of
            the sequence's type; ``__end_at`` null on the current version), each change closes
            the current version and opens a new one, a delete closes it, and late changes
            are slotted in by sequence (``docs/cdc.md``).
        track_history_on: with ``history="scd2"``, the columns whose change opens a version;
            a change of the others updates the current version in place. Default: all.

    Returns the settings stored in the table's properties.

    Raises:
        UsageError: bad arguments, or the table exists already.
    """
    import pyarrow as pa

    check_table_name(name)
    options = engine_options(engine)
    data_schema = parse_schema(schema)
    reserved = [c for c in data_schema.names if c.startswith(INTERNAL_PREFIXES)]
    if reserved:
        raise UsageError(
            f"column(s) {reserved}: names starting with _deltaflow_ or __deltaflow_ are "
            "deltaflow's; rename them"
        )
    keys = (key,) if isinstance(key, str) else tuple(key)
    missing = [k for k in keys if k not in data_schema.names]
    if missing:
        raise UsageError(f"key column(s) {missing} are not in the schema {data_schema.names}")
    sequence = (sequence_by,) if isinstance(sequence_by, str) else tuple(sequence_by)
    missing = [c for c in sequence if c not in data_schema.names]
    if missing:
        raise UsageError(f"sequence column(s) {missing} are not in the schema {data_schema.names}")
    for column in sequence:
        check_sequence_type(column, data_schema.field(column).type)
    aggregated = dict(aggregates or {})
    missing = [c for c in aggregated if c not in data_schema.names]
    if missing:
        raise UsageError(f"aggregated column(s) {missing} are not in the schema")
    for column, function in aggregated.items():
        check_aggregate_type(column, function, data_schema.field(column).type)
    layout_buckets = (DEFAULT_BUCKETS if keys else 0) if buckets is None else buckets
    settings = TableSettings(
        key=keys,
        buckets=layout_buckets,
        bucket_rows=(
            (DEFAULT_BUCKET_ROWS if layout_buckets else 0) if bucket_rows is None else bucket_rows
        ),
        schema_evolution=allow_schema_evolution,
        deletion_vectors=deletion_vectors,
        sequence_by=sequence,
        tombstone_retention=parse_interval(tombstone_retention),
        merge=merge,
        aggregates=tuple(sorted(aggregated.items())),
        history=history,
        track_history_on=tuple(track_history_on),
    )
    missing = [c for c in settings.track_history_on if c not in data_schema.names]
    if missing:
        raise UsageError(f"track_history_on column(s) {missing} are not in the schema")
    if settings.history == "scd2":
        taken = [c for c in (START, END) if c in data_schema.names]
        if taken:
            raise UsageError(f"column(s) {taken} are the history's own: name yours otherwise")
        data_schema = with_history_columns(data_schema, sequence[0])
    # Columns that keep their last value set carry the sequence that set it (cdc.md).
    types = {c: data_schema.field(c).type for c in sequence}
    rule = MergeRule.of(settings)
    data_schema = pa.schema(
        [*data_schema, *own_sequence_fields(data_schema, keys, sequence, rule, types)]
    )
    warehouse = location(warehouse)
    path = warehouse / name
    with atomicity_for(warehouse).hold(name):
        if is_table(path):
            raise UsageError(f"table {name!r} exists already under {warehouse}")
        if isinstance(options, SparkOptions):
            from ..spark_integration.session import session_for
            from .spark import create_delta_table as create_spark

            session = session_for(warehouse, options.config)
            create_spark(session, path, data_schema, settings, table=name, node="cli")
        else:
            from .delta_rs import create_delta_table as create_rs

            try:
                create_rs(path, data_schema, settings, table=name, node="cli")
            except CommitConflictError as exc:  # on a store no lock kept another creator out
                raise UsageError(f"table {name!r} exists already under {warehouse}") from exc
    return settings
