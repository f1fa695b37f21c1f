"""Change feeds on a node's table engine: ``sequence_by`` tables apply a change to its key only
if its sequence is greater than the table's, whatever order changes arrive in; a delete is
remembered (its tombstone) so an older change arriving later does not bring the key back, also
for a node that starts afterwards. Every write path: the copy-on-write rewrite and delta-rs's
MERGE (delta-rs), merge-on-read (``-dv``), Spark's direct writer and its SQL MERGE, and a
warehouse on the S3 server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import deltaflow
from deltaflow.errors import SchemaError, TableSettingsError, UsageError
from deltaflow.tables import read_table_settings
from deltaflow.tables.layout import DEFAULT_BUCKET_ROWS
from deltaflow.tables.settings import TableSettings

from .support import creating_engine, open_table, read_all, read_delta, table_engine

#: Every way a group reaches a table (see the module docstring).
CDC_ENGINES = ("delta-rs", "delta-rs-dv", "delta-rs-s3", "spark", "spark-sql", "spark-dv")


@pytest.fixture(params=CDC_ENGINES, name="engine")
def cdc_engine(request: pytest.FixtureRequest) -> str:
    if str(request.param).startswith("spark"):
        request.getfixturevalue("spark")  # the run's one session, started on first use
    return str(request.param)


def change(key: int, lsn: int, v: str) -> dict[str, Any]:
    return {"id": key, "lsn": lsn, "v": v}


async def apply(
    eng: Any, rows: list[dict[str, Any]], deletes: frozenset[int] = frozenset()
) -> None:
    """One batch (one group): ``rows``, those at ``deletes`` deleting their key."""
    await (await eng.stage("cdc", ["id"], rows, frozenset(deletes), sequence=("lsn",)))


Rounds = list[dict[str, tuple[list[dict[str, Any]], frozenset[int]]]]


async def apply_rounds(eng: Any, rounds: Rounds) -> None:
    """Each round: a batch (rows, the indexes that delete) per table, staged to all of them at
    once (a group each), committed before the next round."""
    for writes in rounds:
        staged = [
            await eng.stage(name, ["id"], rows, deletes) for name, (rows, deletes) in writes.items()
        ]
        await asyncio.gather(*staged)


def table_of(warehouse: Any) -> dict[int, tuple[int, str]]:
    return {k: (r["lsn"], r["v"]) for k, r in read_delta(warehouse / "cdc").items()}


async def test_changes_apply_by_sequence_and_deletes_stay_deleted(
    warehouse: Any, engine: str
) -> None:
    async with table_engine(engine, warehouse) as eng:
        # The first write creates the table with sequence_by; within a batch the highest
        # sequence of a key wins, not the last to arrive.
        await apply(eng, [change(1, 5, "a"), change(2, 5, "a"), change(3, 5, "a"),
                          change(1, 4, "older"), change(4, 2, "x"), change(4, 3, "y")])  # fmt: skip
        assert table_of(warehouse) == {1: (5, "a"), 2: (5, "a"), 3: (5, "a"), 4: (3, "y")}
        # Late changes lose to the stored row; a late delete too; a newer delete wins; a delete
        # of a key the table does not hold yet is remembered.
        await apply(
            eng,
            [change(1, 3, "late"), change(2, 6, "b"), change(3, 4, ""), change(4, 9, ""),
             change(5, 7, "")],
            deletes=frozenset({2, 3, 4}),
        )  # fmt: skip
        assert table_of(warehouse) == {1: (5, "a"), 2: (6, "b"), 3: (5, "a")}
        # Older than the deletes: not brought back. An equal sequence is not greater.
        await apply(eng, [change(4, 8, "undead"), change(5, 6, "undead"), change(2, 6, "same")])
        assert table_of(warehouse) == {1: (5, "a"), 2: (6, "b"), 3: (5, "a")}
        # Newer than the deletes: back.
        await apply(eng, [change(4, 10, "back"), change(5, 8, "new")])
        await apply(eng, [change(1, 20, "")], deletes=frozenset({0}))
        superseded = eng.stats.changes_superseded
    # 4@8 and 5@6 by the tombstones; a group applied by deltaflow's own file writers also
    # counts the late changes the stored rows beat (1@3, 3's delete@4, 2@6), a MERGE cannot.
    # delta-rs without deletion vectors MERGEs a group unless its files hold many more rows
    # than it; in this one-bucket table one group with a late change is rewritten.
    merged = {"delta-rs": 3, "delta-rs-s3": 3, "spark-sql": 2}
    assert superseded == merged.get(engine, 5)
    assert table_of(warehouse) == {2: (6, "b"), 3: (5, "a"), 4: (10, "back"), 5: (8, "new")}
    # A node that starts now reads the deletes from the table's commits.
    async with table_engine(engine, warehouse, node_id="t2") as eng:
        await apply(eng, [change(1, 15, "undead"), change(3, 1, "late"), change(6, 1, "new")])
    assert table_of(warehouse) == {
        2: (6, "b"), 3: (5, "a"), 4: (10, "back"), 5: (8, "new"), 6: (1, "new")
    }  # fmt: skip
    # What a Delta reader sees of the deletes: a record in the commit's userMetadata only.
    records = [
        json.loads(h["userMetadata"])["deltaflow"]
        for h in open_table(warehouse / "cdc").history()
        if h.get("userMetadata")
    ]
    deleted = [r["deleted"] for r in records if "deleted" in r]
    recorded = {k: s for d in deleted for k, s in zip(d["keys"], d["seqs"], strict=True)}
    assert recorded == {3: 4, 4: 9, 5: 7, 1: 20}


async def test_sequence_by_is_a_table_setting_every_write_must_match(tmp_path: Path) -> None:
    warehouse = tmp_path / "warehouse"
    settings = await asyncio.to_thread(
        deltaflow.create_table,
        warehouse,
        "orders",
        schema="id:long,lsn:long,ts:timestamp,v:string,price:double",
        key="id",
        sequence_by="lsn",
        tombstone_retention="36 hours",
    )
    assert settings == TableSettings(
        key=("id",),
        buckets=64,
        bucket_rows=DEFAULT_BUCKET_ROWS,
        sequence_by=("lsn",),
        tombstone_retention=36 * 3600,
    )
    config = open_table(warehouse / "orders").metadata().configuration
    assert config["deltaflow.sequenceBy"] == '["lsn"]'
    assert config["deltaflow.tombstoneRetention"] == "interval 36 hours"
    assert await asyncio.to_thread(read_table_settings, warehouse, "orders") == settings
    assert "sequence by ['lsn'] (tombstones kept 36 hours)" in settings.describe()
    for bad, text in [
        ({"sequence_by": "price"}, "sequence column 'price' is double"),
        ({"sequence_by": "nope"}, r"sequence column\(s\) \['nope'\] are not in the schema"),
        ({"sequence_by": "id"}, "cannot be both key and sequence"),
        ({"sequence_by": "lsn", "tombstone_retention": "soon"}, "is not a duration"),
    ]:
        with pytest.raises(UsageError, match=text):
            await asyncio.to_thread(
                deltaflow.create_table, warehouse, "bad", schema="id:long,lsn:long,price:double",
                key="id", **bad,
            )  # fmt: skip
    async with table_engine("delta-rs", warehouse) as eng:
        ok = {"id": 1, "lsn": 1, "v": "a"}
        # Another sequence than the table's is refused as a usage error: the stream's
        # arguments, not its rows, are wrong. Naming none takes the table's.
        with pytest.raises(TableSettingsError, match=r"orders changes by \['lsn'\].*\['ts'\]"):
            await eng.stage("orders", ["id"], [ok], frozenset(), sequence=("ts",))
        with pytest.raises(UsageError, match="names no sequence_by"):
            await eng.stage("orders", ["id"], [ok], frozenset(), sequence=())
        await (await eng.stage("orders", ["id"], [ok], frozenset()))
        # Every change carries its sequence, deletes too.
        for rows, deletes in [
            ([ok, {"id": 2, "v": "b"}], frozenset()),
            ([ok, {"id": 2}], frozenset({1})),
        ]:
            with pytest.raises(SchemaError, match=r"item #1.*sequence column 'lsn'") as info:
                await eng.stage("orders", ["id"], rows, deletes)
            assert info.value.details == {"item": 1, "column": "lsn"}
        # A table without a sequence refuses a stream that names one.
        await (await eng.stage("plain", ["id"], [{"id": 1}], frozenset()))
        with pytest.raises(TableSettingsError, match=r"has no sequence_by.*\['lsn'\]"):
            await eng.stage("plain", ["id"], [ok], frozenset(), sequence=("lsn",))
        # A sequence_by table made on first write refuses deletes before it exists: they
        # could not be remembered.
        with pytest.raises(SchemaError, match="does not exist yet and these batches only delete"):
            await (await eng.stage("fresh", ["id"], [ok], frozenset({0}), sequence=("lsn",)))
    assert {k: (r["lsn"], r["v"]) for k, r in read_delta(warehouse / "orders").items()} == {
        1: (1, "a")
    }


def test_debezium_events_become_rows_and_deletes_with_their_sequence() -> None:
    from deltaflow.client.changelog import convert_changelog

    events = [
        {"op": "c", "before": None, "after": {"id": 1, "v": "a"}, "source": {"lsn": 10},
         "ts_ms": 5},
        # Kafka Connect's JSON with schemas; the row's own lsn wins over the source's.
        {"schema": {}, "payload": {"op": "u", "before": {"id": 1}, "after": {"id": 1, "lsn": 3},
                                   "source": {"lsn": 11}, "ts_ms": 6}},
        None,  # Kafka's tombstone after a delete
        {"op": "d", "before": {"id": 1, "v": "a"}, "after": None, "source": {}, "ts_ms": 7},
        {"op": "r", "before": None, "after": {"id": 2}, "source": {"lsn": 12}, "ts_ms": 8},
    ]  # fmt: skip
    out = list(convert_changelog(events, "debezium", ("lsn",)))
    assert out == [
        {"id": 1, "v": "a", "lsn": 10},
        {"id": 1, "lsn": 3},
        deltaflow.Delete({"id": 1, "v": "a", "lsn": 7}),  # no lsn in source: ts_ms
        {"id": 2, "lsn": 12},
    ]
    for bad, text in [
        ({"op": "x", "source": {}}, r"item #0 has op 'x'; a Debezium event has op c, r, u, d"),
        ({"op": "d", "before": None, "after": None}, r"item #0 \(op 'd'\) has no 'before' row"),
        ({"op": "c", "after": {"id": 1}}, r"no sequence 'lsn': not in its row, its source"),
        ([1, 2], "item #0 is a list, not a Debezium event"),
    ]:
        with pytest.raises(UsageError, match=text):
            list(convert_changelog([bad], "debezium", ("lsn",)))
    with pytest.raises(UsageError, match=r"use 'debezium' or deltaflow\.Changelog"):
        convert_changelog([], "maxwell", ())


def test_a_changelog_names_its_operation_column_and_delete_values() -> None:
    import pyarrow as pa

    from deltaflow.client.changelog import convert_changelog
    from deltaflow.columnar import DELETE_COLUMN

    spec = deltaflow.Changelog(op="kind", delete_when=("DELETE", "purge"))
    rows = [{"id": 1, "kind": "INSERT"}, {"id": 1, "kind": "purge"}, {"id": 2, "kind": "DELETE"}]
    assert list(convert_changelog(rows, spec, ())) == [
        {"id": 1},
        deltaflow.Delete({"id": 1}),
        deltaflow.Delete({"id": 2}),
    ]
    kept = deltaflow.Changelog(op="kind", delete_when=("DELETE",), keep_op=True)
    assert list(convert_changelog(rows[:1], kept, ())) == [{"id": 1, "kind": "INSERT"}]
    [page] = convert_changelog([pa.Table.from_pylist(rows)], spec, ())
    assert page.column_names == ["id", DELETE_COLUMN]
    assert page.column(DELETE_COLUMN).to_pylist() == [False, True, True]
    with pytest.raises(UsageError, match="item #1 has no operation column 'kind'"):
        list(convert_changelog([rows[0], {"id": 3}], spec, ()))
    with pytest.raises(UsageError, match="a tuple of values"):
        deltaflow.Changelog(delete_when="d")


async def test_merge_modes_partial_first_and_aggregate(warehouse: Any, engine: str) -> None:
    """Each mode on its own table, the same rounds of groups staged to all at once: within a
    group a key's changes fold, against the table they merge with the stored row, and a delete
    followed by changes in one group replaces it."""
    dv = engine.endswith("-dv")
    tables = {
        "partial": ("id:long,name:string,email:string,n:long", {"merge": "partial"}),
        "first": ("id:long,v:string", {"merge": "first"}),
        "agg": (
            "id:long,total:long,low:double,high:double,label:string",
            {"merge": "aggregate", "aggregates": {"total": "sum", "low": "min", "high": "max"}},
        ),
        "seqpart": ("id:long,lsn:long,name:string,email:string",
                    {"merge": "partial", "sequence_by": "lsn"}),
    }  # fmt: skip
    for name, (schema, extra) in tables.items():
        await asyncio.to_thread(
            deltaflow.create_table, warehouse, name, schema=schema, key="id",
            deletion_vectors=dv, engine=creating_engine(engine), **extra,
        )  # fmt: skip
    rounds: Rounds = [
        {
            "partial": ([{"id": 1, "name": "a", "email": "a@", "n": 1},
                         {"id": 2, "name": "b", "email": "b@", "n": 2}], frozenset()),
            "first": ([{"id": 1, "v": "a"}, {"id": 1, "v": "b"}, {"id": 2, "v": "x"}],
                      frozenset()),
            "agg": ([{"id": 1, "total": 5, "low": 5.0, "high": 5.0, "label": "x"},
                     {"id": 1, "total": 3, "low": 3.0, "high": 3.0, "label": None}], frozenset()),
            "seqpart": ([{"id": 1, "lsn": 3, "name": "a", "email": "a@"},
                         {"id": 2, "lsn": 6, "name": "b", "email": "b@"}], frozenset()),
        },
        {
            # Absent columns and nulls keep the stored values.
            "partial": ([{"id": 1, "name": "A"}, {"id": 2, "email": None, "n": 20}], frozenset()),
            "first": ([{"id": 1, "v": "c"}], frozenset()),  # the first one stays
            "agg": ([{"id": 1, "total": 2, "low": 9.0, "high": 9.0},
                     {"id": 2, "total": None, "label": "new"}], frozenset()),
            # A delete and a change in one group: key 1's delete (4) is newer than its row (3),
            # so the change replaces the row; key 2's (4) is older than its row (6): it merges.
            "seqpart": ([{"id": 1, "lsn": 4}, {"id": 1, "lsn": 5, "name": "N"},
                         {"id": 2, "lsn": 4}, {"id": 2, "lsn": 7, "name": "M"},
                         {"id": 2, "lsn": 5, "name": "late"}], frozenset({0, 2})),
        },
        {
            # Folded within the group, then merged.
            "partial": ([{"id": 1, "email": "x@"}, {"id": 1, "n": 5},
                         {"id": 2}, {"id": 2, "name": "B"}, {"id": 3, "name": "c"}],
                        frozenset({2})),
            "first": ([{"id": 1}, {"id": 1, "v": "d"}, {"id": 2}], frozenset({0, 2})),
            "agg": ([{"id": 1, "total": 1}, {"id": 1, "total": 1, "high": 10.0}], frozenset()),
            "seqpart": ([{"id": 1, "lsn": 2, "email": "old@"}], frozenset()),  # late: dropped
        },
        {
            "first": ([{"id": 2, "v": "y"}], frozenset()),  # after its delete: first again
            # A null set on purpose replaces the stored value; in a group, the last setting
            # of a column wins, a value or such a null.
            "partial": ([deltaflow.set_null({"id": 1}, "email"), {"id": 2, "email": "e@"},
                         deltaflow.set_null({"id": 2, "n": 7}, "email")], frozenset()),
        },
    ]  # fmt: skip
    async with table_engine(engine, warehouse) as eng:
        await apply_rounds(eng, rounds)

    def table(name: str, *columns: str) -> dict[int, tuple[Any, ...]]:
        return {k: tuple(r[c] for c in columns) for k, r in read_delta(warehouse / name).items()}

    assert table("partial", "name", "email", "n") == {
        1: ("A", None, 5),
        2: ("B", None, 7),  # deleted, then written anew in the same group; then patched
        3: ("c", None, None),
    }
    assert table("first", "v") == {1: ("d",), 2: ("y",)}
    assert table("agg", "total", "low", "high", "label") == {
        1: (12, 3.0, 10.0, "x"),
        2: (None, None, None, "new"),
    }
    assert table("seqpart", "lsn", "name", "email") == {1: (5, "N", None), 2: (7, "M", "b@")}


async def test_a_history_table_keeps_every_version_and_slots_late_changes_in(
    warehouse: Any, engine: str
) -> None:
    dv = engine.endswith("-dv")
    schema = "id:long,lsn:long,name:string,tier:string"
    for name, tracked in (("scd", ()), ("scd_tier", ("tier",))):
        await asyncio.to_thread(
            deltaflow.create_table, warehouse, name, schema=schema,
            key="id", sequence_by="lsn", history="scd2", track_history_on=tracked,
            deletion_vectors=dv, engine=creating_engine(engine),
        )  # fmt: skip

    def row(key: int, lsn: int, name: str = "", tier: str = "gold") -> dict[str, Any]:
        return {"id": key, "lsn": lsn, "name": name, "tier": tier}

    rounds: Rounds = [
        {"scd": ([row(1, 1, "a"), row(1, 3, "b"), row(2, 1, "x")], frozenset()),
         "scd_tier": ([row(1, 1, "a"), row(1, 2, "b")], frozenset())},
        # A late change of key 1 (2, between 1 and 3); key 2 deleted at 5.
        {"scd": ([row(1, 2, "late"), row(2, 5)], frozenset({1})),
         "scd_tier": ([row(1, 3, "c", "platinum")], frozenset())},
        # Key 2 changed at 4, before its delete; key 1's change at 3 again (a replay).
        {"scd": ([row(2, 4, "y"), row(1, 3, "b"), row(3, 7, "new")], frozenset())},
    ]  # fmt: skip
    async with table_engine(engine, warehouse) as eng:
        if engine == "spark-sql":  # a MERGE cannot rebuild a history
            with pytest.raises(TableSettingsError, match="keeps its history"):
                await apply_rounds(eng, rounds[:1])
            return
        await apply_rounds(eng, rounds)

    def versions(name: str) -> list[tuple[Any, ...]]:
        rows = read_all(warehouse / name)
        return sorted((r["id"], r["__start_at"], r["__end_at"], r["name"]) for r in rows)

    assert versions("scd") == [
        (1, 1, 2, "a"), (1, 2, 3, "late"), (1, 3, None, "b"),
        (2, 1, 4, "x"), (2, 4, 5, "y"),  # closed by the delete at 5
        (3, 7, None, "new"),
    ]  # fmt: skip
    # Only a change of tier opens a version; the name changed in place.
    assert versions("scd_tier") == [(1, 1, 3, "b"), (1, 3, None, "c")]


async def test_a_sequence_of_two_columns_and_the_cli_settings(tmp_path: Path) -> None:
    """A binlog position (file, offset) compared in order; the settings by the CLI."""
    import subprocess
    import sys

    warehouse = tmp_path / "warehouse"
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "deltaflow.cli", "table", "create", "binlog",
         "--warehouse", str(warehouse), "--schema", "id:long,file:string,pos:long,v:long",
         "--key", "id", "--sequence-by", "file,pos", "--merge", "aggregate",
         "--aggregates", "v=sum", "--tombstone-retention", "2 days"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    settings = await asyncio.to_thread(read_table_settings, warehouse, "binlog")
    assert (settings.sequence_by, settings.merge, settings.aggregates) == (
        ("file", "pos"),
        "aggregate",
        (("v", "sum"),),
    )
    assert settings.tombstone_retention == 2 * 86400
    assert "merge aggregate, v sum" in done.stdout

    def at(file: str, pos: int, v: int) -> dict[str, Any]:
        return {"id": 1, "file": file, "pos": pos, "v": v}

    async with table_engine("delta-rs", warehouse) as eng:
        await (await eng.stage("binlog", ["id"], [at("b.001", 900, 1)], frozenset()))
        # A later file beats a larger offset of an earlier one; an earlier position is late.
        await (await eng.stage("binlog", ["id"], [at("b.002", 10, 2), at("b.001", 950, 100)],
                               frozenset()))  # fmt: skip
        await (await eng.stage("binlog", ["id"], [at("b.001", 990, 1000)], frozenset()))
    [row] = read_delta(warehouse / "binlog").values()
    assert (row["file"], row["pos"], row["v"]) == ("b.002", 10, 103)


@pytest.mark.parametrize("engine", ["delta-rs", "spark"], indirect=True)
async def test_a_row_breaking_a_check_constraint_is_named_when_staged(
    warehouse: Any, engine: str
) -> None:
    await asyncio.to_thread(
        deltaflow.create_table, warehouse, "checked", schema="id:long,amount:double", key="id",
        engine=creating_engine(engine),
    )  # fmt: skip
    open_table(warehouse / "checked").alter.add_constraint({"positive": "amount >= 0"})
    async with table_engine(engine, warehouse) as eng:
        rows = [{"id": 1, "amount": 1.0}, {"id": 2, "amount": -5.0}, {"id": 3, "amount": None}]
        with pytest.raises(SchemaError, match=r"item #1 .*violated CHECK constraint 'positive'"):
            await eng.stage("checked", ["id"], rows, frozenset())
        # A null is not true either (Delta's rule); a delete needs no value.
        with pytest.raises(SchemaError, match="item #0 "):
            await eng.stage("checked", ["id"], rows[2:], frozenset())
        await (await eng.stage("checked", ["id"], [*rows[:1], rows[1]], frozenset({1})))
    assert {k: r["amount"] for k, r in read_delta(warehouse / "checked").items()} == {1: 1.0}


def test_a_large_group_folds_every_key_with_its_own_changes() -> None:
    """150,000 changes of 77,000 keys in one group, folded as a ``partial`` table does: each
    key's row is its own changes after its last delete (and says it replaces the stored row
    when there was one). Arrow's groups do not always come in order of first appearance at
    this size; a fold that assumed so gave 24 keys another key's delete."""
    import random

    import pyarrow as pa

    from deltaflow.columnar import DELETE_COLUMN
    from deltaflow.tables.merging import REPLACE_COLUMN, MergeRule, fold

    rng = random.Random(3)
    rows = []
    for lsn in rng.sample(range(1, 1_500_000), 150_000):
        deleted = rng.random() < 0.1
        name = None if deleted or rng.random() < 0.5 else f"n{lsn}"
        rows.append(
            {"id": rng.randrange(100_000), "lsn": lsn, "name": name, DELETE_COLUMN: deleted}
        )
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("lsn", pa.int64()),
            ("name", pa.string()),
            (DELETE_COLUMN, pa.bool_()),
        ]
    )
    folded = fold(pa.Table.from_pylist(rows, schema=schema), ["id"], ["lsn"], MergeRule("partial"))
    want: dict[int, tuple[Any, ...]] = {}
    by_key: dict[int, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: r["lsn"]):
        by_key.setdefault(row["id"], []).append(row)
    for key, changes in by_key.items():
        last = max((i for i, r in enumerate(changes) if r[DELETE_COLUMN]), default=-1)
        if last == len(changes) - 1:
            want[key] = (True, changes[-1]["lsn"], None, False)
            continue
        after = changes[last + 1 :]
        name = next((r["name"] for r in reversed(after) if r["name"] is not None), None)
        want[key] = (False, after[-1]["lsn"], name, last >= 0)
    got = {
        r["id"]: (
            r[DELETE_COLUMN], r["lsn"], None if r[DELETE_COLUMN] else r["name"],
            bool(r.get(REPLACE_COLUMN)),
        )
        for r in folded.to_pylist()
    }  # fmt: skip
    assert got == want
