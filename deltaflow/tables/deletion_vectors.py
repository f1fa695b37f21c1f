"""Delta deletion vectors: which rows of a data file are deleted, written and read as the Delta
protocol lays them out (``PROTOCOL.md``, "Deletion Vector Format").

A deletion vector (DV) is a set of row indexes of one Parquet file, kept as a 64-bit Roaring
bitmap (``pyroaring.BitMap64``, whose ``serialize`` is the portable format the protocol names)
behind a little-endian magic number. The log's ``add`` action points at it through a
*descriptor*:

- ``storageType`` ``"u"``: in a file ``deletion_vector_<uuid>.bin`` at the table's root (or
  under a prefix of ``pathOrInlineDv``), at ``offset``; ``pathOrInlineDv`` is the prefix and the
  UUID's 16 bytes in Z85; the file is a version byte (1), then per DV its size (big-endian
  int32), its bytes and their CRC-32 (big-endian);
- ``"i"``: inline, the bytes themselves in Z85 (padded to a multiple of four);
- ``"p"``: a file at an absolute path (read here, never written).

Spark (Delta 3.3) and delta-rs read DVs written here (checked in the tests). Everything is
blocking file I/O.
"""

from __future__ import annotations

import struct
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import unquote, urlparse

from ..storage.paths import Location

__all__ = [
    "DeletionVectorError",
    "DvWriter",
    "decode",
    "descriptor_id",
    "encode",
    "file_of",
    "read",
    "z85decode",
    "z85encode",
]

#: Leads every serialized DV: "the following bytes are a 64-bit portable Roaring bitmap".
MAGIC: Final = 1681511377
_FORMAT_VERSION: Final = 1
_Z85: Final = (
    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
_Z85_VALUE: Final = {c: i for i, c in enumerate(_Z85)}
#: Characters of a UUID in Z85 (16 bytes): a "u" descriptor's path ends with them.
_UUID_CHARS: Final = 20


class DeletionVectorError(Exception):
    """A deletion vector that cannot be read: missing file, bad checksum, unknown format."""


def z85encode(data: bytes) -> str:
    """ZeroMQ's Base85 (Z85) of ``data``, whose length must be a multiple of four."""
    if len(data) % 4:
        raise ValueError(f"Z85 encodes multiples of 4 bytes, got {len(data)}")
    out = bytearray()
    for (word,) in struct.iter_unpack(">I", data):
        chunk = bytearray(5)
        for i in range(4, -1, -1):
            word, chunk[i] = divmod(word, 85)
        out += bytes(_Z85[c] for c in chunk)
    return out.decode("ascii")


def z85decode(text: str) -> bytes:
    """The bytes of a Z85 string (its length a multiple of five)."""
    raw = text.encode("ascii")
    if len(raw) % 5:
        raise ValueError(f"Z85 text comes in groups of 5 characters, got {len(raw)}")
    out = bytearray()
    try:
        for i in range(0, len(raw), 5):
            word = 0
            for c in raw[i : i + 5]:
                word = word * 85 + _Z85_VALUE[c]
            out += struct.pack(">I", word)
    except (KeyError, struct.error) as exc:
        raise ValueError(f"not Z85: {text[:40]!r}") from exc
    return bytes(out)


def encode(rows: Any) -> bytes:
    """The serialized DV (magic number and bitmap) of ``rows``, a ``BitMap64``."""
    return struct.pack("<I", MAGIC) + bytes(rows.serialize())


def decode(data: bytes) -> Any:
    """The ``BitMap64`` of a serialized DV."""
    from pyroaring import BitMap64

    if len(data) < 4 or struct.unpack_from("<I", data)[0] != MAGIC:
        raise DeletionVectorError("not a deletion vector (wrong magic number)")
    try:
        return BitMap64.deserialize(data[4:])
    except (ValueError, OverflowError) as exc:
        raise DeletionVectorError(f"unreadable deletion vector bitmap: {exc}") from exc


def descriptor_id(descriptor: dict[str, Any]) -> str:
    """The vector's unique id, as the protocol defines it (storage type, path or inline data,
    and offset)."""
    offset = descriptor.get("offset")
    base = f"{descriptor.get('storageType')}{descriptor.get('pathOrInlineDv')}"
    return base if offset is None else f"{base}@{offset}"


def file_of(table: Location, descriptor: dict[str, Any]) -> Location | None:
    """The file holding the vector a descriptor of the table at ``table`` names (None for an
    inline vector)."""
    kind = descriptor.get("storageType")
    where = str(descriptor.get("pathOrInlineDv", ""))
    if kind == "i":
        return None
    if kind == "u":
        prefix, code = where[:-_UUID_CHARS], where[-_UUID_CHARS:]
        name = f"deletion_vector_{uuid.UUID(bytes=z85decode(code))}.bin"
        return table / prefix / name if prefix else table / name
    if kind == "p":
        parsed = urlparse(where)
        return Path(unquote(parsed.path)) if parsed.scheme in ("", "file") else Path(where)
    raise DeletionVectorError(f"deletion vector storage type {kind!r} is not supported")


def read(table: Location, descriptor: dict[str, Any]) -> Any:
    """The rows (``BitMap64``) a descriptor from the log of the table at ``table`` deletes."""
    size = int(descriptor.get("sizeInBytes", 0))
    file = file_of(table, descriptor)
    if file is None:
        return decode(z85decode(str(descriptor.get("pathOrInlineDv", "")))[:size])
    offset = int(descriptor.get("offset") or 1)
    try:
        with file.open("rb") as fh:
            fh.seek(offset)
            header = fh.read(4)
            data = fh.read(size)
            checksum = fh.read(4)
    except OSError as exc:
        raise DeletionVectorError(f"cannot read deletion vector {file}: {exc}") from exc
    if len(header) < 4 or struct.unpack(">i", header)[0] != size or len(checksum) < 4:
        raise DeletionVectorError(f"deletion vector {file} at {offset}: size does not match")
    if zlib.crc32(data) != struct.unpack(">I", checksum)[0]:
        raise DeletionVectorError(f"deletion vector {file} at {offset}: checksum mismatch")
    return decode(data)


@dataclass
class DvWriter:
    """The DVs of one commit, written as one ``"u"`` file at the table's root.

    :meth:`add` returns each DV's descriptor; :meth:`write` writes the file (call it before
    committing the descriptors, and only if :meth:`add` was called).
    """

    table: Location
    _id: uuid.UUID = field(default_factory=uuid.uuid4)
    _chunks: list[bytes] = field(default_factory=lambda: [bytes([_FORMAT_VERSION])])
    _offset: int = 1

    @property
    def file(self) -> Location:
        return self.table / f"deletion_vector_{self._id}.bin"

    def add(self, rows: Any) -> dict[str, Any]:
        data = encode(rows)
        descriptor = {
            "storageType": "u",
            "pathOrInlineDv": z85encode(self._id.bytes),
            "offset": self._offset,
            "sizeInBytes": len(data),
            "cardinality": len(rows),
        }
        self._chunks += [struct.pack(">i", len(data)), data, struct.pack(">I", zlib.crc32(data))]
        self._offset += len(data) + 8
        return descriptor

    def write(self) -> None:
        with self.file.open("xb") as fh:
            fh.write(b"".join(self._chunks))
