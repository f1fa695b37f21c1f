"""Stable partitioning shared by client and server.

A key is mapped to one of a fixed number of partitions by the CRC-32 of its msgpack encoding
(never Python's salted ``hash()``), so every process, language and restart agrees. CRC-32 is
not a cryptographic hash, and need not be: it spreads keys evenly over partitions (checked for
sequential ints, strings and composite keys in tests/test_partitioning.py) and is cheap
enough to compute for every item. For an Arrow column of integers (Arrow sources, the node's
bucket column) the same CRC-32 runs vectorised over the values' msgpack bytes (numpy), without
a Python object per row.
Partitions are assigned to live nodes by rendezvous (highest random weight) hashing with
bounded loads: nodes own equal shares, and when a node joins or leaves the partitions it wins
or held move, and only a few others.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import threading
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

import msgpack

__all__ = [
    "DEFAULT_PARTITIONS",
    "PartitionMap",
    "assign_partitions",
    "partition_many",
    "partition_of",
    "partition_table",
]

DEFAULT_PARTITIONS: Final = 64


class _Packer(threading.local):
    """One msgpack ``Packer`` per thread: a packer is not safe to share between threads (the
    node computes bucket columns on worker threads while clients route on the loop)."""

    def __init__(self) -> None:
        self.pack = msgpack.Packer(use_bin_type=True, datetime=True, autoreset=True).pack


_key_packer = _Packer()


def _digest64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def partition_of(key: Any, partitions: int) -> int:
    """The partition of ``key``: stable across processes and runs.

    Tuples and lists hash alike (composite keys). Raises TypeError for keys msgpack cannot encode.
    """
    return zlib.crc32(_key_packer.pack(key)) % partitions


def partition_many(keys: Iterable[Any], partitions: int) -> list[int]:
    """``partition_of`` of every key, in one pass (the client's per-chunk fast path)."""
    pack, crc = _key_packer.pack, zlib.crc32
    return [crc(pack(key)) % partitions for key in keys]


def _routable(value: Any) -> Any:
    # Arrow gives back types msgpack cannot pack (date, Decimal, time ...); any stable
    # encoding will do for those, the client cannot have routed by them anyway.
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, datetime.datetime) and value.tzinfo is not None:
        return value
    return str(value)


def partition_table(table: Any, key: Sequence[str], partitions: int) -> Any:
    """``partition_of`` the key of each row of the Arrow ``table`` (an int32 array): the
    client routes Arrow rows by it, and the node computes a table's bucket column with it.

    Computed from the key as stored (after conversion to the column's type), so one key always
    gets one bucket whatever the client sent; for keys sent with the column's own type this is
    the partition the client routed the row by.
    """
    import pyarrow as pa

    if len(key) == 1:
        column = table.column(key[0])
        if column.null_count == 0 and _vector_ints(column.type):
            values = column.to_numpy().astype("int64", copy=False)
            return pa.array(_int_partitions(values, partitions), type=pa.int32())
    # Columns whose Python values msgpack packs as they are need no per-value conversion.
    plain = all(_is_plain(table.schema.field(k).type) for k in key)
    columns = [_python_values(table.column(k)) for k in key]
    if len(columns) == 1:
        keys: Iterable[Any] = columns[0] if plain else map(_routable, columns[0])
    elif plain:
        keys = zip(*columns, strict=True)
    else:
        keys = (tuple(map(_routable, row)) for row in zip(*columns, strict=True))
    return pa.array(partition_many(keys, partitions), type=pa.int32())


def _python_values(column: Any) -> list[Any]:
    """The values of an Arrow column as Python objects. Through numpy for the plain types
    without nulls (strings, floats, booleans, binaries): a tenth of ``to_pylist``'s cost."""
    values: list[Any] = (
        column.to_numpy(zero_copy_only=False).tolist()
        if column.null_count == 0 and _is_plain(column.type)
        else column.to_pylist()
    )
    return values


def _vector_ints(arrow_type: Any) -> bool:
    """Integer types whose every value fits int64 (uint64 may not)."""
    import pyarrow as pa

    return bool(pa.types.is_integer(arrow_type) and not pa.types.is_uint64(arrow_type))


#: msgpack's encodings of an int: (lowest, highest, format byte or None, payload bytes).
_INT_FORMATS: Final = (
    (0, 127, None, 1),  # positive fixint
    (-32, -1, None, 1),  # negative fixint
    (128, 255, 0xCC, 1),
    (256, 2**16 - 1, 0xCD, 2),
    (2**16, 2**32 - 1, 0xCE, 4),
    (2**32, 2**63 - 1, 0xCF, 8),
    (-128, -33, 0xD0, 1),
    (-(2**15), -129, 0xD1, 2),
    (-(2**31), -(2**15) - 1, 0xD2, 4),
    (-(2**63), -(2**31) - 1, 0xD3, 8),
)


