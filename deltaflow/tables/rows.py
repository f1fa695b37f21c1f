"""Rows checked and converted when a write is staged: a bad row fails only its own batch,
with the item and column named, and never poisons a group.

Row dicts and Arrow pages take one conversion rule (:mod:`.conversion`): a value reaches the
table exactly, or the write is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from .._faults import fault_point
from ..columnar import DELETE_COLUMN, INTERNAL_PREFIXES, NULLS_COLUMN, ArrowRows
from ..errors import SchemaError
from ..partitioning import partition_table
from .conversion import column_of, convert_column, infer_column, table_type, transpose
from .settings import BUCKET_COLUMN, PROP_SCHEMA_EVOLUTION

__all__ = ["INTERNAL_COLUMNS", "no_evolution_text", "to_arrow_rows"]

#: Columns deltaflow adds to a write; a row may set neither.
INTERNAL_COLUMNS: Final = (DELETE_COLUMN, BUCKET_COLUMN)


def no_evolution_text(table: str, columns: Sequence[str]) -> str:
    """Why columns the table lacks are refused, and how to allow them."""
    return (
        f"table {table!r} has no column(s) {list(columns)} and does not allow schema "
        "evolution; to add columns on write, create the table with allow_schema_evolution=True "
        f"(deltaflow table create --allow-schema-evolution), or set its table property "
        f"{PROP_SCHEMA_EVOLUTION}=true"
    )


def to_arrow_rows(
    rows: Sequence[Any],
    deletes: frozenset[int],
    key: Sequence[str],
    schema: Any,
    *,
    table: str,
    node: str,
    evolve: bool = False,
    buckets: int = 0,
    sequence: Sequence[str] = (),
) -> Any:
    """Validate rows and build an Arrow table (with the delete flag column, and the bucket
    column when ``buckets`` > 0).

    Args:
        rows: row dicts, or an :class:`ArrowRows` page (its columns are checked as columns,
            and its own delete flags are used: ``deletes`` is ignored).
        schema: the table's data columns (an Arrow schema without the bucket column), or None
            when the table does not exist yet (the columns are then inferred from these rows).
        evolve: columns the table lacks are inferred and kept (schema evolution) instead of
            rejected.
        buckets: the table's bucket count; 0 for no bucket column.
        sequence: the table's sequence columns: every row, deletes included, must carry a
            value for each (a delete keeps them, and its key; its other values are ignored).

    Raises:
        SchemaError: naming the first bad item (its index in the batch) and column.
    """
    fault_point("converting")
    import pyarrow as pa

    # What every row must carry: its key and, on a sequence_by table, its sequence.
    required = _Required(tuple(key), tuple(sequence))
    if isinstance(rows, ArrowRows):
        data, new = _page_columns(rows, required, schema, table=table, node=node, evolve=evolve)
        flags = rows.flags
    else:
        data, new = _row_columns(
            rows, deletes, required, schema, table=table, node=node, evolve=evolve
        )
        flags = pa.array([i in deletes for i in range(len(rows))], pa.bool_()) if deletes else None
    if schema is None:
        missing = [k for k in key if k not in data.column_names]
        if missing:
            raise SchemaError(f"rows for table {table!r} lack key column(s) {missing}", node=node)
        missing = [c for c in sequence if c not in data.column_names]
        if missing:
            raise SchemaError(
                f"rows for table {table!r} lack sequence column(s) {missing} (its sequence_by)",
                node=node,
            )
    for field in data.schema:
        if (schema is None or field.name in new) and pa.types.is_null(field.type):
            raise SchemaError(
                f"column {field.name!r} is null in every row of this write to table {table!r}, "
                "which adds it, so its type cannot be inferred; send a non-null value",
                node=node,
                details={"column": field.name},
            )
    if buckets:
        data = data.append_column(
            pa.field(BUCKET_COLUMN, pa.int32()), partition_table(data, key, buckets)
        )
    return ArrowRows(data, flags).with_delete_column()


@dataclass(frozen=True, slots=True)
class _Required:
    """The columns every row must have a value for: the key, and the sequence columns of a
    ``sequence_by`` table (which a delete keeps as well)."""

    key: tuple[str, ...]
    sequence: tuple[str, ...] = ()

    @property
    def columns(self) -> tuple[str, ...]:
        return self.key + self.sequence

    def missing(self, i: int, column: str, table: str) -> str:
        what = "key column" if column in self.key else "sequence column"
        why = "" if column in self.key else " (its sequence_by: every change, deletes too)"
        return f"item #{i} of the batch has no value for {what} {column!r} of table {table!r}{why}"


def _row_columns(
    rows: Sequence[Any],
    deletes: frozenset[int],
    required: _Required,
    schema: Any,
    *,
    table: str,
    node: str,
    evolve: bool,
) -> tuple[Any, dict[str, None]]:
    """The columns of row dicts, checked; and the columns they add to the table."""
    import pyarrow as pa

    new: dict[str, None] = {}
    nulls: list[Any] | None = None
    # The common case costs no Python pass per row: plain dicts whose columns the table has
    # (so none is reserved or unknown); keys are checked on the built columns. Anything else,
    # and a null key, takes the row-by-row check, which names the offending item.
    fast = (
        schema is not None
        and set(map(type, rows)) <= {dict}
        and all(k in schema.names for k in required.columns)
        and all(map(frozenset(n for n in schema.names if not _reserved(n)).issuperset, rows))
    )
    if not fast:
        if any(isinstance(r, Mapping) and NULLS_COLUMN in r for r in rows):
            rows, nulls = _split_nulls(rows, required, table=table, node=node)
        new = _check_rows(rows, deletes, required, schema, table=table, node=node, evolve=evolve)
    if schema is None:
        # Inferred per column over every row (from_pylist would take the first row's keys).
        names = list(dict.fromkeys(c for row in rows for c in row))
        values = transpose(rows, names)
        data = pa.table(
            {
                c: infer_column(v, c, table=table, node=node)
                for c, v in zip(names, values, strict=True)
            }
        )
    else:
        present = set().union(*rows)
        fields = [f for f in schema if f.name in present]
        values = transpose(rows, [f.name for f in fields])
        for column, field in zip(values, fields, strict=True):
            if field.name not in required.columns:
                for i in deletes:  # a delete needs only its key: its other values are ignored
                    column[i] = None
        given = {
            f.name: column_of(v, f, table=table, node=node)
            for v, f in zip(values, fields, strict=True)
        }
        data = pa.Table.from_arrays(
            [given[f.name] if f.name in given else pa.nulls(len(rows), f.type) for f in schema],
            schema=schema,
        )
    if fast and any(data.column(k).null_count for k in required.columns):
        _check_rows(rows, deletes, required, schema, table=table, node=node, evolve=evolve)
    for c in new:
        column = [None if i in deletes else row.get(c) for i, row in enumerate(rows)]
        data = data.append_column(c, infer_column(column, c, table=table, node=node))
    if nulls is not None:
        data = data.append_column(NULLS_COLUMN, pa.array(nulls, pa.list_(pa.string())))
    return data, new


def _split_nulls(
    rows: Sequence[Any], required: _Required, *, table: str, node: str
) -> tuple[list[Any], list[Any]]:
    """Rows without their ``NULLS_COLUMN`` (the columns they name set to None), and per row
    the columns it sets to null on purpose (``deltaflow.set_null``), or None.

    Raises:
        SchemaError: a row names something other than columns, or its key or sequence.
    """
    out: list[Any] = []
    nulls: list[Any] = []
    for i, row in enumerate(rows):
        named = row.get(NULLS_COLUMN) if isinstance(row, Mapping) else None
        if named is None:
            out.append(row)
            nulls.append(None)
            continue
        if not (isinstance(named, list) and all(isinstance(c, str) for c in named)):
            raise SchemaError(
                f"item #{i} of the batch: {NULLS_COLUMN} lists the columns to set to null "
                f"(deltaflow.set_null), not {named!r}",
                node=node,
                details={"item": i, "column": NULLS_COLUMN},
            )
        kept = [c for c in named if c in required.columns]
        if kept:
            raise SchemaError(
                f"item #{i} of the batch sets {kept} of table {table!r} to null: a key or "
                "sequence column always has a value",
                node=node,
                details={"item": i, "column": kept[0]},
            )
        fixed = {k: v for k, v in row.items() if k != NULLS_COLUMN}
        fixed.update(dict.fromkeys(named))
        out.append(fixed)
        nulls.append(named)
    return out, nulls


def _page_columns(
    page: ArrowRows, required: _Required, schema: Any, *, table: str, node: str, evolve: bool
) -> tuple[Any, dict[str, None]]:
    """The columns of an Arrow page, checked as columns (a row is named only for a null key)
    and converted to the table's types; and the columns they add to the table."""
    import pyarrow.compute as pc

    data = page.table
    reserved = [c for c in data.column_names if _reserved(c)]  # (the delete column is not here)
    if reserved:
        raise SchemaError(
            f"the page sets column {reserved[0]!r}, which deltaflow reserves (its columns "
            "starting with _deltaflow_ or __deltaflow_ are computed on the node)",
            node=node,
            details={"column": reserved[0]},
        )
    for k in required.columns:
        if k in data.column_names and data.column(k).null_count:
            i = pc.index(pc.is_null(data.column(k)), True).as_py()
            raise SchemaError(
                required.missing(i, k, table), node=node, details={"item": i, "column": k}
            )
    if schema is not None:
        for k in required.sequence:
            if k not in data.column_names:
                raise SchemaError(
                    required.missing(0, k, table), node=node, details={"item": 0, "column": k}
                )
    if schema is None:
        return _as_table_types(data, table=table, node=node), {}
    unknown = [c for c in data.column_names if c not in schema.names]
    if unknown and not evolve:
        raise SchemaError(
            f"{no_evolution_text(table, unknown)} (its columns: {sorted(schema.names)})",
            node=node,
            details={"column": unknown[0]},
        )
    for field in schema:
        at = data.schema.get_field_index(field.name)
        if at >= 0 and data.schema.field(at).type != field.type:
            # Converted once here: the commit then finds the table's type (raises if not).
            column = convert_column(data.column(at), field, table=table, node=node)
            data = data.set_column(at, field, column)
    if unknown:
        data = _as_table_types(data, table=table, node=node, only=unknown)
    return data, dict.fromkeys(unknown)


