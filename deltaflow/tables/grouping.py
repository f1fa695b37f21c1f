"""A group's rows as its commit applies them: the last write of each key, conformed to the
table's columns, types and bucket layout.

Within a group, several writes of one key collapse to the last in staging order (deletes
included), which is the order the node's lanes staged them: per (stream, partition) sequence
order. The result equals applying the batches one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..columnar import DELETE_COLUMN
from ..partitioning import partition_table
from .conversion import convert_column
from .merging import internal
from .settings import BUCKET_COLUMN, TableSettings

__all__ = ["conform", "last_per_key"]


def conform(
    data: Any, schema: Any, settings: TableSettings, *, table: str, node: str, recompute: bool
) -> Any:
    """``data`` with exactly the columns of ``schema`` (the table's data columns), in its
    order, plus the bucket and delete columns. Rows checked against an older schema, or before
    the table existed, are cast here; the bucket column is computed again when ``recompute``
    (the rows were bucketed with another count) or a key column was cast.

    Raises:
        SchemaError: a column whose type does not convert.
    """
    import pyarrow as pa

    columns: list[Any] = []
    cast_key = False
    for field in schema:
        if field.name not in data.column_names:
            columns.append(pa.nulls(data.num_rows, type=field.type))
            continue
        column = data.column(field.name)
        if column.type != field.type:
            column = convert_column(column, field, table=table, node=node)
            cast_key = cast_key or field.name in settings.key
        columns.append(column)
    out = pa.Table.from_arrays(columns, schema=schema)
    if settings.buckets:
        if recompute or cast_key or BUCKET_COLUMN not in data.column_names:
            buckets = partition_table(out, settings.key, settings.buckets)
        else:
            buckets = data.column(BUCKET_COLUMN)
        out = out.append_column(pa.field(BUCKET_COLUMN, pa.int32()), buckets)
    out = out.append_column(DELETE_COLUMN, data.column(DELETE_COLUMN))
    for name in data.column_names:  # a fold's own columns (merge modes)
        if internal(name) and name != DELETE_COLUMN:
            out = out.append_column(data.schema.field(name), data.column(name))
    return out


def last_per_key(table: Any, key: Sequence[str]) -> Any:
    """Rows of ``table`` keeping only the last occurrence of each key (order preserved)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = table.num_rows
    if rows < 2:
        return table
    if len(key) == 1:
        last_rows = _last_rows_of_one_column(table.column(key[0]))
        if last_rows is not None:
            return table if len(last_rows) == rows else table.take(last_rows)
    # Arrow's hash aggregation, not a Python pass: the highest row index of every key.
    index = "__deltaflow_row"
    last = (
        table.select(list(key))
        .append_column(index, pa.array(range(rows), type=pa.int64()))
        .group_by(list(key), use_threads=False)
        .aggregate([(index, "max")])
        .column(f"{index}_max")
    )
    if len(last) == rows:
        return table
    return table.take(pc.take(last, pc.sort_indices(last)))


def _last_rows_of_one_column(column: Any) -> Any:
    """Ascending indexes of the last occurrence of each value of ``column``, from its integers
    (or dictionary codes) and numpy's sort, which is cheaper than Arrow's hash aggregation
    (docs/tables.md). None for a type Arrow cannot dictionary-encode."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    column = column.combine_chunks()
    try:
        codes = (
            column.to_numpy(zero_copy_only=False)
            if pa.types.is_integer(column.type)
            else pc.dictionary_encode(column).indices.to_numpy(zero_copy_only=False)
        )
    except pa.ArrowNotImplementedError:
        return None
    _, first_from_end = np.unique(codes[::-1], return_index=True)
    return np.sort(len(codes) - 1 - first_from_end)
