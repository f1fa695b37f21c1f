"""The table engines, by name: the one list of them, building a node's engine, and creating
a table through either.

This module sits above :mod:`deltaflow.tables` (engine-neutral Delta machinery and the delta-rs
engine) and :mod:`deltaflow.spark_integration` (the Spark engine), so neither of them needs to
know the other; the node and the CLI choose an engine here. The Spark side is imported only
when it is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from .errors import UsageError
from .receivers.base import check_table_name
from .storage.paths import Location, location
from .tables.atomicity import atomicity_for
from .tables.log import is_table
from .tables.settings import DEFAULT_BUCKETS, TableSettings, parse_schema

if TYPE_CHECKING:
    from .spark_integration.session import SparkConfig
    from .tables.engine import TableEngine

__all__ = [
    "DEFAULT_ENGINE",
    "DELTA_RS",
    "ENGINE_NAMES",
    "SPARK",
    "check_engine",
    "create_table",
    "new_engine",
]

SPARK: Final = "spark"
DELTA_RS: Final = "delta-rs"
#: Every engine a node can run (``deltaflow serve --engine``) or create a table with.
ENGINE_NAMES: Final = (SPARK, DELTA_RS)
#: A node's engine unless told otherwise (``deltaflow table create`` defaults to delta-rs:
#: creating a table needs no JVM).
DEFAULT_ENGINE: Final = SPARK


def check_engine(name: str) -> str:
    """``name`` if it names an engine.

    Raises:
        UsageError: it does not.
    """
    if name not in ENGINE_NAMES:
        raise UsageError(f"engine must be one of {list(ENGINE_NAMES)}, got {name!r}")
    return name


def new_engine(
    name: str,
    warehouse: Location,
    *,
    spark: SparkConfig | None = None,
    spark_writer: str | None = None,
    **settings: Any,
) -> TableEngine:
    """A node's table engine ``name`` over ``warehouse``; ``settings`` go to
    :class:`~.tables.engine.TableEngine` (node id, group bounds, defaults of new tables);
    ``spark`` and ``spark_writer`` to the Spark engine only."""
    if check_engine(name) == SPARK:
        from .spark_integration.spark_engine import SparkTableEngine

        extra: dict[str, Any] = {"spark": spark}
        if spark_writer is not None:
            extra["writer"] = spark_writer
        return SparkTableEngine(warehouse, **extra, **settings)
    from .tables.deltars_engine import DeltaRsTableEngine

    return DeltaRsTableEngine(warehouse, **settings)


def create_table(
    warehouse: Location | str,
    name: str,
    *,
    schema: Any,
    key: str | Sequence[str] = (),
    buckets: int | None = None,
    allow_schema_evolution: bool = False,
    deletion_vectors: bool = False,
    engine: str = DELTA_RS,
    spark: Any = None,
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
        allow_schema_evolution: writes may add columns (default False: rows with unknown
            columns are rejected).
        deletion_vectors: enable Delta deletion vectors (default False): Spark's MERGE marks
            the rows it replaces, and the delta-rs engine applies groups by merge-on-read
            (see docs/tables.md). Readers need Delta reader version 3.
        engine: ``"delta-rs"`` (default; no JVM) or ``"spark"``.
        spark: a :class:`~.spark_integration.session.SparkConfig` for ``engine="spark"``.

    Returns the settings stored in the table's properties.

    Raises:
        UsageError: bad arguments, or the table exists already.
    """
    check_table_name(name)
    check_engine(engine)
    data_schema = parse_schema(schema)
    keys = (key,) if isinstance(key, str) else tuple(key)
    missing = [k for k in keys if k not in data_schema.names]
    if missing:
        raise UsageError(f"key column(s) {missing} are not in the schema {data_schema.names}")
    settings = TableSettings(
        key=keys,
        buckets=(DEFAULT_BUCKETS if keys else 0) if buckets is None else buckets,
        schema_evolution=allow_schema_evolution,
        deletion_vectors=deletion_vectors,
    )
    warehouse = location(warehouse)
    path = warehouse / name
    with atomicity_for(warehouse).hold(name):
        if is_table(path):
            raise UsageError(f"table {name!r} exists already under {warehouse}")
        if engine == SPARK:
            from .spark_integration.session import SparkConfig, session_for
            from .spark_integration.spark_engine import create_delta_table as create_spark

            session = session_for(warehouse, spark or SparkConfig())
            create_spark(session, path, data_schema, settings, table=name, node="cli")
        else:
            from .tables.deltars_engine import create_delta_table as create_rs

            create_rs(path, data_schema, settings, table=name, node="cli")
    return settings
