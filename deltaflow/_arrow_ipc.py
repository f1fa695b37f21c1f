"""What the messages of an Arrow IPC stream declare, read from their metadata before pyarrow
reads a single body: the schema's field count and depth, and each batch's row count, array
lengths, compression and delta flag (see ``docs/protocol.md``, Arrow pages).

pyarrow decompresses a compressed body as it reads the batch, so a page must be judged on
what its metadata declares: :mod:`deltaflow.columnar` refuses a page here, before it is read.

The metadata is a flatbuffer (``format/Message.fbs`` and ``format/Schema.fbs`` of Apache
Arrow). pyarrow's ``MessageReader`` has already verified it; every read below is bounds-checked
all the same, so malformed metadata is a :class:`ValueError`, never a crash or a large
allocation. Importing this module does not import pyarrow.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Final

__all__ = ["EXTENSION_NAME", "Declared", "count_fields", "declared"]

#: The field metadata key that makes a field an extension type.
EXTENSION_NAME: Final = b"ARROW:extension:name"

# Message.header is a union: its type tag is field 1, its table field 2.
_HEADER_SCHEMA: Final = 1
_HEADER_DICTIONARY: Final = 2
_HEADER_RECORD_BATCH: Final = 3
# FieldNode and Buffer are structs of two int64s.
_STRUCT_SIZE: Final = 16


@dataclasses.dataclass(frozen=True, slots=True)
class Declared:
    """What one record batch or dictionary message says it holds.

    Attributes:
        rows: the batch's length (a dictionary's: its entry count).
        lengths: the length of every array in it, nested ones included.
        compressed: whether its body buffers are compressed.
        delta: whether it is a dictionary delta (appended to an earlier dictionary).
    """

    rows: int
    lengths: tuple[int, ...]
    compressed: bool
    delta: bool = False


_I32: Final = struct.Struct("<i").unpack_from
_U32: Final = struct.Struct("<I").unpack_from
_U16: Final = struct.Struct("<H").unpack_from


class _Table:
    """One flatbuffer table: its fields, found through its vtable. A read past the end of
    the metadata is a ``struct.error``; positions only grow from the table's, except the
    vtable's, which is checked."""

    __slots__ = ("_buf", "_pos", "_vtable", "_vtable_size")

    def __init__(self, buf: bytes, pos: int) -> None:
        self._buf = buf
        self._pos = pos
        self._vtable = pos - _I32(buf, pos)[0]
        if self._vtable < 0:  # struct would count it from the end
            raise ValueError(f"a vtable at offset {self._vtable}")
        self._vtable_size = _U16(buf, self._vtable)[0]

    def _slot(self, index: int) -> int | None:
        entry = 4 + 2 * index
        if entry + 2 > self._vtable_size:
            return None
        offset: int = _U16(self._buf, self._vtable + entry)[0]
        return self._pos + offset if offset else None

    def scalar(self, index: int, fmt: str, default: int = 0) -> int:
        slot = self._slot(index)
        return default if slot is None else int(struct.unpack_from(fmt, self._buf, slot)[0])

    def _target(self, index: int) -> int | None:
        slot = self._slot(index)
        return None if slot is None else slot + _U32(self._buf, slot)[0]

    def table(self, index: int) -> _Table | None:
        at = self._target(index)
        return None if at is None else _Table(self._buf, at)

    def vector(self, index: int, item_size: int) -> tuple[int, int]:
        """Where the items of a vector field start, and how many there are (0 when absent).

        Raises:
            ValueError: the vector runs past the metadata's end.
        """
        at = self._target(index)
        if at is None:
            return 0, 0
        count: int = _U32(self._buf, at)[0]
        if at + 4 + count * item_size > len(self._buf):
            raise ValueError(f"a vector of {count} items runs past the metadata's end")
        return at + 4, count

    def string(self, index: int) -> bytes:
        """A string field's bytes (empty when absent)."""
        start, size = self.vector(index, 1)
        return self._buf[start : start + size]

    def tables(self, start: int, count: int) -> list[_Table]:
        """The tables of the vector at ``start`` (from :meth:`vector`)."""
        return [
            _Table(self._buf, at + _U32(self._buf, at)[0])
            for at in range(start, start + 4 * count, 4)
        ]


def _root(metadata: bytes) -> tuple[int, _Table | None]:
    """The message's header type and header table."""
    message = _Table(metadata, _U32(metadata, 0)[0])
    return message.scalar(1, "<B"), message.table(2)


