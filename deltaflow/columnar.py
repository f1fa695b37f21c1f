"""Arrow pages: rows that travel as Arrow columns instead of one msgpack value per row.

A source may yield ``pyarrow.RecordBatch`` or ``pyarrow.Table`` objects instead of row dicts.
The client then routes their rows by key column without a Python pass per row (beyond the
key's hash), cuts each partition's rows into pages of ``page_size`` rows, and sends a page as
one Arrow IPC stream in the batch frame's ``arrow`` field. The node hands the page to the
receiver as :class:`ArrowRows`, a read-only sequence of row dicts that also exposes the Arrow
table, and the table engine stages the columns as they are.

Rows whose ``DELETE_COLUMN`` (a boolean column, optional) is true delete their key, as
:class:`deltaflow.Delete` items do.

Decoding reads data only: an IPC stream holds schemas and buffers, and pyarrow never loads
Python extension types from it unless a program registered one (deltaflow registers none).

Importing this module does not import pyarrow.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Final, overload

from .errors import ProtocolError

__all__ = ["DELETE_COLUMN", "ArrowRows", "byte_offsets", "decode_page", "encode_page", "is_arrow"]

#: The optional boolean column of an Arrow source whose true rows delete their key.
DELETE_COLUMN: Final = "__deltaflow_delete"


def is_arrow(kind: type) -> bool:
    """Whether ``kind`` is a pyarrow ``RecordBatch`` or ``Table`` (without importing pyarrow)."""
    return kind.__module__.startswith("pyarrow") and kind.__name__ in ("RecordBatch", "Table")


class ArrowRows(Sequence[Any]):
    """Rows held as an Arrow table, seen as a sequence of row dicts.

    The dicts are built on first access only (a receiver that works on ``table`` never pays
    for them). Deletes are a boolean array beside the table (``flags``), so slicing, taking
    and joining pages never looks at rows one by one; ``deletes`` lists them when asked.

    Attributes:
        table: the rows (a ``pyarrow.Table``), without the delete column.
        flags: which rows delete their key (a boolean array without nulls), or None for none.
    """

    __slots__ = ("_deletes", "_rows", "flags", "table")

    def __init__(self, table: Any, flags: Any = None) -> None:
        self.table = table
        self.flags = flags
        self._deletes: frozenset[int] | None = None
        self._rows: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, data: Any) -> ArrowRows:
        """The rows of a ``RecordBatch`` or ``Table``, its ``DELETE_COLUMN`` taken out.

        Raises:
            ProtocolError: the delete column is not boolean.
        """
        import pyarrow as pa
        import pyarrow.compute as pc

        table = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
        if DELETE_COLUMN not in table.column_names:
            return cls(table)
        flags = table.column(DELETE_COLUMN)
        if not pa.types.is_boolean(flags.type):
            raise ProtocolError(f"column {DELETE_COLUMN!r} must be boolean, not {flags.type}")
        flags = pc.fill_null(flags, False)
        return cls(table.drop_columns([DELETE_COLUMN]), flags if pc.any(flags).as_py() else None)

    @property
    def deletes(self) -> frozenset[int]:
        """Indexes of the rows that delete their key."""
        if self._deletes is None:
            import pyarrow.compute as pc

            found = () if self.flags is None else pc.indices_nonzero(self.flags).to_pylist()
            self._deletes = frozenset(found)
        return self._deletes

    def with_delete_column(self) -> Any:
        """The table with ``DELETE_COLUMN`` (what goes on the wire, and what is staged)."""
        return self.table.append_column(DELETE_COLUMN, self._flags_or_false())

    def _flags_or_false(self) -> Any:
        import pyarrow as pa

        if self.flags is not None:
            return self.flags
        return pa.repeat(pa.scalar(False), self.table.num_rows)

    def part(self, offset: int, length: int) -> ArrowRows:
        """Rows ``offset`` to ``offset + length`` (zero-copy)."""
        flags = None if self.flags is None else self.flags.slice(offset, length)
        return ArrowRows(self.table.slice(offset, length), flags)

    def take(self, indexes: Any) -> ArrowRows:
        """The rows at ``indexes`` (a list or an Arrow integer array), in that order."""
        import pyarrow as pa

        if not isinstance(indexes, (pa.Array, pa.ChunkedArray)):
            indexes = pa.array(indexes, pa.int64())
        flags = None if self.flags is None else self.flags.take(indexes)
        return ArrowRows(self.table.take(indexes), flags)

    @classmethod
    def concat(cls, parts: Sequence[ArrowRows]) -> ArrowRows:
        """The rows of ``parts`` one after the other."""
        import pyarrow as pa

        if len(parts) == 1:
            return parts[0]
        tables = [p.table for p in parts]
        # Rows of one page may differ only where joining changes no value: a column missing
        # or all null in some (the client cuts pages where types differ).
        same = all(t.schema.equals(tables[0].schema) for t in tables)
        table = pa.concat_tables(tables, promote_options="none" if same else "default")
        if all(p.flags is None for p in parts):
            return cls(table)
        chunks = [c for p in parts for c in _chunks(p._flags_or_false())]
        return cls(table, pa.chunked_array(chunks, type=pa.bool_()))

    def _dicts(self) -> list[dict[str, Any]]:
        if self._rows is None:
            self._rows = self.table.to_pylist()
        return self._rows

    def __len__(self) -> int:
        return int(self.table.num_rows)

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        return self._dicts()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._dicts())

    def __repr__(self) -> str:
        return f"ArrowRows({len(self)} rows, {len(self.deletes)} deletes)"


def byte_offsets(table: Any) -> Any:
    """Where each row of ``table`` starts in its Arrow bytes, as a numpy int64 array of
    ``num_rows + 1`` cumulative sizes: the bytes of rows ``i`` to ``j`` are
    ``offsets[j] - offsets[i]``, without a pass over ``table`` per slice.

    Fixed-width values count their width, strings and binaries their length plus their
    offset; a column of another type counts its average row.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = int(table.num_rows)
    sizes = np.zeros(rows, np.int64)
    fixed = 0.0
    for column in table.columns:
        kind = column.type
        if pa.types.is_boolean(kind):
            fixed += 0.125
        elif pa.types.is_string(kind) or pa.types.is_binary(kind):
            sizes += pc.binary_length(column).fill_null(0).to_numpy() + 4
        elif pa.types.is_large_string(kind) or pa.types.is_large_binary(kind):
            sizes += pc.binary_length(column).fill_null(0).to_numpy() + 8
        else:
            try:
                fixed += kind.bit_width / 8
            except ValueError:  # nested or view types: their average row
                fixed += column.nbytes / rows if rows else 0
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(sizes + math.ceil(fixed), out=offsets[1:])
    return offsets


def _chunks(array: Any) -> list[Any]:
    return list(array.chunks) if hasattr(array, "chunks") else [array]


def encode_page(rows: ArrowRows) -> bytes:
    """One Arrow IPC stream holding the page (with its delete column), as one record batch: a
    page gathered from the slices of many source batches would otherwise carry a record batch
    per slice, slower to encode and to decode than one."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    table = rows.with_delete_column().combine_chunks()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())


def decode_page(data: Any, count: int) -> ArrowRows:
    """The page in a batch frame's ``arrow`` field, checked to hold ``count`` rows.

    Raises:
        ProtocolError: not an Arrow IPC stream, a wrong row count, or a bad delete column.
    """
    import pyarrow as pa

    if not isinstance(data, bytes):
        raise ProtocolError("'arrow' must be bytes")
    try:
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ProtocolError(f"'arrow' is not an Arrow IPC stream: {exc}") from exc
    if table.num_rows != count:
        raise ProtocolError(f"'arrow' holds {table.num_rows} rows, the frame says {count}")
    return ArrowRows.of(table)
