"""A stream that fails ends the same way whatever its source and whatever failed: with a
``DataStreamerError`` listing exactly the items not applied, the source closed and every node
told the stream ended. And Arrow sources whose batches change schema are handled as dict rows
are."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import reactivex
from reactivex.disposable import Disposable

import deltaflow
from deltaflow import DataStreamerError, StreamerOptions
from deltaflow.engines import create_table
from deltaflow.errors import SchemaError, UsageError
from deltaflow.server import Node

from .support import Eventually, StartCluster, read_delta

ROWS = 300
AT = 150  # where the failure is, in source rows
OPTIONS = StreamerOptions(page_size=20, auto_flush_interval=0.05)


@pytest.fixture
async def nodes(warehouse: Path, start_cluster: StartCluster) -> AsyncIterator[list[Node]]:
    await asyncio.to_thread(
        create_table, warehouse, "t", schema="id:long,v:long", key="id", engine="delta-rs"
    )
    started = await start_cluster(warehouse, count=2, engine="delta-rs")
    yield started
    for node in reversed(started):
        await node.stop()


class Source:
    """A source of one kind over ``items``, which records whether it was closed (its
    generator finished or was closed, or its Observable subscription disposed)."""

    def __init__(self, kind: str, items: list[Any], *, raise_at: int | None = None) -> None:
        self.kind, self.items, self.raise_at = kind, items, raise_at
        self.closed = False
        self.taken = 0  # items a generator handed out (an Observable's are all emitted)

    def _values(self) -> Iterator[Any]:
        for i, item in enumerate(self.items):
            if i == self.raise_at:
                raise RuntimeError(f"the source broke at item {i}")
            self.taken = i + 1
            yield item

    def make(self) -> Any:
        if self.kind == "async_iterable":

            async def agen() -> AsyncIterator[Any]:
                try:
                    for item in self._values():
                        yield item
                finally:
                    self.closed = True

            return agen()
        if self.kind in ("iterable", "arrow"):

            def gen() -> Iterator[Any]:
                try:
                    yield from self._values()
                finally:
                    self.closed = True

            return gen()
        assert self.kind == "observable"

        def subscribe(observer: Any, scheduler: Any = None) -> Disposable:
            try:
                for item in self._values():
                    observer.on_next(item)
            except RuntimeError as exc:
                observer.on_error(exc)
            else:
                observer.on_completed()
            return Disposable(lambda: setattr(self, "closed", True))

        return reactivex.create(subscribe)


def rows(bad: dict[int, Any] | None = None) -> list[dict[str, Any]]:
    """Rows 0..ROWS-1 with ``v = 10 * id``, some replaced by ``bad``."""
    out = [{"id": i, "v": 10 * i} for i in range(ROWS)]
    for at, row in (bad or {}).items():
        out[at] = row
    return out


def arrow_batches(items: list[dict[str, Any]], size: int = 50) -> list[Any]:
    return [pa.RecordBatch.from_pylist(items[i : i + size]) for i in range(0, len(items), size)]


def source_rows(item: Any) -> list[dict[str, Any]]:
    """The rows of a source item (an Arrow batch holds many)."""
    return item.to_pylist() if isinstance(item, pa.RecordBatch) else [item]


def failure_case(kind: str, failure: str) -> tuple[Source, type[BaseException]]:
    """The source of ``kind`` failing by ``failure`` at row AT, and the cause expected."""
    if failure == "source_raises":
        items: list[Any] = rows()
        cause: type[BaseException] = RuntimeError
        raise_at = AT if kind != "arrow" else AT // 50
    elif failure == "unsendable_item":
        items, cause, raise_at = rows({AT: {"id": AT, "v": object()}}), UsageError, None
    elif failure == "refused_by_table":
        items = rows({AT: {"id": AT, "v": 5000.5}})
        cause, raise_at = SchemaError, None
    else:
        raise AssertionError(failure)
    if kind == "arrow":
        if failure == "unsendable_item":
            batches = arrow_batches(rows())
            batches.insert(AT // 50, {"id": AT, "v": 1})  # a dict in a stream of Arrow batches
            return Source(kind, batches), cause
        items = arrow_batches(items)
    return Source(kind, items, raise_at=raise_at), cause


@pytest.mark.parametrize("failure", ["source_raises", "unsendable_item", "refused_by_table"])
@pytest.mark.parametrize("kind", ["async_iterable", "iterable", "observable", "arrow"])
async def test_a_failing_stream_reports_exactly_what_it_did_not_apply_and_cleans_up(
    nodes: list[Node], warehouse: Path, kind: str, failure: str, eventually: Eventually
) -> None:
    source, cause = failure_case(kind, failure)
    async with deltaflow.connect([nodes[0].address]) as client:
        with pytest.raises(Exception) as info:
            await client.stream_data(source.make(), table="t", key="id", options=OPTIONS)
        err = info.value
        assert type(err) is DataStreamerError, f"{type(err).__name__} escaped: {err!r}"
        assert isinstance(err.cause, cause), repr(err.cause)
        # The nodes were told the stream ended (they hold no state for it).
        await eventually(
            lambda: all(n.dispatcher.stats.streams == 0 for n in nodes), "streams closed"
        )
    await eventually(lambda: source.closed, f"the {kind} source closed")
    table = read_delta(warehouse / "t")
    # Exactly the items taken from the source and not in the table are reported, each once.
    # (A generator's items are those it handed out; an Observable's, those emitted before the
    # failure: what it emits after the stream stopped is not taken.)
    emitted = AT if failure == "source_raises" else AT + 1
    taken = source.items[: source.taken if kind != "observable" else emitted]
    missing = [r for item in taken for r in source_rows(item) if r["id"] not in table]
    reported = [r for item in err.failed_items for r in source_rows(item)]
    if kind == "observable":
        assert all(r["id"] not in table for r in reported), "an applied item was reported"
        reported = [r for r in reported if r["id"] < emitted]
    assert sorted(r["id"] for r in reported) == sorted(r["id"] for r in missing)
    assert len(err.failures) == len(err.failed_items)
    assert [f.item for f in err.failures] == err.failed_items
    assert all(f.reason for f in err.failures)
    # Nothing in the table was changed on the way.
    assert all(row["v"] == 10 * key for key, row in table.items())
    if failure != "source_raises":
        assert AT not in table


async def test_arrow_batches_that_add_a_column_or_widen_exactly_are_applied(
    warehouse: Path,
    start_cluster: StartCluster,
) -> None:
    await asyncio.to_thread(
        create_table,
        warehouse,
        "evolving",
        schema="id:long,v:long",
        key="id",
        allow_schema_evolution=True,
        engine="delta-rs",
    )
    batches = [
        pa.record_batch({"id": pa.array(range(100)), "v": pa.array(range(100))}),
        # A later batch adds a column: the table allows it.
        pa.record_batch(
            {"id": pa.array(range(100, 200)), "v": pa.array(range(100)), "w": ["x"] * 100}
        ),
        # Another gives v as doubles that are whole numbers: converted exactly.
        pa.record_batch({"id": pa.array(range(200, 300)), "v": pa.array([1.0] * 100)}),
        # And one has v all null (Arrow's null type): joins the others in a page.
        pa.record_batch({"id": pa.array(range(300, 350)), "v": pa.nulls(50)}),
    ]
    started = await start_cluster(warehouse, count=2, engine="delta-rs")
    try:
        async with deltaflow.connect([started[0].address]) as client:
            summary = await client.stream_data(batches, table="evolving", key="id", options=OPTIONS)
    finally:
        for node in reversed(started):
            await node.stop()
    assert summary.items_acked == 350
    table = read_delta(warehouse / "evolving")
    assert sorted(table) == list(range(350))
    assert table[150] == {**table[150], "v": 50, "w": "x"}
    assert (table[50]["w"], table[250]["v"], table[320]["v"]) == (None, 1, None)


async def test_arrow_batches_whose_type_changes_inexactly_fail_only_those_rows(
    nodes: list[Node], warehouse: Path
) -> None:
    batches = [
        pa.record_batch({"id": pa.array(range(100)), "v": pa.array(range(100))}),
        pa.record_batch({"id": pa.array(range(100, 200)), "v": pa.array([2.5] * 100)}),
    ]
    async with deltaflow.connect([nodes[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(batches, table="t", key="id", options=OPTIONS)
    err = info.value
    table = read_delta(warehouse / "t")
    assert not any(100 <= key < 200 for key in table)
    assert sorted(r["id"] for r in err.failed_items) == sorted(
        k for k in range(200) if k not in table
    )
    assert "column 'v' of table 't' is long; 2.5 (float) has a fractional part" in str(err)


async def test_a_failed_connect_says_why_in_the_systems_words() -> None:
    from deltaflow.errors import NodeUnavailableError
    from deltaflow.testing import free_port

    port = free_port()  # nothing listens there
    with pytest.raises(NodeUnavailableError) as refused:
        async with deltaflow.connect([f"127.0.0.1:{port}"]):
            pass
    said = str(refused.value)
    assert (
        f"cannot connect to node at 127.0.0.1:{port}: connection refused (is a node listening "
        "on that port?)"
    ) in said
    assert "ssl:default" not in said  # aiohttp's words for a plain connection's TLS setting
