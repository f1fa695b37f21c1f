"""Values reach a table unchanged or not at all: the one conversion rule, dict rows and Arrow
pages alike, the Python value types a table column has, and errors that name the source item."""

from __future__ import annotations

import asyncio
import datetime
import decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

import deltaflow
from deltaflow import DataStreamerError, StreamerOptions
from deltaflow.columnar import ArrowRows
from deltaflow.engines import create_table
from deltaflow.errors import SchemaError
from deltaflow.tables.rows import to_arrow_rows

from .support import StartCluster, read_delta

D = decimal.Decimal
UTC = datetime.UTC
NAIVE = datetime.datetime(2026, 3, 1, 12, 30, 45, 123456)
AWARE = datetime.datetime(2026, 3, 1, 12, 30, 45, 123456, tzinfo=UTC)
PLUS_2 = datetime.timezone(datetime.timedelta(hours=2))

# (table type, value, what the table holds, or None: refused). Each value is sent as a dict
# row's Python value and, where Arrow can hold it, as an Arrow page's column of its own type:
# both must come out the same.
CASES: list[tuple[str, Any, Any]] = [
    ("long", 5000, 5000),
    ("long", 5000.0, 5000),  # a float without a fraction is the same integer
    ("long", 5000.5, None),  # the defect: stored as 5000 while the stream succeeded
    ("long", -0.9, None),  # likewise stored as 0
    ("long", float("nan"), None),
    ("long", "5", None),
    ("long", True, None),
    ("long", 2**63, None),
    ("int", 2**31, None),
    ("int", -(2**31), -(2**31)),
    ("double", 7, 7.0),
    ("double", 2**53, float(2**53)),
    ("double", 2**53 + 1, None),  # no double holds it
    ("double", "1.5", None),
    ("float", 0.5, 0.5),
    ("float", 1e300, None),  # beyond float's range: it would become infinity
    ("decimal(10,2)", D("12.30"), D("12.30")),
    ("decimal(10,2)", D("12.3"), D("12.30")),
    ("decimal(10,2)", D("1.234"), None),  # a digit would be cut
    ("decimal(10,2)", D("123456789.1"), None),  # too many digits before the point
    ("decimal(10,2)", 12, D("12.00")),
    ("decimal(10,2)", 10**8, None),
    ("decimal(10,2)", 0.25, D("0.25")),
    ("decimal(10,2)", 0.125, None),  # would be rounded to 0.12
    ("string", "x", "x"),
    ("string", b"x", None),
    ("string", 5, None),
    ("boolean", 1, None),
    ("date", datetime.date(2026, 3, 1), datetime.date(2026, 3, 1)),
    ("date", NAIVE, None),  # its time of day would be dropped
    ("timestamp", AWARE, AWARE),
    ("timestamp", AWARE.astimezone(PLUS_2), AWARE),  # the same instant
    ("timestamp", NAIVE, None),  # which instant it means is unknown
    ("timestamp_ntz", NAIVE, NAIVE),
    ("timestamp_ntz", AWARE, None),  # its zone would be dropped
    ("timestamp_ntz", datetime.date(2026, 3, 1), None),
]


def _schema(type_: str) -> Any:
    from deltaflow.tables.settings import parse_schema

    return parse_schema(f"id:long,v:{type_}")


def _convert(rows: Any, schema: Any) -> Any:
    return to_arrow_rows(rows, frozenset(), ["id"], schema, table="t", node="n1")


@pytest.mark.parametrize(("type_", "value", "stored"), CASES, ids=repr)
def test_a_value_is_stored_unchanged_or_refused_naming_item_column_type_and_value(
    type_: str, value: Any, stored: Any
) -> None:
    schema = _schema(type_)
    rows = [{"id": 1, "v": None}, {"id": 2, "v": value}]
    try:
        page = ArrowRows(pa.table({"id": [1, 2], "v": [None, value]}))
        sent_as: list[tuple[str, Any]] = [("dict rows", rows), ("Arrow page", page)]
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        sent_as = [("dict rows", rows)]  # a value Arrow cannot hold is not sent as a page
    for kind, data in sent_as:
        if stored is None:
            with pytest.raises(SchemaError) as info:
                _convert(data, schema)
            details = info.value.details
            assert (details["item"], details["column"], details["table_type"]) == (
                1,
                "v",
                type_,
            ), kind
            sent = value if data is rows else data.table.column("v")[1].as_py()
            assert details["value"] == f"{sent!r:.80}", kind
            assert f"item #1 of the batch: column 'v' of table 't' is {type_}" in str(info.value)
        else:
            got = _convert(data, schema).column("v").to_pylist()
            assert got == [None, stored], kind
            assert [type(x) for x in got[1:]] == [type(stored)], kind


