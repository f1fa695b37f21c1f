"""Per-partition buffers that cut items into batches by count, bytes and time.

All methods are synchronous (atomic on the event loop); the flush timer only *cuts* a batch and
hands it to a callback, it never does I/O itself.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, overload

from ..columnar import ArrowRows, byte_offsets
from ..errors import UsageError
from ..protocol import pack_items

__all__ = ["Accumulator", "Batch", "BatchCreator", "SizeBatchCreator"]


@dataclass(slots=True)
class Batch:
    """A cut batch of one partition.

    Attributes:
        partition: the partition number.
        seq: sequence number within (stream, partition), from 0, assigned at cut time.
        items: the source items as the caller passed them (used to report failures).
        positions: each item's index in the source (to report failures in source order).
        packed: each item's msgpack encoding (what goes on the wire).
        deletes: indexes (into ``items``) of items marked as deletes.
        nbytes: sum of ``len(packed)``.
        attempts: sends so far.
        failures: after the ack, the items the receiver marked failed: index -> reason.
        node: the node that acknowledged the batch.
        wire: an Arrow page's IPC encoding (``items`` is then :class:`ArrowRows` and
            ``packed`` is empty), made on first send.
        first_sent: ``time.monotonic()`` of its first send (0.0 before it).
        unrouted: a dead-letter batch of rows the client could not route (never sent to
            their table).
    """

    partition: int
    seq: int
    items: Sequence[Any] = field(default_factory=list)
    positions: Sequence[int] = field(default_factory=list)
    packed: list[bytes] = field(default_factory=list)
    deletes: list[int] = field(default_factory=list)
    nbytes: int = 0
    attempts: int = 0
    failures: dict[int, str] | None = None
    node: str | None = None
    wire: bytes | None = None
    first_sent: float = 0.0
    unrouted: bool = False

    def packed_items(self) -> list[bytes]:
        """Each item's msgpack encoding (an Arrow page's rows are packed on demand)."""
        return pack_items(self.items) if isinstance(self.items, ArrowRows) else self.packed

    def subset(self, indexes: Iterable[int]) -> Batch:
        """The batch's items at ``indexes`` (ascending), as a batch of the same lane."""
        picked = list(indexes)
        if isinstance(self.items, ArrowRows):
            rows = self.items.take(picked)
            part = Batch(
                self.partition,
                self.seq,
                items=rows,
                positions=[self.positions[i] for i in picked],
                deletes=sorted(rows.deletes),
                attempts=self.attempts,
            )
            part.nbytes = int(rows.table.nbytes)
            return part
        at = {i: j for j, i in enumerate(picked)}
        part = Batch(
            self.partition,
            self.seq,
            items=[self.items[i] for i in picked],
            positions=[self.positions[i] for i in picked],
            packed=[self.packed[i] for i in picked],
            deletes=[at[i] for i in self.deletes if i in at],
            attempts=self.attempts,
        )
        part.nbytes = sum(len(x) for x in part.packed)
        return part


class BatchCreator(Protocol):
    """Decides where a partition's buffer is cut into batches (Flink FLIP-509's idea):
    ``StreamerOptions(batch_creator=...)``, any object with the two methods below.

    Batches of one partition keep the source order, so a creator decides only *when* to cut.
    The flush timer (``auto_flush_interval``) still cuts a buffer that waited long enough, and
    every item is still checked against ``max_batch_bytes``. The default is
    :class:`SizeBatchCreator`. A custom creator must keep its batches under the node's frame
    limit itself; subclass :class:`SizeBatchCreator` to keep its limits and add a cut. A
    creator applies to row items only, not to Arrow batches.
    """

    def cut_before(self, batch: Batch, item: Any, nbytes: int) -> bool:
        """Whether to send the non-empty ``batch`` before ``item`` (``nbytes`` packed) joins."""
        ...

    def cut_after(self, batch: Batch) -> bool:
        """Whether to send ``batch`` now that its latest item joined."""
        ...


