"""Deletion vectors as the Delta protocol lays them out: Z85, the file format, its checks.
(Spark and delta-rs reading vectors written here: tests/test_merge_on_read.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyroaring import BitMap64

from deltaflow.tables.deletion_vectors import (
    DeletionVectorError,
    DvWriter,
    encode,
    read,
    z85decode,
    z85encode,
)


def test_z85_matches_the_reference_vector() -> None:
    raw = bytes([0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B])
    assert z85encode(raw) == "HelloWorld"
    assert z85decode("HelloWorld") == raw
    with pytest.raises(ValueError, match="multiples of 4"):
        z85encode(b"abc")


def test_vectors_of_one_commit_share_a_file_and_read_back(tmp_path: Path) -> None:
    writer = DvWriter(tmp_path)
    first = writer.add(BitMap64([0, 5, 70_000]))
    second = writer.add(BitMap64(range(1000)))
    writer.write()
    assert first["pathOrInlineDv"] == second["pathOrInlineDv"]
    assert (first["offset"], second["cardinality"]) == (1, 1000)
    assert list(read(tmp_path, first)) == [0, 5, 70_000]
    assert list(read(tmp_path, second)) == list(range(1000))
    data = encode(BitMap64([3]))  # inline: the same bytes, padded, in the descriptor
    inline = {
        "storageType": "i",
        "pathOrInlineDv": z85encode(data + b"\0" * (-len(data) % 4)),
        "sizeInBytes": len(data),
        "cardinality": 1,
    }
    assert list(read(tmp_path, inline)) == [3]


def test_a_damaged_vector_file_is_refused(tmp_path: Path) -> None:
    writer = DvWriter(tmp_path)
    descriptor = writer.add(BitMap64([1, 2, 3]))
    writer.write()
    raw = bytearray(writer.file.read_bytes())
    raw[-6] ^= 0xFF  # a byte of the bitmap
    writer.file.write_bytes(bytes(raw))
    with pytest.raises(DeletionVectorError, match="checksum"):
        read(tmp_path, descriptor)
    writer.file.unlink()
    with pytest.raises(DeletionVectorError, match="cannot read"):
        read(tmp_path, descriptor)
