"""Arrow pages: rows that travel as Arrow columns instead of one msgpack value per row.

A source may yield ``pyarrow.RecordBatch`` or ``pyarrow.Table`` objects instead of row dicts.
The client then routes their rows by key column without a Python pass per row (beyond the
key's hash), cuts each partition's rows into pages of ``page_size`` rows, and sends a page as
one Arrow IPC stream in the batch frame's ``arrow`` field. The node hands the page to the
receiver as :class:`ArrowRows`, a read-only sequence of row dicts that also exposes the Arrow
table, and the table engine stages the columns as they are.

Rows whose ``DELETE_COLUMN`` (a boolean column, optional) is true delete their key, as
:class:`deltaflow.Delete` items do.

Decoding reads data only, within bounds a page's size sets (:func:`decode_page`): nothing is
inflated, no extension type is built, and every batch is validated in full before a receiver
sees it.

Importing this module does not import pyarrow.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any, Final, overload

from ._arrow_ipc import Declared, count_fields, declared
from .errors import ProtocolError

__all__ = [
    "DELETE_COLUMN",
    "INTERNAL_PREFIXES",
    "PAGE_LIMITS",
    "ArrowRows",
    "PageLimits",
    "byte_offsets",
    "decode_page",
    "encode_page",
    "is_arrow",
    "nullable",
]

#: The optional boolean column of an Arrow source whose true rows delete their key.
DELETE_COLUMN: Final = "__deltaflow_delete"
#: A row's columns set to null on purpose (``deltaflow.set_null``): on a ``partial`` table a
#: null otherwise keeps the stored value.
NULLS_COLUMN: Final = "__deltaflow_nulls"
#: Column names deltaflow keeps for itself: stored (the bucket column, a column's own
#: sequence) and working (the delete and nulls columns above, a group's merge columns).
#: Rows may not set them; reads leave them out unless asked for.
INTERNAL_PREFIXES: Final = ("_deltaflow_", "__deltaflow_")


def is_arrow(kind: type) -> bool:
    """Whether ``kind`` is a pyarrow ``RecordBatch`` or ``Table`` (without importing pyarrow)."""
    return kind.__module__.startswith("pyarrow") and kind.__name__ in ("RecordBatch", "Table")


def nullable(field: Any) -> Any:
    """The Arrow ``field`` with it, and every field nested in it, nullable: what a table
    created from a source's columns holds, whatever NOT NULL the source declared."""
    import pyarrow as pa

    kind = field.type
    if pa.types.is_struct(kind):
        kind = pa.struct([nullable(kind.field(i)) for i in range(kind.num_fields)])
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
        maker = pa.list_ if pa.types.is_list(kind) else pa.large_list
        kind = maker(nullable(kind.value_field))
    elif pa.types.is_fixed_size_list(kind):
        kind = pa.list_(nullable(kind.value_field), kind.list_size)
    elif pa.types.is_map(kind):
        kind = pa.map_(kind.key_field, nullable(kind.item_field), keys_sorted=kind.keys_sorted)
    return pa.field(field.name, kind, nullable=True, metadata=field.metadata)


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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PageLimits:
    """What a node reads of an Arrow page: a page beyond these is refused (``BAD_FRAME``).

    Attributes:
        batches: most record batches in a page, and most dictionary messages (the client
            sends one record batch).
        fields: most fields in a page's schema, nested ones included.
        depth: how deep fields may nest.
        per_byte: most values an array may hold, and most bytes its batches may decode to,
            per byte of the page. 8 is one bit per row: the delete column every page of the
            client carries. Uncompressed buffers are slices of the page, so only a dictionary
            that several batches share counts more than once.
    """

    batches: int = 64
    fields: int = 10_000
    depth: int = 32
    per_byte: int = 8


#: The bounds every node applies to Arrow pages.
PAGE_LIMITS: Final = PageLimits()


def decode_page(data: Any, count: int) -> ArrowRows:
    """The page in a batch frame's ``arrow`` field, checked to hold ``count`` rows.

    Every message's metadata is checked before any body is read (:func:`_scan`); then the
    batches are read one at a time, each validated in full (offsets, lengths, UTF-8,
    dictionary indexes), with running caps on rows and decoded bytes. It takes time in
    proportion to the page: a node calls it off its event loop.

    Raises:
        ProtocolError: not an Arrow IPC stream, a page beyond :data:`PAGE_LIMITS`, a
            compressed body, other than ``count`` rows, a malformed batch, an extension type,
            a repeated column name, or a delete column that is not boolean.
    """
    import pyarrow as pa

    if not isinstance(data, bytes):
        raise ProtocolError("'arrow' must be bytes")
    buffer = pa.py_buffer(data)
    expected = _scan(buffer, count)
    bound = PAGE_LIMITS.per_byte * len(data)
    with _not_arrow("is not an Arrow IPC stream"):
        reader = pa.ipc.open_stream(buffer)
    with _not_arrow("schema is refused"):  # names that are not UTF-8, say
        _check_schema(reader.schema)
    batches = []
    rows = size = 0
    for index, metadata in enumerate(expected):
        with _not_arrow(f"record batch {index} is malformed"):
            batch = reader.read_next_batch()
            batch.validate(full=True)
        rows += batch.num_rows
        size += batch.get_total_buffer_size()
        if batch.num_rows != metadata.rows or rows > count:  # pyarrow read what _scan did
            raise ProtocolError(f"'arrow' record batch {index} is not the one declared")
        if size > bound:
            raise ProtocolError(
                f"'arrow' decodes to more than {bound} bytes ({PAGE_LIMITS.per_byte} per byte)"
            )
        batches.append(batch)
    if rows != count:
        raise ProtocolError(f"'arrow' holds {rows} rows, the frame says {count}")
    return ArrowRows.of(pa.Table.from_batches(batches, reader.schema))


