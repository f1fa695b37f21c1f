"""Admission: key, partition and pack the items pulled from the source, and buffer them.

Runs synchronously on the loop, once per chunk the source yields. An item that cannot be sent
is recorded failed in the ledger at its source position and raised; the items after it in the
chunk go back to the source's leftovers.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from ..columnar import ArrowRows, byte_offsets, is_arrow
from ..errors import FrameTooLargeError, UsageError
from ..partitioning import partition_many, partition_of, partition_table
from ..protocol import pack_item, pack_items
from .accumulator import Accumulator
from .ledger import Ledger
from .sources import ChunkedIterator
from .stream_types import Delete, KeyFn, spread

__all__ = ["Admission", "Quarantine"]

#: Takes rows the client cannot route: source positions, items, packed items, whether each
#: is a delete, and why.
Quarantine = Callable[[list[int], list[Any], list[bytes], list[bool], list[str]], None]
#: Rows without their key quarantined before any row of the stream could be routed, at most:
#: past that, the key is likely misnamed, and the stream fails rather than set all aside.
KEYLESS_LIMIT: Final = 1_000


class _MissingKey(UsageError):
    """An Arrow batch lacks a key column."""


class Admission:
    """Takes the items of one stream into its partition buffers, giving each its source
    position.

    Args:
        key: the routing key of a row item.
        key_columns: the key's column names (how Arrow rows are routed), if it names columns.
        partitions: the cluster's partition count.
        max_batch_bytes: the largest packed item a batch may hold.
        accumulator: the stream's partition buffers.
        ledger: where items that cannot be sent are recorded.
        quarantine: under ``on_bad_row="quarantine"``, where rows whose key cannot be read
            go (source positions, items, packed items, delete flags, the reason) instead of
            failing the stream.

    Attributes:
        pulled: items taken from the source so far (the next item's source position).
        columnar: whether the stream carries Arrow batches (None until its first item).
    """

    def __init__(
        self,
        *,
        key: KeyFn,
        key_columns: Sequence[str] | None,
        partitions: int,
        max_batch_bytes: int,
        accumulator: Accumulator,
        ledger: Ledger,
        quarantine: Quarantine | None = None,
    ) -> None:
        self.key = key
        self.quarantine = quarantine
        self.key_columns = list(key_columns) if key_columns is not None else None
        self.partitions = partitions
        self.max_batch_bytes = max_batch_bytes
        self.accumulator = accumulator
        self.ledger = ledger
        self.pulled = 0
        self.routed = 0  # items (rows) buffered for their partition
        self.keyless = 0  # rows quarantined because their key could not be read
        self._keyless_rows: list[tuple[int, Any, bytes, bool, str]] = []
        self.columnar: bool | None = None  # Arrow pages or row items; the first item decides

    def leftovers(self, items: list[Any]) -> None:
        """Record items taken from the source and never sent as not applied."""
        self.ledger.fail(range(self.pulled, self.pulled + len(items)), items)
        self.pulled += len(items)

    def admit(self, taken: list[Any], chunked: ChunkedIterator | None) -> None:
        """Key, partition, pack and buffer items just taken from the source (synchronous).

        Raises:
            UsageError: an item cannot be sent; it is reported failed, the items before it are
                buffered, and those after it go back to the source's leftovers.
            FrameTooLargeError: an item alone is larger than ``max_batch_bytes``.
        """
        if self.columnar is None and taken:
            self.columnar = is_arrow(type(taken[0]))
        if self.columnar:
            self._admit_arrow(taken, chunked)
            return
        try:
            while taken:  # a quarantined item leaves the rest of the chunk to admit
                taken = self._admit_rows(taken, chunked)
        finally:
            self._release_keyless()

    def _admit_rows(self, taken: list[Any], chunked: ChunkedIterator | None) -> list[Any]:
        """Admit row items (see :meth:`admit`); returns the items after one whose key could
        not be read and that was quarantined (``on_bad_row="quarantine"``), else []."""
        position = self.pulled
        values, deletes = taken, frozenset[int]()
        # The item types are few: no Python-level pass over the chunk unless it holds a Delete.
        if any(issubclass(t, Delete) for t in set(map(type, taken))):
            values = [x.item if isinstance(x, Delete) else x for x in taken]
            deletes = frozenset(j for j, x in enumerate(taken) if isinstance(x, Delete))
        key, partitions = self.key, self.partitions
        keyless = False  # the bad item's fault is its key, not its value
        try:
            if key is spread:  # appends: by a hash of the item's bytes
                packed = pack_items(values)
                parts = [zlib.crc32(data) % partitions for data in packed]
            else:
                parts = partition_many(map(key, values), partitions)
                packed = pack_items(values)
            bad, cause = None, None
        except Exception:  # noqa: BLE001 - find which item, below
            parts, packed, bad, cause = [], [], None, None
            for j, v in enumerate(values):
                try:
                    data = pack_item(v)
                except Exception as exc:  # noqa: BLE001 - reported below with the item
                    bad, cause = j, exc
                    break
                try:
                    parts.append(partition_of(key(v), partitions))
                except Exception as exc:  # noqa: BLE001 - reported below with the item
                    bad, cause, keyless = j, exc, True
                    packed.append(data)  # the dead letter's payload
                    break
                packed.append(data)
        max_item = self.max_batch_bytes
        if max(map(len, packed), default=0) > max_item:
            big = next(j for j, data in enumerate(packed) if len(data) > max_item)
            if bad is None or big < bad:
                bad, cause, keyless = big, None, False
        good = len(taken) if bad is None else bad
        self.accumulator.add_many(
            position, taken[:good] if bad is not None else taken, parts, packed, deletes
        )
        self.pulled += good
        self.routed += good
        if bad is None:
            return []
        if keyless and self.quarantine is not None and not self._misnamed(1):
            # Held, to quarantine with the rest of its chunk's in one dead-letter batch.
            reason = self._keyless(values[bad], cause, position + bad)
            row = (self.pulled, taken[bad], packed[bad], bad in deletes, reason)
            self._keyless_rows.append(row)
            self.pulled += 1
            return taken[bad + 1 :]
        if chunked is not None:
            chunked.put_back(taken[bad + 1 :])  # never sent: accounted as leftovers
        if cause is None:
            error: Exception = FrameTooLargeError(
                f"source item #{position + bad} packs to {len(packed[bad])} bytes, more than "
                f"StreamerOptions.max_batch_bytes={max_item}; split it or raise the limit"
            )
        elif keyless and self.quarantine is not None:  # held so far, but too many: failed
            held, self._keyless_rows = self._keyless_rows, []
            self.ledger.fail([row[0] for row in held], [row[1] for row in held])
            error = UsageError(
                f"{self._keyless(values[bad], cause, position + bad)}; {self._misnamed_hint()}"
            )
        elif keyless:
            error = UsageError(
                f"{self._keyless(values[bad], cause, position + bad)}: give every row its key, "
                "or stream with StreamerOptions(on_bad_row='quarantine') to write such rows "
                "to the dead-letter table and go on"
            )
        elif is_arrow(type(values[bad])):
            error = UsageError(
                f"source item #{position + bad} is an Arrow batch in a stream of row items: "
                "a stream carries row items or Arrow batches, not both"
            )
        else:
            error = UsageError(
                f"source item #{position + bad} cannot be sent ({cause!r}); items must be "
                "msgpack values (dict, list, str, int, float, bool, None, bytes, datetime, "
                "date, Decimal)"
            )
        self.ledger.fail([self.pulled], [taken[bad]], [str(error)])
        self.pulled += 1
        raise error from cause

    def _misnamed(self, more: int) -> bool:
        """Whether quarantining ``more`` keyless rows would pass :data:`KEYLESS_LIMIT` while
        no row of the stream was routed yet."""
        return self.routed == 0 and self.keyless + len(self._keyless_rows) + more > KEYLESS_LIMIT

    def _misnamed_hint(self) -> str:
        return (
            f"the first {KEYLESS_LIMIT:,} rows of the stream all lack their key: is "
            f"key={self.key_columns or self.key!r} right?"
        )

    def _release_keyless(self) -> None:
        """Quarantine the keyless rows the chunk held."""
        held, self._keyless_rows = self._keyless_rows, []
        if held and self.quarantine is not None:
            self.keyless += len(held)
            positions, items, packed, deleted, reasons = (list(x) for x in zip(*held, strict=True))
            self.quarantine(positions, items, packed, deleted, reasons)

    def _keyless(self, value: Any, cause: BaseException | None, position: int) -> str:
        """What is wrong with the key of the item at source ``position``, in a phrase."""
        if self.key_columns is not None and isinstance(value, Mapping):
            missing = [c for c in self.key_columns if c not in value]
            if missing:
                names = ", ".join(map(repr, missing))
                has = ", ".join(map(str, list(value)[:10])) or "none"
                return f"source item #{position} has no key column {names} (its columns: {has})"
        return f"source item #{position}: its key cannot be read ({cause!r})"

    def _admit_arrow(self, taken: list[Any], chunked: ChunkedIterator | None) -> None:
        """Route the rows of Arrow items taken from the source by their key columns and buffer
        them as pages (synchronous). Items of one schema are routed as one table: a fast
        source's small batches then make a few long runs per partition rather than many short
        slices (the client's cost per row falls by a third from 10,000-row batches to 40,000).

        Raises:
            UsageError: an item that is not Arrow in an Arrow stream (or the other way round),
                a key that is not column names, or a missing or bad column; the item is
                reported failed and the items after it go back to the source's leftovers.
        """
        # (Appends send each batch to a partition of its own: those are not joined.)
        joined = _one_table(taken) if len(taken) > 1 and self.key_columns is not None else None
        if joined is not None:
            try:
                routed = self._route(joined)
            except Exception:  # noqa: BLE001 - one of them is bad: found item by item below
                routed = None
            if routed is not None:
                self._buffer(*routed)
                return
        for j, item in enumerate(taken):
            try:
                rows, parts = self._route(item)
            except _MissingKey as exc:
                if self._quarantine_batch(item, str(exc)):
                    continue
                error = UsageError(
                    f"source item #{self.pulled} cannot be sent: {exc}; "
                    + (
                        self._misnamed_hint()
                        if self.quarantine is not None
                        else "give every batch the key, or stream with StreamerOptions("
                        "on_bad_row='quarantine') to write such rows to the dead-letter table "
                        "and go on"
                    )
                )
                self.ledger.fail([self.pulled], [item], [str(error)])
                self.pulled += 1
                if chunked is not None:
                    chunked.put_back(taken[j + 1 :])
                raise error from exc
            except Exception as exc:
                error = UsageError(f"source item #{self.pulled} cannot be sent: {exc}")
                self.ledger.fail([self.pulled], [item], [str(error)])
                self.pulled += 1
                if chunked is not None:
                    chunked.put_back(taken[j + 1 :])
                raise error from exc
            self._buffer(rows, parts)

    def _route(self, item: Any) -> tuple[ArrowRows, Any]:
        """The rows of Arrow ``item`` and the partition of each.

        Raises:
            UsageError: (or Arrow's error) ``item`` cannot be routed.
        """
        import pyarrow as pa

        if not is_arrow(type(item)):
            raise UsageError(
                "a stream carries row items or Arrow batches, not both; this one "
                f"began with Arrow batches and then gave a {type(item).__name__}"
            )
        if self.key_columns is None and self.key is not spread:
            raise UsageError("Arrow batches are routed by key columns: pass key= as column names")
        rows = ArrowRows.of(item)
        if self.key_columns is None:  # appends: the batch to one partition
            return rows, pa.array([self.pulled % self.partitions] * len(rows), pa.int32())
        missing = [k for k in self.key_columns if k not in rows.table.column_names]
        if missing:
            columns = ", ".join(rows.table.column_names[:10]) or "none"
            raise _MissingKey(f"it lacks the key column(s) {missing} (its columns: {columns})")
        return rows, partition_table(rows.table, self.key_columns, self.partitions)

    def _quarantine_batch(self, item: Any, reason: str) -> bool:
        """Quarantine every row of the Arrow batch ``item`` (which cannot be routed); False
        when the stream does not quarantine or a row cannot be packed."""
        if self.quarantine is None:
            return False
        rows = ArrowRows.of(item)
        if self._misnamed(len(rows)):
            return False  # the key is likely misnamed: the stream fails, naming it
        try:
            dicts = list(rows)
            packed = pack_items(dicts)
        except Exception:  # noqa: BLE001 - then the batch fails the stream, as without
            return False
        first = self.pulled
        deletes = rows.deletes
        why = f"source item #{first} (an Arrow batch of {len(dicts)} rows): {reason}"
        self.keyless += len(dicts)
        if dicts:
            self.quarantine(
                list(range(first, first + len(dicts))),
                dicts,
                packed,
                [j in deletes for j in range(len(dicts))],
                [why] * len(dicts),
            )
        self.pulled += len(dicts)
        return True

    def _buffer(self, rows: ArrowRows, parts: Any) -> None:
        """Buffer ``rows`` (the next source positions) by partition ``parts``."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if not len(rows):
            return
        # One stable sort by partition, then a zero-copy slice per partition.
        order = pc.sort_indices(parts)
        runs = pc.run_end_encode(parts.take(order))
        rows = rows.take(order)
        positions = pc.add(order.cast(pa.int64()), self.pulled)
        offsets = byte_offsets(rows.table)
        start = 0
        for end, partition in zip(runs.run_ends.to_pylist(), runs.values.to_pylist(), strict=True):
            length = end - start
            self.accumulator.add_rows(
                partition,
                rows.part(start, length),
                positions.slice(start, length),
                offsets[start : end + 1],
            )
            start = end
        self.pulled += len(rows)
        self.routed += len(rows)


def _one_table(items: list[Any]) -> Any:
    """Arrow ``items`` of one schema as one table (zero-copy); None if they are not."""
    import pyarrow as pa

    if not all(is_arrow(type(item)) for item in items):
        return None
    schema = items[0].schema
    if not all(item.schema.equals(schema) for item in items):
        return None
    return pa.concat_tables(
        pa.Table.from_batches([x]) if isinstance(x, pa.RecordBatch) else x for x in items
    )