def test_a_delete_is_checked_on_its_key_only() -> None:
    rows = [{"id": 1, "v": 5000.5}, {"id": 2, "v": 3}]
    data = to_arrow_rows(rows, frozenset({0}), ["id"], _schema("long"), table="t", node="n1")
    assert data.column("v").to_pylist() == [None, 3]
    with pytest.raises(SchemaError, match="item #0"):
        to_arrow_rows([{"id": 1.5}], frozenset({0}), ["id"], _schema("long"), table="t", node="n1")


def test_columns_a_first_write_adds_take_types_later_values_fit() -> None:
    rows = [
        {"id": 1, "amount": D("1.5"), "day": datetime.date(2026, 1, 2), "at": NAIVE, "ts": AWARE},
        {"id": 2, "amount": D("-20.25"), "mixed": 1},
        {"id": 3, "mixed": 2.5, "ts": AWARE.astimezone(PLUS_2)},
    ]
    data = _convert(rows, None)
    types = {f.name: str(f.type) for f in data.schema}
    # Decimals get room for later values (as Spark types Python decimals), timestamps are in
    # microseconds and UTC when aware, ints and floats mixed are doubles (all exact here).
    assert types["amount"] == "decimal128(38, 18)"
    assert (types["day"], types["at"], types["ts"]) == (
        "date32[day]",
        "timestamp[us]",
        "timestamp[us, tz=UTC]",
    )
    assert data.column("mixed").to_pylist() == [None, 1.0, 2.5]
    assert data.column("ts").to_pylist() == [AWARE, None, AWARE]
    with pytest.raises(SchemaError, match=r"item #1 .*column 'at' .* has a time zone"):
        _convert([{"id": 1, "at": NAIVE}, {"id": 2, "at": AWARE}], None)
    with pytest.raises(SchemaError, match=r"item #1 .*'x' \(str\) does not share a type"):
        _convert([{"id": 1, "x": 1}, {"id": 2, "x": "x"}], None)


@pytest.mark.parametrize("engine", ["spark", "delta-rs"])
async def test_a_lossy_value_fails_its_item_with_its_source_position_and_key(
    warehouse: Path, engine: str, spark: Any, start_cluster: StartCluster
) -> None:
    await asyncio.to_thread(
        create_table, warehouse, "t", schema="id:long,v:long", key="id", engine="delta-rs"
    )
    rows = [{"id": i, "v": i * 10} for i in range(40)]
    rows[23] = {"id": 1023, "v": 5000.5}
    nodes = await start_cluster(warehouse, count=1, engine=engine)
    try:
        async with deltaflow.connect([nodes[0].address]) as client:
            with pytest.raises(DataStreamerError) as info:
                await client.stream_data(
                    rows, table="t", key="id", options=StreamerOptions(page_size=10)
                )
    finally:
        await nodes[0].stop()
    err = info.value
    table = read_delta(warehouse / "t")
    # Nothing was changed: the refused row is not in the table, as 5000 or otherwise.
    assert 1023 not in table
    assert all(row["v"] == row["id"] * 10 for row in table.values())
    # Exactly the rows not in the table are reported, each with its own reason.
    assert sorted(r["id"] for r in err.failed_items) == sorted(
        r["id"] for r in rows if r["id"] not in table
    )
    bad = next(f for f in err.failures if f.position == 23)
    assert bad.item == {"id": 1023, "v": 5000.5}
    assert "source item #23 (key 1023): column 'v' of table 't' is long; 5000.5" in bad.reason
    assert "fractional part" in bad.reason
    assert "source item #23 (key 1023)" in str(err)
    others = [f for f in err.failures if f.position != 23]
    assert all("was refused" in f.reason or "stopped" in f.reason for f in others), others


async def upsert_on_one_node(
    start_cluster: StartCluster, warehouse: Path, engine: str, **sources: Any
) -> None:
    """Stream each source into the table of its name, by ``id``, on one node of ``engine``."""
    nodes = await start_cluster(warehouse, count=1, engine=engine)
    try:
        async with deltaflow.connect([nodes[0].address]) as client:
            for table, source in sources.items():
                await client.stream_data(source, table=table, key="id")
    finally:
        await nodes[0].stop()