@dataclass(frozen=True, slots=True)
class SizeBatchCreator:
    """The default: cut at ``page_size`` items, or before ``max_batch_bytes`` would be passed.

    Examples:
        Cut at the end of each upstream transaction too, keeping the size limits:

        ```python
        from deltaflow import StreamerOptions
        from deltaflow.client import Batch, SizeBatchCreator


        class EndOfTransaction(SizeBatchCreator):
            def cut_after(self, batch: Batch) -> bool:
                return batch.items[-1].get("commit", False) or super().cut_after(batch)


        options = StreamerOptions(
            batch_creator=EndOfTransaction(page_size=1000, max_batch_bytes=4 * 1024 * 1024)
        )
        ```
    """

    page_size: int
    max_batch_bytes: int

    def cut_before(self, batch: Batch, item: Any, nbytes: int) -> bool:
        return batch.nbytes + nbytes > self.max_batch_bytes

    def cut_after(self, batch: Batch) -> bool:
        return len(batch.items) >= self.page_size


class _Buffer:
    __slots__ = ("batch", "limit", "pages", "rows", "schema", "timer")

    def __init__(self, batch: Batch, limit: int = 0) -> None:
        self.batch = batch
        self.limit = limit  # rows at which the default creator cuts it
        self.timer: asyncio.TimerHandle | None = None
        self.pages: list[tuple[ArrowRows, Any]] | None = None  # Arrow rows, their positions
        self.schema: Any = None  # the schema the pages join into
        self.rows = 0


