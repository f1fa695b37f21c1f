"""Batch cutting by count, bytes and time, on an injected clock (no sleeps)."""

from __future__ import annotations

import itertools
from typing import Any

from deltaflow.client.accumulator import Accumulator, Batch, SizeBatchCreator


class FakeClock:
    """``call_later`` that fires only when the test advances time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[FakeTimer] = []

    def call_later(self, delay: float, fn: Any, *args: Any) -> FakeTimer:
        timer = FakeTimer(self.now + delay, fn, args)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for timer in [t for t in self.timers if t.when <= self.now and not t.cancelled]:
            timer.cancelled = True
            timer.fn(*timer.args)


class FakeTimer:
    def __init__(self, when: float, fn: Any, args: tuple[Any, ...]) -> None:
        self.when, self.fn, self.args, self.cancelled = when, fn, args, False

    def cancel(self) -> None:
        self.cancelled = True


def make(page_size: int = 3, max_bytes: int = 1000, interval: float = 5.0):
    clock = FakeClock()
    cuts: list[Batch] = []
    acc = Accumulator(
        batch_creator=SizeBatchCreator(page_size, max_bytes),
        flush_interval=interval,
        on_cut=cuts.append,
        call_later=clock.call_later,
    )
    return acc, clock, cuts


def test_cuts_on_count_with_per_partition_sequence_numbers() -> None:
    acc, _, cut = make(page_size=2)
    for i in range(5):
        acc.add(i % 2, i, f"item{i}", b"xx", is_delete=False)
    assert [(b.partition, b.seq, b.items) for b in cut] == [
        (0, 0, ["item0", "item2"]),
        (1, 0, ["item1", "item3"]),
    ]
    assert len(acc) == 1
    assert [(b.partition, b.seq, b.items) for b in acc.drain()] == [(0, 1, ["item4"])]
    assert len(acc) == 0


def test_cuts_before_exceeding_bytes() -> None:
    acc, _, cuts = make(page_size=100, max_bytes=10)
    acc.add(0, 0, "a", b"123456", is_delete=False)
    assert cuts == []
    acc.add(0, 1, "b", b"123456", is_delete=False)
    [batch] = cuts
    assert batch.items == ["a"] and batch.nbytes == 6
    assert len(acc) == 1


def test_timer_cuts_a_partly_filled_buffer_and_is_cancelled_by_a_count_cut() -> None:
    acc, clock, timed = make(page_size=2, interval=5.0)
    acc.add(0, 0, "a", b"x", is_delete=False)
    clock.advance(4.9)
    assert timed == []
    clock.advance(0.2)
    assert [b.items for b in timed] == [["a"]]
    acc.add(1, 1, "b", b"x", is_delete=False)
    acc.add(1, 2, "c", b"x", is_delete=False)  # count cut cancels partition 1's timer
    clock.advance(10)
    assert [b.items for b in timed] == [["a"], ["b", "c"]]  # no second, timed cut of it


def test_deletes_and_positions_are_tracked() -> None:
    acc, _, cuts = make(page_size=3)
    acc.add(7, 10, "u", b"x", is_delete=False)
    acc.add(7, 11, "d", b"x", is_delete=True)
    acc.add(7, 12, "u2", b"x", is_delete=False)
    [batch] = cuts
    assert batch.deletes == [1]
    assert batch.positions == [10, 11, 12]


def test_a_custom_batch_creator_cuts_at_transaction_boundaries() -> None:
    class EndOfTransaction(SizeBatchCreator):
        def cut_after(self, batch: Batch) -> bool:
            return batch.items[-1].get("commit", False) or super().cut_after(batch)

    clock = FakeClock()
    cut: list[Batch] = []
    acc = Accumulator(
        batch_creator=EndOfTransaction(100, 1 << 20),
        flush_interval=0,
        on_cut=cut.append,
        call_later=clock.call_later,
    )
    for i, item in enumerate([{"n": 1}, {"n": 2, "commit": True}, {"n": 3}]):
        acc.add(0, i, item, b"x", is_delete=False)
    assert [[i["n"] for i in b.items] for b in cut] == [[1, 2]]


def test_add_many_cuts_exactly_like_adding_one_by_one() -> None:
    import random

    rng = random.Random(7)
    one_acc, _, one = make(page_size=7, max_bytes=40, interval=0)
    many_acc, _, many = make(page_size=7, max_bytes=40, interval=0)
    position = 0
    for _ in range(60):  # chunks of varied size over 5 partitions, items of 1 to 9 bytes
        size = rng.randint(1, 40)
        items = [f"i{position + j}" for j in range(size)]
        parts = [rng.randrange(5) for _ in range(size)]
        packed = [b"x" * rng.randint(1, 9) for _ in range(size)]
        for j in range(size):
            one_acc.add(parts[j], position + j, items[j], packed[j], is_delete=False)
        many_acc.add_many(position, items, parts, packed, frozenset())
        position += size
    one += one_acc.drain()
    many += many_acc.drain()

    def lanes(batches: list[Batch]) -> dict[int, list[tuple[int, list[Any], list[int], int]]]:
        out: dict[int, list[tuple[int, list[Any], list[int], int]]] = {}
        for b in batches:
            out.setdefault(b.partition, []).append((b.seq, b.items, b.positions, b.nbytes))
        return out

    assert lanes(many) == lanes(one)  # per partition: same cuts, sequence, items and positions


def test_evenly_filled_partitions_send_their_pages_spread_out_not_in_one_burst() -> None:
    """Keys hashed evenly fill every partition at one pace: with pages all cut at page_size,
    every partition's page would fall due within the same few items, so the window would get
    a burst and then nothing (the nodes idle in turns). First pages are staggered instead."""
    partitions, page = 8, 40
    clock = FakeClock()
    cuts: list[tuple[int, Batch]] = []  # (items added so far, batch)
    added = 0
    acc = Accumulator(
        batch_creator=SizeBatchCreator(page, 1 << 20),
        flush_interval=0,
        on_cut=lambda b: cuts.append((added, b)),
        call_later=clock.call_later,
        stagger=partitions,
    )
    for i in range(partitions * page * 4):  # round robin: the most even stream there is
        added = i + 1
        acc.add(i % partitions, i, i, b"x", is_delete=False)
    # From then on pages leave evenly: one every `page` items, never several at once.
    steady = [at for at, b in cuts if at > partitions * page]
    gaps = [b - a for a, b in itertools.pairwise(steady)]
    assert gaps and min(gaps) >= page // 2, gaps
    firsts = {b.partition: len(b.items) for _, b in cuts if b.seq == 0}
    assert firsts == {p: page * (p + 1) // partitions for p in range(partitions)}
    assert all(len(b.items) == page for _, b in cuts if b.seq > 0)


def test_arrow_pages_are_staggered_like_row_pages() -> None:
    import pyarrow as pa

    from deltaflow.columnar import ArrowRows

    partitions, page = 4, 10
    clock = FakeClock()
    cuts: list[Batch] = []
    acc = Accumulator(
        batch_creator=SizeBatchCreator(page, 1 << 20),
        flush_interval=0,
        on_cut=cuts.append,
        call_later=clock.call_later,
        stagger=partitions,
    )
    for p in range(partitions):
        rows = ArrowRows.of(pa.table({"id": list(range(25))}))
        acc.add_rows(p, rows, pa.array(range(25), pa.int64()))
    assert [(b.partition, len(b.items)) for b in cuts] == [
        (0, 2),
        (0, 10),
        (0, 10),
        (1, 5),
        (1, 10),
        (1, 10),
        (2, 7),
        (2, 10),
        (3, 10),
        (3, 10),
    ]