@pytest.mark.parametrize("engine", ["spark", "delta-rs"])
async def test_python_value_types_round_trip_exactly_through_both_readers(
    warehouse: Path, engine: str, spark: Any, start_cluster: StartCluster
) -> None:
    await asyncio.to_thread(
        create_table,
        warehouse,
        "typed",
        schema="id:long,amount:decimal(10,2),day:date,at:timestamp_ntz,ts:timestamp",
        key="id",
        engine="delta-rs",
    )
    rows = [
        {
            "id": i,
            "amount": D(i * 1234567).scaleb(-2) if i else D("-99999999.99"),
            "day": datetime.date(1, 1, 1) + datetime.timedelta(days=i * 997),
            "at": NAIVE + datetime.timedelta(microseconds=i * 1_000_003),
            "ts": (AWARE + datetime.timedelta(seconds=i)).astimezone(PLUS_2),
        }
        for i in range(50)
    ]
    # A table made on first write from such rows ("inferred") takes their types.
    await upsert_on_one_node(start_cluster, warehouse, engine, typed=rows, inferred=rows)
    want = {r["id"]: {**r, "ts": r["ts"].astimezone(UTC)} for r in rows}
    for name in ("typed", "inferred"):
        path = warehouse / name
        got = read_delta(path)
        assert {k: {c: v[c] for c in want[k]} for k, v in got.items()} == want, name
        # Spark reads the same values (its timestamps compared as microseconds since epoch).
        spark_rows = {
            r["id"]: r.asDict()
            for r in spark.read.format("delta")
            .load(str(path))
            .selectExpr("id", "amount", "day", "at", "unix_micros(ts) AS ts")
            .collect()
        }
        epoch = datetime.datetime(1970, 1, 1, tzinfo=UTC)
        for key, row in want.items():
            theirs = spark_rows[key]
            assert (theirs["amount"], theirs["day"], theirs["at"]) == (
                row["amount"],
                row["day"],
                row["at"],
            ), (name, key)
            assert theirs["ts"] == (row["ts"] - epoch) // datetime.timedelta(microseconds=1)
    schema = DeltaTable(str(warehouse / "inferred")).schema().to_arrow()
    types = {f.name: str(f.type) for f in pa.schema(schema)}
    assert types["amount"] == "decimal128(38, 18)"
    assert types["at"] == "timestamp[us]"


@pytest.mark.parametrize("engine", ["spark", "delta-rs"])
async def test_a_table_made_by_the_first_write_takes_the_sources_declared_types(
    warehouse: Path, engine: str, spark: Any, start_cluster: StartCluster
) -> None:
    import pandas as pd

    at = [datetime.datetime(2026, 1, 1, 12, tzinfo=UTC), datetime.datetime(2026, 1, 2, tzinfo=UTC)]
    arrow = pa.table({
        "id": pa.array([1, 2], pa.int32()),
        "price": pa.array([D("1.25"), D("9999999999.99")], pa.decimal128(12, 2)),
        "at": pa.array(at, pa.timestamp("us", tz="UTC")),
        "ratio": pa.array([0.5, 1.5], pa.float32()),
        "tags": pa.array([["a"], ["b", "c"]], pa.list_(pa.string())),
    })  # fmt: skip
    frame = pd.DataFrame({
        "id": pd.array([1, 2], dtype="int16"),
        "score": pd.array([0.25, 0.75], dtype="float32"),
        "at": pd.to_datetime(at, utc=True),
        "ok": [True, False],
    })  # fmt: skip
    await upsert_on_one_node(start_cluster, warehouse, engine, from_arrow=arrow, from_pandas=frame)

    def types(name: str) -> dict[str, str]:
        schema = pa.schema(DeltaTable(str(warehouse / name)).schema().to_arrow())
        return {f.name: str(f.type) for f in schema if not f.name.startswith("_deltaflow")}

    assert types("from_arrow") == {
        "id": "int32",
        "price": "decimal128(12, 2)",
        "at": "timestamp[us, tz=UTC]",
        "ratio": "float",
        "tags": "list<element: string>",
    }
    assert types("from_pandas") == {
        "id": "int16",
        "score": "float",
        "at": "timestamp[us, tz=UTC]",
        "ok": "bool",
    }
    assert read_delta(warehouse / "from_arrow")[2]["price"] == D("9999999999.99")
