"""Per-column sequences (docs/cdc.md, "Merge modes"): on a ``sequence_by`` table with
``merge="partial"`` (or ``aggregate``'s ``last_non_null`` columns) a column keeps the value of
the newest change that set it, whatever order the changes arrive in and however they are
grouped; a delete nulls what was set before it. Every write path of tests/test_cdc.py."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

import deltaflow
from deltaflow.errors import SchemaError

from .support import creating_engine, read_all, read_delta, table_engine
from .test_cdc import cdc_engine

__all__ = ["cdc_engine"]  # the engine fixture: every write path

COLUMNS = ("name", "email", "phone")
SCHEMA = "id:long,lsn:long,name:string,email:string,phone:string"


async def create(warehouse: Any, engine: str, name: str, **settings: Any) -> None:
    await asyncio.to_thread(
        deltaflow.create_table, warehouse, name, schema=SCHEMA, key="id", sequence_by="lsn",
        deletion_vectors=engine.endswith("-dv"), engine=creating_engine(engine), **settings,
    )  # fmt: skip


async def groups(eng: Any, table: str, *batches: list[Any]) -> None:
    """Each batch a group of its own, committed before the next: ``Delete``s delete."""
    for batch in batches:
        deletes = frozenset(i for i, c in enumerate(batch) if isinstance(c, deltaflow.Delete))
        rows = [c.item if isinstance(c, deltaflow.Delete) else c for c in batch]
        await (await eng.stage(table, ["id"], rows, deletes, sequence=("lsn",)))


def rows(warehouse: Any, table: str, *columns: str) -> dict[int, tuple[Any, ...]]:
    return {k: tuple(r[c] for c in columns) for k, r in read_delta(warehouse / table).items()}


async def test_a_partial_change_sets_its_columns_in_any_arrival_order(
    warehouse: Any, engine: str
) -> None:
    """The issue's case: ``{lsn 10: email}`` and ``{lsn 5: phone}`` keep both, in one group,
    in two (either order); an older change does not undo a newer one's column; a delete nulls
    only what was set before it; a null set on purpose counts as a change of its column."""
    for name in ("together", "apart", "reversed"):
        await create(warehouse, engine, name, merge="partial")
    newer = {"id": 1, "lsn": 10, "email": "new@"}
    older = {"id": 1, "lsn": 5, "phone": "555", "email": "old@"}
    async with table_engine(engine, warehouse) as eng:
        await groups(eng, "together", [newer, older])
        await groups(eng, "apart", [newer], [older])
        await groups(eng, "reversed", [older], [newer])
        for table in ("together", "apart", "reversed"):
            assert rows(warehouse, table, "lsn", "email", "phone") == {1: (10, "new@", "555")}
        # A delete at 7, arriving late: the row stays (lsn 10) with what was set after 7.
        await groups(eng, "apart", [deltaflow.Delete({"id": 1, "lsn": 7})])
        assert rows(warehouse, "apart", "lsn", "email", "phone") == {1: (10, "new@", None)}
        # ... and a change older than that delete sets nothing again.
        await groups(eng, "apart", [{"id": 1, "lsn": 6, "phone": "666", "name": "n"}])
        # A null on purpose at 12 and a later-arriving value at 11: the null is newer.
        await groups(
            eng, "apart", [deltaflow.set_null({"id": 1, "lsn": 12}, "email")],
            [{"id": 1, "lsn": 11, "email": "mid@", "name": "N"}],
        )  # fmt: skip
        assert rows(warehouse, "apart", "lsn", "name", "email", "phone") == {
            1: (12, "N", None, None)
        }


async def test_aggregate_tables_order_their_last_non_null_columns(
    warehouse: Any, engine: str
) -> None:
    """``last_non_null`` columns of an ``aggregate`` table follow their own sequence; a sum
    counts a change once, and not one older than the row (a replay would count it twice)."""
    await asyncio.to_thread(
        deltaflow.create_table, warehouse, "agg", schema="id:long,lsn:long,total:long,label:string",
        key="id", sequence_by="lsn", merge="aggregate", aggregates={"total": "sum"},
        deletion_vectors=engine.endswith("-dv"), engine=creating_engine(engine),
    )  # fmt: skip
    async with table_engine(engine, warehouse) as eng:
        await groups(eng, "agg", [{"id": 1, "lsn": 10, "total": 1, "label": "ten"}])
        await groups(eng, "agg", [{"id": 1, "lsn": 4, "total": 2, "label": "four"}])
        await groups(eng, "agg", [{"id": 1, "lsn": 12, "total": 3}])
        await groups(
            eng, "agg", [{"id": 2, "lsn": 9, "total": 1}, {"id": 2, "lsn": 3, "label": "x"}]
        )
    assert rows(warehouse, "agg", "lsn", "total", "label") == {1: (12, 4, "ten"), 2: (9, 1, "x")}


async def test_a_column_added_later_gets_its_own_sequence(warehouse: Any, engine: str) -> None:
    """A column a write adds (schema evolution) carries its sequence like the others."""
    await create(warehouse, engine, "grown", merge="partial", allow_schema_evolution=True)
    async with table_engine(engine, warehouse) as eng:
        await groups(eng, "grown", [{"id": 1, "lsn": 10, "email": "e@", "city": "Lyon"}])
        await groups(eng, "grown", [{"id": 1, "lsn": 5, "city": "Paris", "phone": "5"}])
    assert rows(warehouse, "grown", "lsn", "email", "phone", "city") == {1: (10, "e@", "5", "Lyon")}
    assert "_deltaflow_seq_city" in read_all(warehouse / "grown")[0]
    # Tables made without a column that keeps its last value: the ones they gain carry theirs.
    await asyncio.to_thread(
        deltaflow.create_table, warehouse, "bare", schema="id:long,lsn:long", key="id",
        sequence_by="lsn", merge="partial", allow_schema_evolution=True,
        deletion_vectors=engine.endswith("-dv"), engine=creating_engine(engine),
    )  # fmt: skip
    await asyncio.to_thread(
        deltaflow.create_table, warehouse, "sums", schema="id:long,lsn:long,total:long",
        key="id", sequence_by="lsn", merge="aggregate", aggregates={"total": "sum"},
        allow_schema_evolution=True, deletion_vectors=engine.endswith("-dv"),
        engine=creating_engine(engine),
    )  # fmt: skip
    async with table_engine(engine, warehouse) as eng:
        for table in ("bare", "sums"):
            await groups(eng, table, [{"id": 1, "lsn": 10, "email": "e@"}])
            await groups(eng, table, [{"id": 1, "lsn": 5, "email": "old@", "phone": "5"}])
    assert rows(warehouse, "bare", "lsn", "email", "phone") == {1: (10, "e@", "5")}
    assert rows(warehouse, "sums", "lsn", "email", "phone") == {1: (10, "e@", "5")}


def random_feed(rng: random.Random, keys: int, changes: int) -> list[Any]:
    """Changes to ``keys`` rows, each setting some of the columns (a value, or a null on
    purpose) or deleting its key; sequences unique per key."""
    feed: list[Any] = []
    for lsn in rng.sample(range(1, 10 * changes), changes):
        key = rng.randrange(keys)
        if rng.random() < 0.12:
            feed.append(deltaflow.Delete({"id": key, "lsn": lsn}))
            continue
        row: dict[str, Any] = {"id": key, "lsn": lsn}
        row.update({c: f"{c}{lsn}" for c in COLUMNS if rng.random() < 0.5})
        if row.keys() - {"id", "lsn"} and rng.random() < 0.15:
            row = deltaflow.set_null(row, rng.choice(sorted(row.keys() - {"id", "lsn"})))
        feed.append(row)
    return feed


def reference(feed: list[Any]) -> dict[int, tuple[Any, ...]]:
    """Each key as its changes leave it, applied in sequence order: a change sets its columns
    (a null on purpose included), a delete ends the row."""
    from deltaflow.columnar import NULLS_COLUMN

    out: dict[int, dict[str, Any]] = {}
    for change in sorted(feed, key=lambda c: getattr(c, "item", c)["lsn"]):
        if isinstance(change, deltaflow.Delete):
            out.pop(change.item["id"], None)
            continue
        row = out.setdefault(change["id"], {c: None for c in COLUMNS})
        row.update({c: v for c, v in change.items() if c != NULLS_COLUMN and v is not None})
        row.update({c: None for c in change.get(NULLS_COLUMN) or ()})
    return {k: (r["lsn"], *(r[c] for c in COLUMNS)) for k, r in out.items()}


async def test_a_shuffled_feed_of_partial_changes_ends_as_applied_in_order(
    warehouse: Any, engine: str
) -> None:
    """Changes setting random columns, shuffled, in groups of random sizes (several batches
    folding together at times): the table ends at the changes applied in sequence order."""
    seeds = (1, 2, 3) if engine.startswith("delta-rs") else (1,)
    async with table_engine(engine, warehouse) as eng:
        for seed in seeds:
            rng = random.Random(seed)
            table = f"shuffled{seed}"
            await create(warehouse, engine, table, merge="partial")
            feed = random_feed(rng, keys=25, changes=160)
            arrival = feed[:]
            rng.shuffle(arrival)
            while arrival:
                take = [arrival.pop() for _ in range(min(len(arrival), rng.randint(1, 24)))]
                cut = rng.randint(0, len(take))  # two batches, staged together: one group
                staged = [
                    await eng.stage(table, ["id"], *_batch(part), sequence=("lsn",))
                    for part in (take[:cut], take[cut:])
                    if part
                ]
                await asyncio.gather(*staged)
            assert rows(warehouse, table, "lsn", *COLUMNS) == reference(feed), f"seed {seed}"


def _batch(changes: list[Any]) -> tuple[list[Any], frozenset[int]]:
    deletes = frozenset(i for i, c in enumerate(changes) if isinstance(c, deltaflow.Delete))
    return [getattr(c, "item", c) for c in changes], deletes


@pytest.mark.parametrize("kind", ["date", "timestamp", "string"])
async def test_a_deleted_key_changes_again_under_any_sequence_type(
    warehouse: Any, kind: str
) -> None:
    """A key deleted and then changed again, sequenced by a date, a timestamp or text: the
    recorded delete floors the new row's columns in the sequence's own type."""
    import datetime as dt

    def at(day: int) -> Any:
        return {
            "date": dt.date(2024, 1, day),
            "timestamp": dt.datetime(2024, 1, day, tzinfo=dt.UTC),
            "string": f"2024-01-{day:02}",
        }[kind]

    table, schema = f"t_{kind}", f"id:long,at:{kind},email:string,phone:string"
    await asyncio.to_thread(
        deltaflow.create_table, warehouse, table, schema=schema, key="id", sequence_by="at",
        merge="partial", engine=creating_engine("delta-rs"),
    )  # fmt: skip
    async with table_engine("delta-rs", warehouse) as eng:
        for batch in (
            [{"id": 1, "at": at(1), "email": "a@"}, {"id": 2, "at": at(1), "email": "b@"}],
            [deltaflow.Delete({"id": 1, "at": at(5)})],
            [{"id": 1, "at": at(9), "phone": "555"}, {"id": 2, "at": at(3), "phone": "666"}],
            [{"id": 1, "at": at(4), "email": "old@"}],  # older than the delete: changes nothing
        ):
            rows_, deletes = _batch(batch)
            await (await eng.stage(table, ["id"], rows_, deletes, sequence=("at",)))
    assert rows(warehouse, table, "at", "email", "phone") == {
        1: (at(9), None, "555"),
        2: (at(3), "b@", "666"),
    }


async def test_a_column_s_own_sequence_is_deltaflow_s_to_set(warehouse: Any) -> None:
    """The columns holding the sequences are refused in rows (a forged sequence would pin a
    value) and in a schema of ``create_table``; so are a group's working columns, also where
    new columns are allowed (a forged ``__deltaflow_replace`` would empty the row's others)."""
    await create(warehouse, "delta-rs", "t", merge="partial", allow_schema_evolution=True)
    async with table_engine("delta-rs", warehouse) as eng:
        await groups(eng, "t", [{"id": 1, "lsn": 1, "email": "e", "phone": "p"}])
        forged = {"id": 1, "lsn": 2, "email": "x", "_deltaflow_seq_email": 99}
        with pytest.raises(SchemaError, match=r"_deltaflow_seq_email.*reserves"):
            await groups(eng, "t", [forged])
        for working in ({"__deltaflow_replace": True}, {"__deltaflow_replaced_lsn": 9}):
            with pytest.raises(SchemaError, match=r"__deltaflow_replace.*reserves"):
                await groups(eng, "t", [{"id": 1, "lsn": 3, "email": "y", **working}])
    assert rows(warehouse, "t", "lsn", "email", "phone") == {1: (1, "e", "p")}
    with pytest.raises(deltaflow.errors.UsageError, match="__deltaflow_ are deltaflow's"):
        deltaflow.create_table(warehouse, "u", schema="id:long,_deltaflow_seq_x:long", key="id")