def declared(metadata: bytes, body: int, *, max_arrays: int) -> Declared:
    """What the record batch or dictionary message with this metadata and a body of
    ``body`` bytes declares.

    Raises:
        ValueError: the metadata is malformed, belongs to another kind of message, declares
            more than ``max_arrays`` arrays, or buffers outside the body.
    """
    try:
        return _declared(metadata, body, max_arrays)
    except struct.error as exc:
        raise ValueError(f"the metadata is cut short ({exc})") from exc


def _declared(metadata: bytes, body: int, max_arrays: int) -> Declared:
    kind, header = _root(metadata)
    if header is None or kind not in (_HEADER_RECORD_BATCH, _HEADER_DICTIONARY):
        raise ValueError(f"message header {kind} is not a record batch or a dictionary")
    delta = False
    if kind == _HEADER_DICTIONARY:
        delta = bool(header.scalar(2, "<?"))
        header = header.table(1)
        if header is None:
            raise ValueError("a dictionary message holds no batch")
    start, count = header.vector(1, _STRUCT_SIZE)
    if count > max_arrays:
        raise ValueError(f"a batch of {count} arrays (at most {max_arrays})")
    nodes = struct.unpack_from(f"<{2 * count}q", metadata, start)
    # RecordBatch.buffers (field 2) must lie in the body; its variadicBufferCounts (field 4)
    # say how many of them view arrays use: pyarrow reserves that many before checking.
    start, count = header.vector(2, _STRUCT_SIZE)
    spans = struct.unpack_from(f"<{2 * count}q", metadata, start)
    for offset, length in zip(spans[::2], spans[1::2], strict=True):
        if not (0 <= offset and 0 <= length and offset + length <= body):
            raise ValueError(f"a buffer of {length} bytes at {offset} lies outside the body")
    start, variadic = header.vector(4, 8)
    counts = struct.unpack_from(f"<{variadic}q", metadata, start)
    if any(n < 0 for n in counts) or sum(counts) > count:
        raise ValueError(f"variadic buffer counts {list(counts)[:4]} for {count} buffers")
    return Declared(
        rows=header.scalar(0, "<q"),
        lengths=nodes[::2],
        compressed=header.table(3) is not None,
        delta=delta,
    )


def count_fields(metadata: bytes, *, limit: int, max_depth: int) -> int:
    """How many fields the schema message with this metadata declares, nested ones included.

    Raises:
        ValueError: the metadata is malformed or not a schema's, it declares more than
            ``limit`` fields, nests them deeper than ``max_depth``, or a field has an
            extension type (pyarrow would build a registered one from the wire).
    """
    try:
        return _count_fields(metadata, limit, max_depth)
    except struct.error as exc:
        raise ValueError(f"the metadata is cut short ({exc})") from exc


def _count_fields(metadata: bytes, limit: int, max_depth: int) -> int:
    kind, schema = _root(metadata)
    if schema is None or kind != _HEADER_SCHEMA:
        raise ValueError(f"message header {kind} is not a schema")
    # Schema.fields is field 1; Field.children is field 5. Level by level, counting each
    # vector before listing it, so neither depth nor width recurses or lists beyond the bounds.
    level = [(schema, *schema.vector(1, 4))]
    found = 0
    for depth in range(max_depth + 1):
        width = sum(count for _, _, count in level)
        if not width:
            return found
        if depth == max_depth:
            raise ValueError(f"the schema nests fields deeper than {max_depth} levels")
        found += width
        if found > limit:
            raise ValueError(f"the schema declares more than {limit} fields")
        fields = [f for table, start, count in level for f in table.tables(start, count)]
        for field in fields:
            _refuse_extension(field)
        level = [(f, *f.vector(5, 4)) for f in fields]
    raise AssertionError("unreachable: the last level returns or raises")


def _refuse_extension(field: _Table) -> None:
    # Field.custom_metadata is field 6: a vector of KeyValue tables (key 0, value 1).
    start, count = field.vector(6, 4)
    for pair in field.tables(start, count):
        if pair.string(0) == EXTENSION_NAME:
            name = field.string(0).decode("utf-8", "replace")[:64]
            kind = pair.string(1).decode("utf-8", "replace")[:64]
            raise ValueError(f"field {name!r} has the extension type {kind!r}")
