"""Creating a table and its settings (explicitly, by the first write, by the CLI) and the
schema rules every row must fit: what does not fit is named by item and column."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from deltaflow.engines import create_table
from deltaflow.errors import SchemaError, UsageError
from deltaflow.partitioning import partition_of
from deltaflow.spark_integration.s3a import configure_bucket
from deltaflow.storage.paths import StorePath
from deltaflow.tables import BUCKET_COLUMN, read_table_settings
from deltaflow.tables.layout import DEFAULT_BUCKET_ROWS
from deltaflow.tables.settings import TableSettings

from .support import (
    WRITE_PATHS,
    creating_engine,
    every_engine,  # noqa: F401 - this module's engine fixture
    holding,
    open_table,
    read_all,
    read_spark,
    table_engine,
    upsert,
)


async def test_explicit_create_stores_schema_layout_and_settings(
    spark: Any, warehouse: Path, engine: str
) -> None:
    settings = await asyncio.to_thread(
        create_table,
        warehouse,
        "people",
        schema="id:long,name:string,score:double",
        key="id",
        buckets=16,
        allow_schema_evolution=True,
        engine=creating_engine(engine),
    )
    assert settings == TableSettings(
        key=("id",), buckets=16, bucket_rows=DEFAULT_BUCKET_ROWS, schema_evolution=True
    )
    table = open_table(warehouse / "people")
    meta = table.metadata()
    assert meta.partition_columns == [BUCKET_COLUMN]
    assert meta.configuration["deltaflow.key"] == '["id"]'
    assert meta.configuration["deltaflow.buckets"] == "16"
    assert meta.configuration["deltaflow.bucketRows"] == str(DEFAULT_BUCKET_ROWS)
    assert meta.configuration["deltaflow.schemaEvolution"] == "true"
    assert meta.configuration["delta.checkpointInterval"] == "100"
    assert pa.schema(table.schema().to_arrow()).names == ["id", "name", "score", BUCKET_COLUMN]
    assert await asyncio.to_thread(read_table_settings, warehouse, "people") == settings
    with pytest.raises(UsageError, match="exists already"):
        await asyncio.to_thread(create_table, warehouse, "people", schema="id:long", key="id")
    with pytest.raises(UsageError, match="not in the schema"):
        await asyncio.to_thread(create_table, warehouse, "other", schema="id:long", key="uid")
    # Any node writes it with its stored settings, whatever its own defaults.
    async with table_engine(engine, warehouse, table_buckets=0) as eng:
        await upsert(eng, "people", [{"id": i, "name": f"p{i}", "score": 1.0} for i in range(50)])
    rows = read_all(warehouse / "people")
    assert [r["id"] for r in rows] == list(range(50))
    assert all(r[BUCKET_COLUMN] == 1 for r in rows)  # 50 rows: the one bucket of level 1


async def test_rows_that_do_not_fit_name_item_and_column(
    spark: Any, warehouse: Path, engine: str
) -> None:
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "fit", [{"id": 1, "name": "a", "value": 1.0}])
        for rows, item, column, text in [
            ([{"id": 2, "value": 2.0}, {"id": 3, "value": "x"}], 1, "value", "is double"),
            ([{"id": 2}, {"id": 3, "name": "c", "colour": "red"}], 1, "colour", "allow_schema"),
            ([{"id": 2}, {"name": "no key"}], 1, "id", "no value for key column"),
            ([{"id": 2, BUCKET_COLUMN: 3}], 0, BUCKET_COLUMN, "reserves"),
        ]:
            with pytest.raises(SchemaError, match=text) as info:
                await eng.stage("fit", ["id"], rows, frozenset())
            details = info.value.details
            assert (details["item"], details["column"]) == (item, column)
            assert f"item #{item}" in str(info.value)
        # Rows staged before the table existed are checked against it at commit: here another
        # node creates it (without the column) while this node waits for the lock.
        async with holding(warehouse, "late"):
            write = await eng.stage("late", ["id"], [{"id": 1, "colour": "red"}], frozenset())
            await asyncio.sleep(0.2)  # the commit is waiting for the lock
            await asyncio.to_thread(
                eng.create,
                "late",
                warehouse / "late",
                pa.schema([("id", pa.int64())]),
                TableSettings(key=("id",), buckets=4),
            )
        with pytest.raises(SchemaError, match=r"colour.*allow_schema_evolution"):
            await write
    assert read_all(warehouse / "fit") == [
        {"id": 1, "name": "a", "value": 1.0, BUCKET_COLUMN: 1}  # a small table: level 1
    ]
    assert read_all(warehouse / "late") == []


@pytest.mark.parametrize("engine", WRITE_PATHS, indirect=True)
async def test_schema_evolution_only_on_tables_that_allow_it(
    spark: Any, warehouse: Path, engine: str
) -> None:
    await asyncio.to_thread(
        create_table,
        warehouse,
        "evolving",
        schema={"id": "long", "name": "string"},
        key="id",
        allow_schema_evolution=True,
    )
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "evolving", [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}])
        await upsert(eng, "evolving", [{"id": 2, "name": "b2", "size": 7}, {"id": 3, "size": 9}])
        with pytest.raises(SchemaError, match=r"item #0.*'size'.* is long; 'big'") as info:
            await eng.stage("evolving", ["id"], [{"id": 4, "size": "big"}], frozenset())
        assert (info.value.details["item"], info.value.details["column"]) == (0, "size")
        # A table created on first write takes the node's default: no evolution.
        await upsert(eng, "fixed", [{"id": 1, "name": "a"}])
        with pytest.raises(SchemaError, match="does not allow schema evolution"):
            await eng.stage("fixed", ["id"], [{"id": 2, "size": 1}], frozenset())
        # The operator allows it (as the error says): the node sees it at the next write.
        # (With Spark on a table with deletion vectors: delta-rs's way would add a feature
        # Spark cannot read, docs/tables.md.)
        if engine.endswith("-dv"):
            if isinstance(warehouse, StorePath):
                await asyncio.to_thread(
                    configure_bucket, spark, str(warehouse), warehouse.storage_options
                )
            fixed = warehouse / "fixed"
            spark.sql(
                f"ALTER TABLE delta.`{fixed}` SET TBLPROPERTIES ('deltaflow.schemaEvolution' = "
                "'true')"
            )
        else:
            open_table(warehouse / "fixed").alter.set_table_properties(
                {"deltaflow.schemaEvolution": "true"}, raise_if_not_exists=False
            )
        await upsert(eng, "fixed", [{"id": 2, "size": 1}])
        assert eng.stats.columns_added == 2
    rows = {r["id"]: (r["name"], r["size"]) for r in read_all(warehouse / "evolving")}
    assert rows == {1: ("a", None), 2: ("b2", 7), 3: (None, 9)}
    assert read_spark(spark, warehouse / "evolving")[3]["size"] == 9
    assert [(r["id"], r["size"]) for r in read_all(warehouse / "fixed")] == [(1, None), (2, 1)]


async def test_table_cli_creates_and_shows_settings_without_the_bucket_column(
    warehouse: Path,
) -> None:
    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "deltaflow.cli", "table", *args, "--warehouse", str(warehouse)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    out = await asyncio.to_thread(
        cli,
        "create",
        "pairs",
        "--schema",
        "region:string,id:long,note:string",
        "--key",
        "region,id",
        "--bucket-rows",
        "0",  # every bucket from the first row, as the client routes
    )
    assert "table pairs created: key ['region', 'id'], 64 buckets" in out
    async with table_engine("delta-rs", warehouse) as eng:
        rows = [{"region": "eu", "id": i, "note": "n"} for i in range(5)]
        await (await eng.stage("pairs", ["region", "id"], rows, frozenset()))
    # A composite key is bucketed as the client routes it: by the tuple of its values.
    assert {(r["id"], r[BUCKET_COLUMN]) for r in read_all(warehouse / "pairs")} == {
        (i, partition_of(("eu", i), 64)) for i in range(5)
    }
    shown = await asyncio.to_thread(cli, "show", "--table", "pairs")
    assert "table pairs: 5 rows" in shown
    assert "settings: key ['region', 'id'], 64 buckets, schema evolution off" in shown
    assert shown.splitlines()[3].split() == ["region", "id", "note"]
    assert BUCKET_COLUMN not in shown
    assert BUCKET_COLUMN in await asyncio.to_thread(
        cli, "show", "--table", "pairs", "--all-columns"
    )


@pytest.mark.parametrize("engine", ["delta-rs", "delta-rs-s3"], indirect=True)
async def test_a_null_in_a_not_null_column_fails_the_write_with_the_column_named(
    warehouse: Path, engine: str
) -> None:
    """A table made elsewhere may declare a column NOT NULL. A null there fails the write,
    naming the column, whichever way the group is applied: delta-rs's MERGE (a key of two
    columns) panics on it, which must not end the task awaiting the write (the batch was
    then never answered)."""
    from deltalake import DeltaTable

    for name, key in (("one", ["id"]), ("two", ["id", "k"])):
        schema = pa.schema(
            [("id", pa.int64()), ("k", pa.int64()), pa.field("name", pa.string(), nullable=False)]
        )
        path = warehouse / name
        options = path.storage_options if isinstance(path, StorePath) else None
        DeltaTable.create(str(path), schema, storage_options=options)
        async with table_engine(engine, warehouse) as eng:
            rows = [{"id": i, "k": 1, "name": f"n{i}"} for i in range(10)]
            await (await eng.stage(name, key, rows, frozenset()))
            null = [{"id": 3, "k": 1, "name": None}]
            with pytest.raises(SchemaError, match="name") as info:
                await asyncio.wait_for(await eng.stage(name, key, null, frozenset()), 60)
            assert "null" in str(info.value), info.value
        assert {r["id"]: r["name"] for r in read_all(path)} == {i: f"n{i}" for i in range(10)}