def _scan(buffer: Any, count: int) -> list[Declared]:
    """What the record batches of the IPC stream in ``buffer`` declare, read from the
    messages' metadata only: nothing is decompressed or decoded. Refuses compressed bodies
    (pyarrow would decompress them as it reads, to any size), dictionary deltas, more rows
    than ``count`` and whatever is beyond :data:`PAGE_LIMITS`, at the first such message.
    """
    limits = PAGE_LIMITS
    bound = limits.per_byte * buffer.size
    messages = _messages(buffer)
    schema = next(messages, None)
    if schema is None or schema.type != "schema":
        raise ProtocolError("'arrow' is not an Arrow IPC stream: it does not start with a schema")
    with _not_arrow("schema is refused"):
        count_fields(schema.metadata.to_pybytes(), limit=limits.fields, max_depth=limits.depth)
    batches: list[Declared] = []
    dictionaries = rows = 0
    for message in messages:
        if message.type == "record batch":
            name = f"record batch {len(batches)}"
        elif message.type == "dictionary":
            name = f"dictionary {dictionaries}"
            dictionaries += 1
        else:
            raise ProtocolError(f"'arrow' holds a message of type {message.type!r}")
        with _not_arrow(f"{name} is refused"):
            body = 0 if message.body is None else message.body.size
            what = declared(message.metadata.to_pybytes(), body, max_arrays=limits.fields)
        if message.type == "record batch":
            rows += what.rows
            if rows > count:
                raise ProtocolError(f"'arrow' holds more than {count} rows (the frame's n)")
            batches.append(what)
        if what.compressed:
            raise ProtocolError(
                f"'arrow' {name} is compressed: send pages uncompressed (as the deltaflow "
                "client does; a compressed body can expand far beyond the frame)"
            )
        if what.delta:
            raise ProtocolError(f"'arrow' {name} is a dictionary delta; send whole dictionaries")
        wrong = [n for n in (what.rows, *what.lengths) if not 0 <= n <= bound]
        if wrong:
            raise ProtocolError(
                f"'arrow' {name} declares an array of {wrong[0]} values (at most {bound}: "
                f"{limits.per_byte} per byte of the page)"
            )
        if max(len(batches), dictionaries) > limits.batches:
            raise ProtocolError(f"'arrow' holds more than {limits.batches} batches or dictionaries")
    return batches


def _messages(buffer: Any) -> Iterator[Any]:
    """The messages of the IPC stream in ``buffer`` (``pyarrow.ipc.Message``), one at a time:
    pyarrow checks each one's framing and metadata, and reads its body as a slice of
    ``buffer``."""
    import pyarrow as pa

    try:
        reader = pa.ipc.MessageReader.open_stream(buffer)
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                return
            yield message
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ProtocolError(f"'arrow' is not an Arrow IPC stream: {str(exc)[:200]}") from exc


def _check_schema(schema: Any) -> None:
    """Refuse what the metadata scan does not look at: repeated column names (a column would
    be ambiguous), names that are not UTF-8, an extension type however it came, and types
    whose values neither Python nor a table holds (an unknown time zone, a decimal scale
    outside 0 to its precision).

    Raises:
        ProtocolError: the schema holds one of those.
        UnicodeDecodeError: a field name or time zone is not UTF-8.
    """
    import pyarrow as pa

    repeated = [name for name, seen in collections.Counter(schema.names).items() if seen > 1]
    if repeated:
        raise ProtocolError(f"'arrow' repeats column names: {str(repeated[:3])[:200]}")
    fields = list(schema)
    while fields:
        field = fields.pop()
        kind = field.type
        if isinstance(kind, pa.DictionaryType):
            kind = kind.value_type
        if isinstance(kind, pa.BaseExtensionType):
            raise ProtocolError(f"'arrow' field {field.name[:64]!r} has an extension type")
        if pa.types.is_timestamp(kind) and kind.tz and not _known_zone(kind.tz):
            raise ProtocolError(f"'arrow' field {field.name[:64]!r}: unknown time zone")
        if pa.types.is_decimal(kind) and not 0 <= kind.scale <= kind.precision:
            raise ProtocolError(f"'arrow' field {field.name[:64]!r}: a decimal scale out of range")
        children = [kind.field(i) for i in range(kind.num_fields)]
        for child in children:
            _ = child.name  # decoded here, not in a receiver
        fields += children


@functools.lru_cache(maxsize=64)
def _known_zone(name: str) -> bool:
    import pyarrow as pa

    try:
        pa.lib.string_to_tzinfo(name)
    except (KeyError, ValueError, pa.ArrowException):  # zoneinfo's not-found is a KeyError
        return False
    return True


@contextlib.contextmanager
def _not_arrow(what: str) -> Iterator[None]:
    """pyarrow's and the metadata scan's errors as a ``ProtocolError``: ``'arrow' <what>``."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ProtocolError(f"'arrow' {what}: {str(exc)[:200]}") from exc