class Accumulator:
    """Buffers items per partition and cuts batches.

    Args:
        batch_creator: decides where buffers are cut (:class:`SizeBatchCreator` by default).
        flush_interval: seconds after a buffer's first item when it is cut anyway (0: never).
        on_cut: receives every batch cut by count, bytes, the creator or the timer.
        call_later: the clock (``loop.call_later``); injectable for tests.
        stagger: the stream's partition count: with the default creator, partition ``p``'s
            first page is cut at ``page_size * (p + 1) // stagger`` rows, later ones at
            ``page_size``, so evenly filled partitions send their pages spread out rather
            than all at once (``StreamerOptions.stagger_pages``); 0: every page at
            ``page_size``.
    """

    def __init__(
        self,
        *,
        batch_creator: BatchCreator,
        flush_interval: float,
        on_cut: Callable[[Batch], None],
        call_later: Callable[..., asyncio.TimerHandle],
        stagger: int = 0,
    ) -> None:
        self._creator = batch_creator
        self._stagger = stagger
        self._interval = flush_interval
        self._on_cut = on_cut
        self._call_later = call_later
        self._buffers: dict[int, _Buffer] = {}
        self._next_seq: dict[int, int] = {}
        # The default creator's rule, inlined in add(): it runs for every item.
        self._limits = (
            (batch_creator.page_size, batch_creator.max_batch_bytes)
            if type(batch_creator) is SizeBatchCreator
            else None
        )

    def __len__(self) -> int:
        """Items buffered and not yet cut."""
        return sum(len(b.batch.items) + b.rows for b in self._buffers.values())

    def add_rows(
        self, partition: int, rows: ArrowRows, positions: Any, offsets: Any = None
    ) -> None:
        """Buffer Arrow rows of one partition (``positions``: their source positions, an
        Arrow array); full pages go to ``on_cut``, split at ``page_size`` rows and before
        ``max_batch_bytes``.

        Args:
            offsets: the rows' :func:`~deltaflow.columnar.byte_offsets` (computed here when
                None; a caller routing many slices of one table computes them once).

        Raises:
            UsageError: the stream has a custom batch creator (it decides per item).
        """
        if self._limits is None:
            raise UsageError(
                "Arrow sources are cut into pages by page_size and max_batch_bytes; "
                "StreamerOptions.batch_creator applies to row items only"
            )
        if offsets is None:
            offsets = byte_offsets(rows.table)
        max_bytes = self._limits[1]
        buf = self._buffers.get(partition)
        if buf is not None and buf.pages:
            joined = _joined(buf.schema, rows.table.schema)
            if joined is None:
                # A page holds rows of one schema: the node converts each page to the table's.
                self._on_cut(self._cut(partition))
            else:
                buf.schema = joined
        offset, left = 0, len(rows)
        while left:
            buf = self._buffers.get(partition) or self._open(partition, pages=True)
            assert buf.pages is not None
            if buf.schema is None:
                buf.schema = rows.table.schema
            take = min(left, buf.limit - buf.rows)
            nbytes = int(offsets[offset + take] - offsets[offset])
            room = max_bytes - buf.batch.nbytes
            full = nbytes > room
            if full:
                # The rows that fit, so a page's rows depend on the partition's rows alone,
                # never on how the source's batches fell (a replay must cut the same pages).
                end = int(offsets.searchsorted(offsets[offset] + room, side="right"))
                take = min(take, end - 1 - offset)
                if take < 1:
                    if buf.rows:
                        self._on_cut(self._cut(partition))
                        continue
                    take = 1  # a row wider than a page goes alone
                nbytes = int(offsets[offset + take] - offsets[offset])
            buf.pages.append((rows.part(offset, take), positions.slice(offset, take)))
            buf.rows += take
            buf.batch.nbytes += nbytes
            offset += take
            left -= take
            if full or buf.rows >= buf.limit or buf.batch.nbytes >= max_bytes:
                self._on_cut(self._cut(partition))

    def add(self, partition: int, position: int, item: Any, packed: bytes, is_delete: bool) -> None:
        """Buffer one item; batches it completes go to ``on_cut`` (zero, one or two)."""
        nbytes = len(packed)
        limits = self._limits
        buf = self._buffers.get(partition)
        if buf is not None and (
            buf.batch.nbytes + nbytes > limits[1]
            if limits is not None
            else self._creator.cut_before(buf.batch, item, nbytes)
        ):
            self._on_cut(self._cut(partition))
            buf = None
        if buf is None:
            buf = self._open(partition)
        batch = buf.batch
        if is_delete:
            batch.deletes.append(len(batch.items))
        cast("list[Any]", batch.items).append(item)
        cast("list[int]", batch.positions).append(position)
        batch.packed.append(packed)
        batch.nbytes += nbytes
        if len(batch.items) >= buf.limit if limits is not None else self._creator.cut_after(batch):
            self._on_cut(self._cut(partition))

    def add_many(
        self,
        position: int,
        items: list[Any],
        partitions: list[int],
        packed: list[bytes],
        deletes: frozenset[int],
    ) -> None:
        """Buffer ``items`` (source positions from ``position`` on) as :meth:`add` would, one by
        one; the default creator's rule is inlined, as this runs for every item of a chunk."""
        if self._limits is None:
            for j, item in enumerate(items):
                self.add(partitions[j], position + j, item, packed[j], j in deletes)
            return
        # Per partition, in source order (a stable sort): each batch takes the run of items
        # that fits it, copied by C-level slices rather than item by item. A partition's
        # batches are the ones add() would cut; only the order of cuts across partitions
        # differs.
        limit_bytes = self._limits[1]
        order = sorted(range(len(items)), key=partitions.__getitem__)
        for partition, run in itertools.groupby(order, key=partitions.__getitem__):
            picked = list(run)
            data = list(map(packed.__getitem__, picked))
            sizes = list(itertools.accumulate(map(len, data)))
            done = 0
            while done < len(picked):
                before = sizes[done - 1] if done else 0
                buf = self._buffers.get(partition)
                if buf is None or buf.batch.nbytes + sizes[done] - before > limit_bytes:
                    if buf is not None:
                        self._on_cut(self._cut(partition))
                    buf = self._open(partition)
                batch = buf.batch
                batch_items = cast("list[Any]", batch.items)
                room = limit_bytes - batch.nbytes + before
                end = min(
                    done + buf.limit - len(batch_items),
                    max(done + 1, bisect.bisect_right(sizes, room, done)),
                )
                taken = picked[done:end]
                if deletes:
                    first = len(batch_items) - done
                    batch.deletes.extend(
                        first + bisect.bisect_left(picked, j, done, end)
                        for j in sorted(deletes.intersection(taken))
                    )
                batch_items.extend(map(items.__getitem__, taken))
                cast("list[int]", batch.positions).extend(map(position.__add__, taken))
                batch.packed.extend(data[done:end])
                batch.nbytes += sizes[end - 1] - before
                done = end
                if len(batch_items) >= buf.limit:
                    self._on_cut(self._cut(partition))

    def drain(self) -> list[Batch]:
        """Cut every non-empty buffer (end of stream or explicit flush)."""
        return [self._cut(p) for p in list(self._buffers)]

    def discard(self) -> list[tuple[Sequence[int], Sequence[Any]]]:
        """Drop every buffer; returns what they held (never sent), as (source positions,
        items) pairs: the Arrow rows of a page as they were buffered, never joined."""
        held: list[tuple[Sequence[int], Sequence[Any]]] = []
        for buf in self._buffers.values():
            if buf.timer is not None:
                buf.timer.cancel()
            if buf.pages is None:
                held.append((buf.batch.positions, buf.batch.items))
            else:
                held.extend((positions.to_pylist(), rows) for rows, positions in buf.pages)
        self._buffers.clear()
        return held

    def _open(self, partition: int, *, pages: bool = False) -> _Buffer:
        """A new, empty buffer for ``partition`` (its flush timer started)."""
        limit = 0
        if self._limits is not None:
            limit = self._limits[0]
            if self._stagger > 1 and partition not in self._next_seq:
                limit = max(1, limit * (partition % self._stagger + 1) // self._stagger)
        buf = self._buffers[partition] = _Buffer(Batch(partition, -1), limit)
        if pages:
            buf.pages = []
        if self._interval > 0:
            buf.timer = self._call_later(self._interval, self._timer_fired, partition)
        return buf

    def _timer_fired(self, partition: int) -> None:
        if partition in self._buffers:
            self._on_cut(self._cut(partition))

    def _cut(self, partition: int) -> Batch:
        buf = self._buffers.pop(partition)
        if buf.timer is not None:
            buf.timer.cancel()
        seq = self._next_seq.get(partition, 0)
        self._next_seq[partition] = seq + 1
        buf.batch.seq = seq
        if buf.pages is not None:
            _fill_page(buf.batch, buf.pages)
        return buf.batch


def _joined(page: Any, rows: Any) -> Any:
    """The schema of a page of schema ``page`` joined by rows of schema ``rows``: the same
    columns and types, or differing only where joining changes no value (a column missing, or
    all null, on one side); None if they differ otherwise."""
    import pyarrow as pa

    if page.equals(rows):
        return page
    try:
        return pa.unify_schemas([page, rows], promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None


def _fill_page(batch: Batch, pages: list[tuple[ArrowRows, Any]]) -> None:
    """Make ``batch`` the Arrow page of the buffered ``pages``."""
    rows = ArrowRows.concat([rows for rows, _ in pages])
    batch.items = rows
    batch.positions = _Positions([p for _, p in pages], len(rows))
    batch.deletes = sorted(rows.deletes)


class _Positions(Sequence[int]):
    """An Arrow page's source positions, made Python ints only when read (failures, dead
    letters, ``on_commit``): most pages never are, and converting costs per row."""

    __slots__ = ("_arrays", "_count", "_values")

    def __init__(self, arrays: list[Any], count: int) -> None:
        self._arrays = arrays
        self._count = count
        self._values: list[int] | None = None

    def _list(self) -> list[int]:
        if self._values is None:
            import pyarrow as pa

            self._values = pa.concat_arrays(self._arrays).to_pylist() if self._arrays else []
            self._arrays = []
        return self._values

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._list()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._list())