def _as_table_types(data: Any, *, table: str, node: str, only: Sequence[str] | None = None) -> Any:
    """A page's columns that the table does not have yet (all of them for a new table) in
    the types the table will hold them as (:func:`.conversion.table_type`)."""
    import pyarrow as pa

    for at, field in enumerate(data.schema):
        if only is not None and field.name not in only:
            continue
        wanted = pa.field(field.name, table_type(field.type), nullable=True)
        if wanted.type != field.type:
            data = data.set_column(
                at, wanted, convert_column(data.column(at), wanted, table=table, node=node)
            )
    return data


def _check_rows(
    rows: Sequence[Any],
    deletes: frozenset[int],
    required: _Required,
    schema: Any,
    *,
    table: str,
    node: str,
    evolve: bool,
) -> dict[str, None]:
    """Check every row, naming the first bad one; the columns the rows add to the table (only
    when ``evolve``, else an unknown column is an error).

    Raises:
        SchemaError: naming the item (its index in the batch) and column.
    """
    columns = set(schema.names) if schema is not None else None
    new: dict[str, None] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise SchemaError(
                f"item #{i} of the batch is a {type(row).__name__}; rows for table {table!r} "
                "must be maps of column name to value",
                node=node,
                details={"item": i},
            )
        for k in required.columns:
            if row.get(k) is None:
                raise SchemaError(
                    required.missing(i, k, table), node=node, details={"item": i, "column": k}
                )
        reserved = [c for c in row if c == DELETE_COLUMN or _reserved(c)]
        if reserved:
            raise SchemaError(
                f"item #{i} of the batch sets column {reserved[0]!r}, which deltaflow reserves "
                "(the bucket layout, columns' own sequences, the delete flag and a group's "
                "working columns are computed on the node)",
                node=node,
                details={"item": i, "column": reserved[0]},
            )
        if columns is not None and i not in deletes:
            unknown = [c for c in row if c not in columns]
            if unknown and not evolve:
                raise SchemaError(
                    f"item #{i} of the batch: {no_evolution_text(table, unknown)} "
                    f"(its columns: {sorted(columns)})",
                    node=node,
                    details={"item": i, "column": unknown[0]},
                )
            new.update(dict.fromkeys(unknown))
    return new


def _reserved(column: Any) -> bool:
    """Whether a column is deltaflow's own: stored (``_deltaflow_bucket``, a column's own
    sequence) or a group's working column (``__deltaflow_replace``; the wire's delete and
    nulls columns are taken off the rows before this check)."""
    return isinstance(column, str) and column.startswith(INTERNAL_PREFIXES)
