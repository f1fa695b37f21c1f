"""Per-partition buffers that cut items into batches by count, bytes and time.

All methods are synchronous (atomic on the event loop); the flush timer only *cuts* a batch and
hands it to a callback, it never does I/O itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    """

    partition: int
    seq: int
    items: list[Any] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    packed: list[bytes] = field(default_factory=list)
    deletes: list[int] = field(default_factory=list)
    nbytes: int = 0
    attempts: int = 0
    failures: dict[int, str] | None = None
    node: str | None = None

    def subset(self, indexes: Iterable[int]) -> Batch:
        """The batch's items at ``indexes`` (ascending), as a batch of the same lane."""
        picked = list(indexes)
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
    """Decides where a partition's buffer is cut into batches (Flink FLIP-509's idea).

    Batches of one partition keep the source order, so a creator decides only *when* to cut.
    The flush timer (``auto_flush_interval``) still cuts a buffer that waited long enough.
    """

    def cut_before(self, batch: Batch, item: Any, nbytes: int) -> bool:
        """Whether to send the non-empty ``batch`` before ``item`` (``nbytes`` packed) joins."""
        ...

    def cut_after(self, batch: Batch) -> bool:
        """Whether to send ``batch`` now that its latest item joined."""
        ...


@dataclass(frozen=True, slots=True)
class SizeBatchCreator:
    """The default: cut at ``page_size`` items, or before ``max_batch_bytes`` would be passed."""

    page_size: int
    max_batch_bytes: int

    def cut_before(self, batch: Batch, item: Any, nbytes: int) -> bool:
        return batch.nbytes + nbytes > self.max_batch_bytes

    def cut_after(self, batch: Batch) -> bool:
        return len(batch.items) >= self.page_size


class _Buffer:
    __slots__ = ("batch", "timer")

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.timer: asyncio.TimerHandle | None = None


class Accumulator:
    """Buffers items per partition and cuts batches.

    Args:
        batch_creator: decides where buffers are cut (:class:`SizeBatchCreator` by default).
        flush_interval: seconds after a buffer's first item when it is cut anyway (0: never).
        on_cut: receives every batch cut by count, bytes, the creator or the timer.
        call_later: the clock (``loop.call_later``); injectable for tests.
    """

    def __init__(
        self,
        *,
        batch_creator: BatchCreator,
        flush_interval: float,
        on_cut: Callable[[Batch], None],
        call_later: Callable[..., asyncio.TimerHandle],
    ) -> None:
        self._creator = batch_creator
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
        return sum(len(b.batch.items) for b in self._buffers.values())

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
            buf = self._buffers[partition] = _Buffer(Batch(partition, -1))
            if self._interval > 0:
                buf.timer = self._call_later(self._interval, self._timer_fired, partition)
        batch = buf.batch
        if is_delete:
            batch.deletes.append(len(batch.items))
        batch.items.append(item)
        batch.positions.append(position)
        batch.packed.append(packed)
        batch.nbytes += nbytes
        if len(batch.items) >= limits[0] if limits is not None else self._creator.cut_after(batch):
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
        page_size, max_bytes = self._limits
        buffers, interval = self._buffers, self._interval
        for j, (item, partition, data) in enumerate(zip(items, partitions, packed, strict=False)):
            nbytes = len(data)
            buf = buffers.get(partition)
            if buf is None or buf.batch.nbytes + nbytes > max_bytes:
                if buf is not None:
                    self._on_cut(self._cut(partition))
                buf = buffers[partition] = _Buffer(Batch(partition, -1))
                if interval > 0:
                    buf.timer = self._call_later(interval, self._timer_fired, partition)
            batch = buf.batch
            batch_items = batch.items
            if deletes and j in deletes:
                batch.deletes.append(len(batch_items))
            batch_items.append(item)
            batch.positions.append(position + j)
            batch.packed.append(data)
            batch.nbytes += nbytes
            if len(batch_items) >= page_size:
                self._on_cut(self._cut(partition))

    def drain(self) -> list[Batch]:
        """Cut every non-empty buffer (end of stream or explicit flush)."""
        return [self._cut(p) for p in list(self._buffers)]

    def discard(self) -> list[Batch]:
        """Drop every buffer; returns what they held (never sent)."""
        return self.drain()

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
        return buf.batch
