"""Arrow sources: record batches routed by key column and sent as Arrow pages, into tables on
both engines, with the same results as row items."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import deltaflow
from deltaflow import DELETE_COLUMN, ArrowRows, Delete, StreamerOptions
from deltaflow.columnar import decode_page, encode_page
from deltaflow.errors import DataStreamerError, ProtocolError
from deltaflow.partitioning import partition_of, partition_table
from deltaflow.server import Node

from .support import StartCluster, assert_table, expected, read_delta, workload

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("value", pa.float64())])
OPTIONS = StreamerOptions(page_size=150, per_partition_in_flight=4, auto_flush_interval=0.5)


@pytest.fixture(params=["spark", "delta-rs"])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def as_batches(items: list[Any], rows_per_batch: int) -> list[pa.RecordBatch]:
    """The workload as record batches with the delete column (deletes carry only the key)."""
    batches = []
    for start in range(0, len(items), rows_per_batch):
        part = items[start : start + rows_per_batch]
        rows = [
            {"id": x.item["id"], "name": None, "value": None} if isinstance(x, Delete) else x
            for x in part
        ]
        batch = pa.RecordBatch.from_pylist(
            rows,
            schema=pa.schema([("id", pa.int64()), ("name", pa.string()), ("value", pa.float64())]),
        )
        flags = pa.array([isinstance(x, Delete) for x in part], pa.bool_())
        batches.append(batch.append_column(DELETE_COLUMN, flags))
    return batches


async def test_arrow_batches_land_like_the_same_rows_as_items(
    cluster: list[Node], spark: Any, warehouse: Path
) -> None:
    items = workload()
    acked: list[Any] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            iter(as_batches(items, 700)),
            table="columnar",
            key="id",
            options=OPTIONS,
            on_ack=acked.append,
        )
    # Every row is an item: acked, routed to its owner (both nodes), never redirected.
    assert summary.items_acked == len(items)
    assert summary.items_failed == 0
    assert set(summary.per_node) == {"node-1", "node-2"}
    assert summary.batches_retried == 0
    assert all(isinstance(page, ArrowRows) for page in acked)
    assert sum(len(page) for page in acked) == len(items)
    # The same result as row items, read back with Spark and with delta-rs.
    assert_table(spark, warehouse / "columnar", expected(items))


def test_arrow_rows_are_routed_to_the_partition_of_their_key() -> None:
    table = pa.table(
        {
            "id": pa.array([1, 2, 3, 10**12, -5], pa.int64()),
            "key": ["a", "b", "é", "", "x" * 40],
        }
    )
    assert partition_table(table, ["id"], 64).to_pylist() == [
        partition_of(v, 64) for v in table.column("id").to_pylist()
    ]
    assert partition_table(table, ["key", "id"], 64).to_pylist() == [
        partition_of((k, i), 64) for i, k in zip(*table.to_pydict().values(), strict=True)
    ]


@pytest.mark.parametrize(
    "arrow_type", [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint32()]
)
def test_integer_keys_are_routed_without_python_per_row_to_the_same_partitions(
    arrow_type: Any,
) -> None:
    """Integer key columns are hashed vectorised (every msgpack int encoding, byte by byte):
    the partitions must be partition_of's, at every encoding's edges and in between."""
    bits = arrow_type.bit_width
    signed = pa.types.is_signed_integer(arrow_type)
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    edges = [-(2**63), -(2**31) - 1, -(2**31), -32769, -32768, -129, -128, -33, -32, -1]
    edges += [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]
    rng = random.Random(7)
    values = [v for v in edges if low <= v <= high]
    values += [rng.randint(low, high) for _ in range(5000)]
    values += [rng.randint(max(low, -70_000), min(high, 70_000)) for _ in range(5000)]
    table = pa.table({"id": pa.array(values, arrow_type)})
    for partitions in (64, 7):
        assert partition_table(table, ["id"], partitions).to_pylist() == [
            partition_of(v, partitions) for v in values
        ]


def test_a_page_round_trips_and_a_bad_page_is_a_protocol_error() -> None:
    batch = as_batches([{"id": 1, "name": "a", "value": 1.0}, Delete({"id": 2})], 10)[0]
    page = ArrowRows.of(batch)
    assert page.deletes == {1}
    assert DELETE_COLUMN not in page.table.column_names
    back = decode_page(encode_page(page), 2)
    assert back.deletes == {1}
    assert back[0] == {"id": 1, "name": "a", "value": 1.0}
    with pytest.raises(ProtocolError, match="2 rows"):
        decode_page(encode_page(page), 3)
    with pytest.raises(ProtocolError, match="not an Arrow IPC stream"):
        decode_page(b"\x00garbage", 1)


async def test_a_null_key_fails_its_page_and_names_the_row(
    cluster: list[Node], warehouse: Path
) -> None:
    good = pa.record_batch({"id": pa.array(range(100), pa.int64()), "v": pa.array([1.0] * 100)})
    bad = pa.record_batch({"id": pa.array([None], pa.int64()), "v": pa.array([2.0])})
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as caught:
            await client.stream_data([good, bad], table="nullkey", key="id", options=OPTIONS)
    err = caught.value
    # Named by its place in the source (the 101st row), not in its batch.
    assert "source item #100 (key None) has no value for key column 'id'" in str(err)
    # The failed row is reported as the row it was, with its own reason.
    assert err.failed_items == [{"id": None, "v": 2.0}]
    assert [(f.position, f.item) for f in err.failures] == [(100, {"id": None, "v": 2.0})]
    assert "source item #100 (key None) has no value" in err.failures[0].reason
    assert set(read_delta(warehouse / "nullkey")) == set(range(100))


async def test_an_arrow_stream_needs_key_columns_and_no_row_items(
    cluster: list[Node],
) -> None:
    batch = pa.record_batch({"id": pa.array([1, 2], pa.int64())})
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError, match="key columns"):
            await client.stream_data(
                [batch], key=lambda r: r["id"], receiver="deltaflow.testing.Echo"
            )
        with pytest.raises(DataStreamerError, match="row items or Arrow batches"):
            await client.stream_data([batch, {"id": 3}], table="mixed", key="id")
        with pytest.raises(DataStreamerError, match=r"lacks the key column\(s\) \['missing'\]"):
            await client.stream_data([batch], table="mixed", key="missing")


def test_deletes_follow_their_rows_through_slices_takes_and_joins() -> None:
    items: list[Any] = [{"id": i, "name": f"n{i}", "value": float(i)} for i in range(6)]
    items[1] = Delete({"id": 1})
    items[4] = Delete({"id": 4})
    page = ArrowRows.of(as_batches(items, 10)[0])
    assert page.deletes == {1, 4}
    assert page.part(2, 3).deletes == {2}  # rows 2, 3, 4
    assert page.take([4, 0, 1]).deletes == {0, 2}
    plain = ArrowRows.of(as_batches(items[2:4], 10)[0].drop_columns([DELETE_COLUMN]))
    joined = ArrowRows.concat([page.part(0, 2), plain, page.part(4, 2)])
    assert [r["id"] for r in joined] == [0, 1, 2, 3, 4, 5]
    assert joined.deletes == {1, 4}
    assert decode_page(encode_page(joined), 6).deletes == {1, 4}


def test_arrow_pages_stay_under_max_batch_bytes_and_keep_source_order() -> None:
    from .test_accumulator import make

    acc, _, cut = make(page_size=1000, max_bytes=20_000)
    payload = pa.array(["x" * 1000] * 95, pa.string())
    rows = ArrowRows.of(pa.table({"id": pa.array(range(95), pa.int64()), "p": payload}))
    acc.add_rows(7, rows, pa.array(range(100, 195), pa.int64()))
    cut.extend(acc.drain())
    # Wide rows: pages of fewer rows, each within the limit the frame size rests on.
    assert len(cut) > 4
    assert all(batch.nbytes <= 20_000 for batch in cut)
    assert [b.seq for b in cut] == list(range(len(cut)))
    assert [p for b in cut for p in b.positions] == list(range(100, 195))
    assert [r["id"] for b in cut for r in b.items] == list(range(95))


@pytest.mark.parametrize("kind", ["pandas", "polars", "arrow"])
async def test_a_dataframe_is_streamed_as_its_rows(
    kind: str, tmp_path: Path, start_cluster: StartCluster
) -> None:
    """A pandas or polars DataFrame (or one Arrow table) passed as the source is its rows, not
    an iterable of column names."""
    nodes = await start_cluster(tmp_path, engine="delta-rs")
    rows = [{"id": i, "name": f"n{i}", "value": i / 4} for i in range(500)]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    if kind == "pandas":
        source: Any = table.to_pandas()
    elif kind == "polars":
        import polars

        source = polars.from_arrow(table)
    else:
        source = table
    async with deltaflow.connect([nodes[0].address]) as client:
        summary = await client.stream_data(source, table="frame", key="id")
    assert summary.items_acked == 500
    landed = read_delta(tmp_path / "frame")
    assert {k: {c: r[c] for c in SCHEMA.names} for k, r in landed.items()} == {
        r["id"]: r for r in rows
    }
