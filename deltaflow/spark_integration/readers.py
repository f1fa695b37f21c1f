"""Spark as a reader: :func:`read_table` and :func:`read_dead_letters` read a deltaflow table
(and the dead-letter table) back as DataFrames.

Importing this module does not import PySpark.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..client.options import DEFAULT_DEAD_LETTER_TABLE
from ..errors import SchemaError, UsageError
from ..receivers.base import check_table_name
from ..tables.log import DELTA_LOG, is_table
from ..tables.settings import BUCKET_COLUMN

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["read_dead_letters", "read_table"]


def read_table(
    spark: SparkSession,
    warehouse: str | os.PathLike[str],
    name: str,
    *,
    all_columns: bool = False,
) -> DataFrame:
    """The deltaflow table ``name`` under ``warehouse`` as a DataFrame.

    A table lives at ``<warehouse>/<name>``, the nodes' ``--warehouse`` directory. The
    SparkSession needs Delta (``deltaflow.spark_integration.get_spark()`` gives one).
    deltaflow's bucket column (``_deltaflow_bucket``, the layout of keyed tables) is left out
    unless ``all_columns`` is true.

    Raises:
        UsageError: ``name`` is not a table name, or there is no Delta table at that path
            (the message names the path and the tables that do exist).
    """
    path = _table_path(
        warehouse,
        name,
        missing="a table is created by its first write, so stream into it first",
    )
    return _load(spark, path, all_columns=all_columns)


def read_dead_letters(
    spark: SparkSession,
    warehouse: str | os.PathLike[str],
    table: str = DEFAULT_DEAD_LETTER_TABLE,
) -> DataFrame:
    """The dead-letter table (``StreamerOptions.dead_letter_table``) as a DataFrame.

    Columns: ``stream_id``, ``position``, ``partition``, ``seq``, ``error_code``, ``error``,
    ``node``, ``payload`` (the item, msgpack-packed: ``msgpack.unpackb(payload, timestamp=3)``),
    ``deleted`` and ``failed_at`` (see ``docs/guarantees.md``). For rows streamed with
    :func:`stream_dataframe`, ``stream_id`` is ``"<base id>:<Spark partition>"`` and
    ``position`` the row's index in that partition.

    Raises:
        UsageError: there is no such table (nothing was dead-lettered into it yet).
    """
    path = _table_path(
        warehouse,
        table,
        missing=(
            "the dead-letter table is created when the first item is set aside under "
            "StreamerOptions(on_failure='fallback'); if that happened, check the table name "
            "(StreamerOptions.dead_letter_table)"
        ),
    )
    return _load(spark, path, all_columns=False)


def _load(spark: SparkSession, path: Path, *, all_columns: bool) -> DataFrame:
    df = spark.read.format("delta").load(str(path))
    if not all_columns and BUCKET_COLUMN in df.columns:
        df = df.drop(BUCKET_COLUMN)
    return df


def _table_path(warehouse: str | os.PathLike[str], name: str, *, missing: str) -> Path:
    try:
        check_table_name(name)
    except SchemaError as exc:
        raise UsageError(str(exc)) from exc
    root = Path(warehouse)
    path = root / name
    if is_table(path):
        return path
    if not root.is_dir():
        where = f"the warehouse directory {root} does not exist; pass the nodes' --warehouse"
    else:
        tables = sorted(p.name for p in root.iterdir() if is_table(p))
        where = f"tables under {root}: {', '.join(tables) if tables else 'none'}; {missing}"
    raise UsageError(f"no deltaflow table {name!r} at {path} (no {DELTA_LOG} there); {where}")
