"""Batch cutting by count, bytes and time, on an injected clock (no sleeps)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaflow.client.accumulator import Accumulator, Batch, SizeBatchCreator
from deltaflow.errors import UsageError
from deltaflow.protocol import unpack_items


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


def make(
    page_size: int = 3,
    max_bytes: int = 1000,
    interval: float = 5.0,
    *,
    creator: SizeBatchCreator | None = None,
    stagger: int = 0,
) -> tuple[Accumulator, FakeClock, list[Batch]]:
    """An accumulator on a fake clock that collects its cuts (``creator`` overrides sizes)."""
    clock = FakeClock()
    cuts: list[Batch] = []
    acc = Accumulator(
        batch_creator=creator or SizeBatchCreator(page_size, max_bytes),
        flush_interval=interval,
        on_cut=cuts.append,
        call_later=clock.call_later,
        stagger=stagger,
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

    acc, _, cut = make(interval=0, creator=EndOfTransaction(100, 1 << 20))
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
    acc, _, cuts = make(page, 1 << 20, interval=0, stagger=partitions)
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


def arrow_rows(ids: list[Any], **columns: list[Any]) -> Any:
    import pyarrow as pa

    from deltaflow.columnar import ArrowRows

    return ArrowRows.of(pa.table({"id": ids, **columns}))


def positions(start: int, count: int) -> Any:
    import pyarrow as pa

    return pa.array(range(start, start + count), pa.int64())


def offsets_of(sizes: list[int]) -> Any:
    """Byte offsets of rows of the given sizes (what ``byte_offsets`` computes from a table)."""
    import numpy as np

    return np.cumsum([0, *sizes]).astype(np.int64)


def page(batch: Batch) -> tuple[int, int, list[Any], list[int], int]:
    """A cut Arrow page as (partition, seq, ids, source positions, bytes)."""
    return (
        batch.partition,
        batch.seq,
        [r["id"] for r in batch.items],
        list(batch.positions),
        batch.nbytes,
    )


def test_arrow_rows_fill_pages_across_calls_up_to_page_size() -> None:
    acc, _, cuts = make(page_size=4, max_bytes=1 << 20, interval=0)
    acc.add_rows(0, arrow_rows([1, 2, 3]), positions(0, 3), offsets_of([1, 1, 1]))
    assert cuts == [] and len(acc) == 3
    acc.add_rows(0, arrow_rows([4, 5, 6, 7]), positions(3, 4), offsets_of([1] * 4))
    assert [page(b) for b in cuts] == [(0, 0, [1, 2, 3, 4], [0, 1, 2, 3], 4)]
    assert len(acc) == 3
    [last] = acc.drain()
    assert page(last) == (0, 1, [5, 6, 7], [4, 5, 6], 3)
    assert len(last.positions) == 3 and last.deletes == []
    assert len(acc) == 0


def test_arrow_pages_are_cut_before_max_batch_bytes_and_when_they_reach_it() -> None:
    acc, _, cuts = make(page_size=100, max_bytes=100, interval=0)
    acc.add_rows(0, arrow_rows([1]), positions(0, 1), offsets_of([50]))
    acc.add_rows(0, arrow_rows([2]), positions(1, 1), offsets_of([50]))
    # Exactly max_batch_bytes: fits, and the page is full.
    assert [page(b) for b in cuts] == [(0, 0, [1, 2], [0, 1], 100)]
    acc.add_rows(0, arrow_rows([3]), positions(2, 1), offsets_of([60]))
    acc.add_rows(0, arrow_rows([4, 5]), positions(3, 2), offsets_of([30, 20]))
    # As many rows as fit, as with row items: cut before the row that would pass it.
    assert [page(b) for b in cuts[1:]] == [(0, 1, [3, 4], [2, 3], 90)]
    assert [page(b) for b in acc.drain()] == [(0, 2, [5], [4], 20)]


@pytest.mark.parametrize(
    ("sizes", "pages"),
    [
        ([40, 60, 10], [[1, 2], [3]]),  # as many as fit (exactly), then the rest
        ([150, 10], [[1], [2]]),  # a row wider than max_batch_bytes goes alone
        ([60, 60], [[1], [2]]),
        ([30, 30, 30, 30], [[1, 2, 3], [4]]),
    ],
)
def test_wide_arrow_rows_are_split_into_pages_of_as_many_rows_as_fit(
    sizes: list[int], pages: list[list[int]]
) -> None:
    acc, _, cuts = make(page_size=100, max_bytes=100, interval=0)
    ids = list(range(1, len(sizes) + 1))
    acc.add_rows(0, arrow_rows(ids), positions(0, len(ids)), offsets_of(sizes))
    got = cuts + acc.drain()
    assert [[r["id"] for r in b.items] for b in got] == pages
    at = 0
    for b, ids_of_page in zip(got, pages, strict=True):
        assert b.nbytes == sum(sizes[at : at + len(ids_of_page)])
        at += len(ids_of_page)


def test_arrow_rows_join_a_page_only_where_joining_changes_no_value() -> None:
    import pyarrow as pa

    from deltaflow.columnar import ArrowRows

    acc, _, cuts = make(page_size=100, max_bytes=1 << 20, interval=0)
    acc.add_rows(0, arrow_rows([1]), positions(0, 1))
    acc.add_rows(0, arrow_rows([2]), positions(1, 1))  # the same schema
    acc.add_rows(0, arrow_rows([3], v=["x"]), positions(2, 1))  # one more column
    assert cuts == []
    other = ArrowRows.of(pa.table({"id": pa.array(["4"], pa.string())}))
    acc.add_rows(0, other, positions(3, 1))  # id changes type: a page of its own
    [joined] = cuts
    assert joined.items.table.to_pylist() == [
        {"id": 1, "v": None},
        {"id": 2, "v": None},
        {"id": 3, "v": "x"},
    ]
    [rest] = acc.drain()
    assert rest.items.table.to_pylist() == [{"id": "4"}] and list(rest.positions) == [3]
    # A page keeps the joined schema: rows fitting only the last rows' schema start a page.
    acc.add_rows(1, arrow_rows([5], v=["x"]), positions(4, 1))
    acc.add_rows(1, arrow_rows([6]), positions(5, 1))
    acc.add_rows(1, arrow_rows([7], v=[8]), positions(6, 1))
    assert [[r["id"] for r in b.items] for b in cuts[1:]] == [[5, 6]]
    assert [[r["id"] for r in b.items] for b in acc.drain()] == [[7]]


def test_deletes_of_an_arrow_page_are_its_rows_that_delete() -> None:
    import pyarrow as pa

    from deltaflow.columnar import DELETE_COLUMN, ArrowRows

    acc, _, cuts = make(page_size=3, max_bytes=1 << 20, interval=0)
    flags = ArrowRows.of(pa.table({"id": [1, 2], DELETE_COLUMN: [False, True]}))
    acc.add_rows(0, flags, positions(0, 2))
    acc.add_rows(
        0, ArrowRows.of(pa.table({"id": [3, 4], DELETE_COLUMN: [True, False]})), positions(2, 2)
    )
    assert cuts[0].deletes == [1, 2]
    packed = cuts[0].packed_items()
    assert [unpack_items(p, 1)[0] for p in packed] == [{"id": 1}, {"id": 2}, {"id": 3}]


def test_a_custom_batch_creator_takes_row_items_only() -> None:
    class EveryTwo(SizeBatchCreator):
        pass

    acc = Accumulator(
        batch_creator=EveryTwo(2, 100),
        flush_interval=0,
        on_cut=lambda b: None,
        call_later=FakeClock().call_later,
    )
    with pytest.raises(UsageError) as info:
        acc.add_rows(0, arrow_rows([1]), positions(0, 1))
    assert str(info.value) == (
        "Arrow sources are cut into pages by page_size and max_batch_bytes; "
        "StreamerOptions.batch_creator applies to row items only"
    )


def test_a_creator_derived_from_the_default_cuts_exactly_like_it() -> None:
    class Derived(SizeBatchCreator):
        pass

    def run(creator: SizeBatchCreator, many: bool) -> list[tuple[str, int, list[Any], int]]:
        acc, _, cuts = make(interval=0, creator=creator)
        sizes = [4, 6, 6, 1, 9, 5, 5, 3, 3, 3, 1]
        items = [f"i{j}" for j in range(len(sizes))]
        parts = [j % 2 for j in range(len(sizes))]
        packed = [b"x" * n for n in sizes]
        if many:
            acc.add_many(100, items, parts, packed, frozenset({4}))
        else:
            for j, item in enumerate(items):
                acc.add(parts[j], 100 + j, item, packed[j], j == 4)
        drained = acc.drain()
        return [("cut", b.partition, b.items, b.nbytes) for b in cuts] + [
            ("drained", b.partition, b.items, b.nbytes) for b in drained
        ]

    expected = [
        ("cut", 0, ["i0", "i2"], 10),  # exactly 10 bytes fit
        ("cut", 1, ["i1", "i3"], 7),  # i5 would pass 10 bytes
        ("cut", 0, ["i4"], 9),
        ("cut", 1, ["i5", "i7"], 8),
        ("cut", 0, ["i6", "i8", "i10"], 9),  # 3 items: a full page
        ("drained", 1, ["i9"], 3),
    ]
    assert run(SizeBatchCreator(3, 10), many=False) == expected
    assert run(Derived(3, 10), many=False) == expected
    assert run(Derived(3, 10), many=True) == expected

    # add_many cuts partition by partition: each partition's batches are add()'s, in order.
    def per_partition(cuts: list[tuple[str, int, list[Any], int]]) -> list[Any]:
        return sorted(cuts, key=lambda cut: (cut[0] == "drained", cut[1]))

    assert per_partition(run(SizeBatchCreator(3, 10), many=True)) == per_partition(expected)


def test_a_creator_decides_cuts_by_the_items_themselves() -> None:
    class StartOfTransaction(SizeBatchCreator):
        def cut_before(self, batch: Batch, item: Any, nbytes: int) -> bool:
            return item.get("begin", False) or super().cut_before(batch, item, nbytes)

    acc, _, cuts = make(interval=0, creator=StartOfTransaction(100, 1 << 20))
    items = [{"begin": True, "n": 1}, {"n": 2}, {"begin": True, "n": 3}, {"n": 4}]
    acc.add_many(0, items, [0] * 4, [b"x"] * 4, frozenset({3}))
    [first] = cuts
    assert [i["n"] for i in first.items] == [1, 2] and first.packed == [b"x", b"x"]
    [second] = acc.drain()
    assert [i["n"] for i in second.items] == [3, 4] and second.deletes == [1]
    assert list(second.positions) == [2, 3]


def test_add_many_marks_exactly_the_deletes_it_is_given() -> None:
    acc, _, cuts = make(page_size=3, interval=0)
    acc.add_many(
        10, ["a", "b", "c", "d"], [0, 0, 0, 1], [b"1", b"22", b"3", b"4"], frozenset({1, 3})
    )
    [full] = cuts
    assert (full.items, list(full.positions), full.deletes, full.packed) == (
        ["a", "b", "c"],
        [10, 11, 12],
        [1],
        [b"1", b"22", b"3"],
    )
    [other] = acc.drain()
    assert (other.items, other.deletes, other.nbytes) == (["d"], [0], 1)


def test_discard_hands_back_what_was_never_sent_and_stops_the_timers() -> None:
    acc, clock, cuts = make(page_size=10, interval=5.0)
    acc.add(0, 7, "a", b"x", is_delete=False)
    acc.add(0, 8, "b", b"x", is_delete=True)
    acc.add_rows(1, arrow_rows([1, 2]), positions(20, 2))
    acc.add_rows(1, arrow_rows([3]), positions(30, 1))
    held = acc.discard()
    assert [
        (list(p), [r if isinstance(r, str) else r["id"] for r in items]) for p, items in held
    ] == [
        ([7, 8], ["a", "b"]),
        ([20, 21], [1, 2]),
        ([30], [3]),
    ]
    assert len(acc) == 0 and acc.drain() == []
    acc.add(0, 9, "c", b"x", is_delete=False)  # a new buffer: its own timer only
    clock.advance(4)
    assert cuts == [], "a discarded buffer's timer cut a later one"
    clock.advance(1)
    assert [b.items for b in cuts] == [["c"]]
    assert acc.discard() == []
    untimed, _, _ = make(page_size=10, interval=0)
    untimed.add(0, 0, "a", b"x", is_delete=False)
    assert [list(items) for _, items in untimed.discard()] == [["a"]]


@pytest.mark.parametrize(("interval", "timers"), [(0, 0), (0.5, 1)])
def test_the_flush_timer_runs_only_for_a_positive_interval(interval: float, timers: int) -> None:
    acc, clock, cuts = make(page_size=10, interval=interval)
    acc.add(0, 0, "a", b"x", is_delete=False)
    assert len(clock.timers) == timers
    clock.advance(0.5)
    assert [b.items for b in cuts] == ([["a"]] if timers else [])


def test_first_pages_are_staggered_down_to_a_single_item() -> None:
    acc, _, cuts = make(4, 1 << 20, interval=0, stagger=8)
    for p in range(8):
        for i in range(4):
            acc.add(p, i, i, b"x", is_delete=False)
    firsts = {b.partition: len(b.items) for b in cuts if b.seq == 0}
    assert firsts == {0: 1, 1: 1, 2: 1, 3: 2, 4: 2, 5: 3, 6: 3, 7: 4}
    two, _, cuts = make(4, 1 << 20, interval=0, stagger=2)
    for i in range(4):
        two.add(0, i, i, b"x", is_delete=False)
    assert [len(b.items) for b in cuts] == [2], "two partitions are staggered too"


def test_part_of_a_batch_keeps_its_lane_and_the_deletes_of_its_items() -> None:
    batch = Batch(
        3,
        7,
        items=["a", "b", "c", "d"],
        positions=[10, 11, 12, 13],
        packed=[b"1", b"22", b"333", b"4444"],
        deletes=[0, 2, 3],
        nbytes=10,
        attempts=2,
    )
    part = batch.subset([1, 2])
    assert (part.partition, part.seq, part.attempts) == (3, 7, 2)
    assert (part.items, list(part.positions), part.packed, part.deletes, part.nbytes) == (
        ["b", "c"],
        [11, 12],
        [b"22", b"333"],
        [1],
        5,
    )
    assert part.packed_items() == [b"22", b"333"]


def test_part_of_an_arrow_page_keeps_its_lane_and_the_deletes_of_its_rows() -> None:
    import pyarrow as pa

    from deltaflow.columnar import DELETE_COLUMN, ArrowRows

    acc, _, cuts = make(page_size=4, interval=0)
    rows = ArrowRows.of(pa.table({"id": [1, 2, 3, 4], DELETE_COLUMN: [True, False, True, True]}))
    acc.add_rows(5, rows, positions(40, 4))
    [full] = cuts
    full.attempts = 3
    part = full.subset([0, 2])
    assert (part.partition, part.seq, part.attempts) == (5, 0, 3)
    assert [r["id"] for r in part.items] == [1, 3]
    assert (list(part.positions), part.deletes) == ([40, 42], [0, 1])
    assert part.nbytes == part.items.table.nbytes > 0
    assert [unpack_items(p, 1)[0] for p in part.packed_items()] == [{"id": 1}, {"id": 3}]


def test_arrow_batches_handed_over_together_make_the_pages_they_make_one_by_one() -> None:
    """Batches a fast source hands over at once are routed as one table: the same pages, rows
    and source positions as one batch at a time. A bad one among them is still named by its
    place in the source, with the batches before it buffered."""
    import pyarrow as pa

    from deltaflow.client.admission import Admission
    from deltaflow.client.ledger import Ledger

    batches = [
        pa.record_batch(
            {"id": pa.array(range(i * 50, i * 50 + 50), pa.int64()), "v": pa.array([i] * 50)}
        )
        for i in range(4)
    ]

    def admission(
        max_bytes: int = 1 << 20, partitions: int = 8
    ) -> tuple[Admission, Accumulator, list[Batch]]:
        acc, _, cuts = make(page_size=30, max_bytes=max_bytes, interval=0)
        routes = Admission(
            key=lambda row: row["id"],
            key_columns=["id"],
            partitions=partitions,
            max_batch_bytes=max_bytes,
            accumulator=acc,
            ledger=Ledger(),
        )
        return routes, acc, cuts

    def admitted(groups: list[list[Any]], max_bytes: int = 1 << 20) -> list[Any]:
        routes, acc, cuts = admission(max_bytes, 2 if max_bytes < 1 << 20 else 8)
        for group in groups:
            routes.admit(group, None)
        pages = [
            (b.partition, b.seq, list(b.positions), b.items.table.column("id").to_pylist())
            for b in [*cuts, *acc.drain()]
        ]
        return sorted(pages)

    together = admitted([batches])
    assert together == admitted([[b] for b in batches])
    assert sorted(i for *_, ids in together for i in ids) == list(range(200))
    assert all(positions == ids for _, _, positions, ids in together)  # id i is row i
    # Pages cut by bytes too: a replay whose source batches fall otherwise cuts the same.
    wide = [
        pa.record_batch(
            {"id": pa.array(range(i * 5, i * 5 + 5), pa.int64()), "v": pa.array(["x" * 1000] * 5)}
        )
        for i in range(6)
    ]
    by_bytes = admitted([wide], max_bytes=8000)
    assert by_bytes == admitted([[b] for b in wide], max_bytes=8000)
    assert by_bytes == admitted([wide[:2], wide[2:3], wide[3:]], max_bytes=8000)
    assert max(len(ids) for *_, ids in by_bytes) < 30  # the bytes cut them, not the count

    keyless = pa.record_batch({"v": pa.array([9] * 5)})
    routes, acc, cuts = admission()
    with pytest.raises(UsageError, match=r"source item #50 .*lacks the key column"):
        routes.admit([batches[0], keyless, batches[1]], None)
    buffered = [i for b in [*cuts, *acc.drain()] for i in b.items.table.column("id").to_pylist()]
    assert sorted(buffered) == list(range(50))  # the batch before it, whole


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), max_size=60),
    data=st.data(),
    page=st.integers(1, 5),
    stagger=st.sampled_from([0, 3]),
)
def test_add_many_cuts_each_partition_as_add_does(
    sizes: list[int], data: st.DataObject, page: int, stagger: int
) -> None:
    parts = data.draw(st.lists(st.integers(0, 3), min_size=len(sizes), max_size=len(sizes)))
    deletes = frozenset(data.draw(st.sets(st.integers(0, max(0, len(sizes) - 1)))))
    items = [f"i{j}" for j in range(len(sizes))]
    packed = [b"x" * n for n in sizes]

    def run(many: bool) -> dict[int, list[Any]]:
        acc, _, cuts = make(page_size=page, max_bytes=12, interval=0, stagger=stagger)
        if many:
            acc.add_many(7, items, parts, packed, deletes)
        else:
            for j, item in enumerate(items):
                acc.add(parts[j], 7 + j, item, packed[j], j in deletes)
        batches: dict[int, list[Any]] = {}
        for b in [*cuts, *acc.drain()]:
            batches.setdefault(b.partition, []).append(
                (b.seq, b.items, b.positions, b.packed, b.deletes, b.nbytes)
            )
        return batches

    assert run(many=True) == run(many=False)