@functools.cache
def _crc_table() -> Any:
    """zlib's CRC-32 lookup table (reflected polynomial 0xEDB88320), as numpy uint32."""
    import numpy as np

    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0xEDB88320), table >> 1)
    return table.astype(np.uint32)


def _int_partitions(values: Any, partitions: int) -> Any:
    """``partition_of`` every int64 of the numpy array ``values``, vectorised: the CRC-32
    (zlib's) of each value's msgpack bytes, computed byte column by byte column for the values
    of one encoding at a time. Equal to ``partition_many`` (tests/test_arrow.py)."""
    import numpy as np

    table = _crc_table()
    out = np.empty(len(values), dtype=np.int32)
    big_endian = values.astype(">i8").view(np.uint8).reshape(-1, 8)
    for low, high, fmt, size in _INT_FORMATS:
        rows = np.flatnonzero((values >= low) & (values <= high))
        if not len(rows):
            continue
        crc = np.full(len(rows), 0xFFFFFFFF, dtype=np.uint32)
        if fmt is not None:
            crc = table[(crc ^ np.uint32(fmt)) & 0xFF] ^ (crc >> 8)
        payload = big_endian[rows, 8 - size :]
        for j in range(size):
            crc = table[(crc ^ payload[:, j]) & 0xFF] ^ (crc >> 8)
        out[rows] = (crc ^ np.uint32(0xFFFFFFFF)) % partitions
    return out


def _is_plain(arrow_type: Any) -> bool:
    """Whether Arrow gives values of this type back as bool, int, float, str or bytes."""
    import pyarrow as pa

    t = pa.types
    return bool(
        t.is_boolean(arrow_type)
        or t.is_integer(arrow_type)
        or t.is_floating(arrow_type)
        or t.is_string(arrow_type)
        or t.is_large_string(arrow_type)
        or t.is_binary(arrow_type)
        or t.is_large_binary(arrow_type)
    )


def assign_partitions(node_ids: Iterable[str], partitions: int) -> list[str]:
    """Owner of each partition among ``node_ids``: rendezvous hashing with bounded loads.

    Every (partition, node) pair has a weight, ``BLAKE2b-64("node\\0partition")``. Pairs are
    taken heaviest first, and a partition goes to the first node whose pair comes up while
    the node owns fewer than ``ceil(partitions / nodes)``. Nodes thus own equal shares (within
    one partition; plain rendezvous hashing gave two nodes 25 and 39 of 64), every node with
    the same live set computes the same owners, and when a node leaves its partitions spread
    over the others while only a few more move (a node that was full may now take a partition
    it weighs most).
    """
    nodes = sorted(set(node_ids))
    if not nodes:
        raise ValueError("cannot assign partitions to an empty set of nodes")
    share = -(-partitions // len(nodes))
    pairs = sorted(
        ((_digest64(f"{n}\x00{p}".encode()), p, n) for p in range(partitions) for n in nodes),
        reverse=True,
    )
    owners: list[str | None] = [None] * partitions
    owned = dict.fromkeys(nodes, 0)
    for _, p, n in pairs:
        if owners[p] is None and owned[n] < share:
            owners[p] = n
            owned[n] += 1
    # Every partition has an owner: the shares add up to at least ``partitions``.
    return cast("list[str]", owners)


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionMap:
    """Which node owns which partition, and where each node listens.

    Attributes:
        version: grows whenever membership changes; a client keeps the newest map it saw.
        owners: node id owning each partition (index = partition number).
        addresses: ``host:port`` of every live node by id.
    """

    version: int
    owners: tuple[str, ...]
    addresses: Mapping[str, str] = field(default_factory=dict)

    @property
    def partitions(self) -> int:
        return len(self.owners)

    def owner_address(self, partition: int) -> str:
        return self.addresses[self.owners[partition]]

    def committer(self, table: str) -> str:
        """The node that commits ``table``: the live node whose pair with the table's name
        weighs most (rendezvous hashing, as partitions are owned: every node with this map
        agrees, and a node leaving moves only the tables it committed)."""
        return max(sorted(self.addresses), key=lambda n: _digest64(f"{n}\x00{table}".encode()))

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "owners": list(self.owners), "nodes": dict(self.addresses)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> PartitionMap:
        try:
            owners = tuple(str(o) for o in data["owners"])
            nodes = {str(k): str(v) for k, v in dict(data["nodes"]).items()}
            version = int(data["version"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed partition map: {exc}") from exc
        if not owners or any(o not in nodes for o in owners):
            raise ValueError("malformed partition map: an owner has no address")
        return cls(version=version, owners=owners, addresses=nodes)

    @classmethod
    def build(cls, version: int, addresses: Mapping[str, str], partitions: int) -> PartitionMap:
        return cls(
            version=version,
            owners=tuple(assign_partitions(addresses, partitions)),
            addresses=dict(addresses),
        )
