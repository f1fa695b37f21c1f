"""The live-file listing a node keeps from new commits (``live_files.py``), against the one
delta-rs reads afresh: on log entries other writers may make, and end to end (two nodes'
table engines, merges and compactions)."""

from __future__ import annotations

import asyncio
import datetime
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from deltaflow.tables.engine import TableEngine
from deltaflow.tables.live_files import LiveFiles
from deltaflow.tables.merge_on_read import MERGE_FILES_AT

from .support import table_engine, upsert


def _table(tmp_path: Path) -> Path:
    """A table partitioned by a bucket column, one commit (version 0)."""
    path = tmp_path / "t"
    rows = pa.table({"id": pa.array([1, 2, 3], pa.int64()), "b": pa.array([0, 1, 1], pa.int32())})
    write_deltalake(str(path), rows, partition_by=["b"])
    return path


def _log(path: Path, version: int) -> list[dict[str, Any]]:
    text = (path / "_delta_log" / f"{version:020d}.json").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _commit(path: Path, version: int, actions: list[dict[str, Any]]) -> None:
    info = {"commitInfo": {"timestamp": 1, "operation": "WRITE"}}
    lines = [json.dumps(a) for a in [info, *actions]]
    (path / "_delta_log" / f"{version:020d}.json").write_text("\n".join(lines) + "\n")


def _listed(path: Path) -> LiveFiles:
    table = DeltaTable(str(path))
    files = table.get_add_actions(flatten=True)
    assert LiveFiles.understood(files, table.metadata().configuration)
    return LiveFiles(path, files, table.version())


def _rows(files: Any) -> list[dict[str, Any]]:
    return sorted(pa.table(files).to_pylist(), key=lambda row: row["path"])


def test_odd_entries_other_writers_make_are_listed_as_delta_rs_lists_them(tmp_path: Path) -> None:
    """Statistics that are JSON null, not an object or absent, an empty partition value
    (null, per the protocol) and a removed file: the kept listing is delta-rs's."""
    path = _table(tmp_path)
    index = _listed(path)
    adds = [a["add"] for a in _log(path, 0) if "add" in a]
    odd = [
        {**adds[0], "path": "b=0/odd-stats-null.parquet", "stats": "null"},
        {**adds[0], "path": "b=0/odd-stats-list.parquet", "stats": "[1]"},
        {**adds[0], "path": "b=0/odd-stats-none.parquet", "stats": None},
        {**adds[1], "path": "b=1/odd-empty.parquet", "partitionValues": {"b": ""}},
    ]
    removed = {"path": adds[1]["path"], "deletionTimestamp": 1, "dataChange": True}
    _commit(path, 1, [{"remove": removed}, *({"add": a} for a in odd)])
    assert index.advance(1)
    assert index.version == 1
    ours = _rows(index.files)
    theirs = _rows(DeltaTable(str(path)).get_add_actions(flatten=True))
    # delta-rs drops the statistics of a file with a null partition value; this listing keeps
    # those of its log entry. Everything else is alike.
    empty = [i for i, row in enumerate(theirs) if row["path"] == "b=1/odd-empty.parquet"]
    assert [ours[i]["partition.b"] for i in empty] == [None]
    assert [r for i, r in enumerate(ours) if i not in empty] == [
        r for i, r in enumerate(theirs) if i not in empty
    ]


def test_it_declines_what_it_cannot_follow(tmp_path: Path) -> None:
    """A log that restarted, a missing commit file, a metadata change and a malformed action
    each make it decline (the node lists through delta-rs again); it never raises."""
    path = _table(tmp_path)
    write_deltalake(str(path), pa.table({"id": [4], "b": pa.array([0], pa.int32())}), mode="append")
    assert not _at(path, 1).advance(0)  # the log is older than what it holds: made again
    assert not _at(path, 1).advance(2)  # version 2 does not exist
    _commit(path, 2, [next(a for a in _log(path, 0) if "metaData" in a)])
    assert not _at(path, 1).advance(2)
    _commit(path, 3, [{"add": {"partitionValues": {"b": "0"}}}])  # an add without a path
    assert not _at(path, 2).advance(3)
    assert _at(path, 2).advance(2)  # nothing new: the listing stands


def _at(path: Path, version: int) -> LiveFiles:
    """The listing as of ``version``, read by delta-rs."""
    return LiveFiles(
        path, DeltaTable(str(path), version=version).get_add_actions(flatten=True), version
    )


def _listing(files: Any) -> list[dict[str, Any]]:
    return sorted(pa.table(files).to_pylist(), key=lambda row: row["path"])


@pytest.mark.parametrize("engine", ["delta-rs", "delta-rs-dv", "spark-dv"])
async def test_the_live_files_kept_from_new_commits_are_those_delta_rs_lists(
    warehouse: Path, engine: str
) -> None:
    """A node keeps a table's live files up to date from the commits made since it listed
    them, instead of delta-rs's replay of the log at every commit. Through two nodes'
    commits (updates, deletes, tier merges), a column added to the table, and a compaction,
    the listing is the one delta-rs reads afresh: the same files, sizes, row counts, buckets
    and key statistics; a statistic it does not convert exactly (a timestamp's) may only be
    missing, which makes a file a candidate for every key."""
    path = warehouse / "listed"

    def same_as_delta_rs(eng: TableEngine) -> None:  # blocking: called in a thread
        listed = eng.live_files(path)
        assert listed is not None
        ours, version = listed
        table = DeltaTable(str(path))
        assert version == table.version()
        theirs = _listing(table.get_add_actions(flatten=True))
        assert [r["path"] for r in _listing(ours)] == [r["path"] for r in theirs]
        for mine, real in zip(_listing(ours), theirs, strict=True):
            assert mine.keys() == real.keys()
            for column, value in mine.items():
                if value != real[column]:  # only a statistic not converted may be missing
                    assert value is None and column in ("min.ts", "max.ts"), (column, real)

    moment = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    async with (
        table_engine(engine, warehouse, schema_evolution=True) as first,
        table_engine(engine, warehouse, node_id="t2", schema_evolution=True) as second,
    ):
        for n in range(3 * MERGE_FILES_AT):
            eng = (first, second)[n % 2]
            rows = [{"id": i, "name": f"r{n}", "ts": moment} for i in range(n, n + 40)]
            await upsert(eng, "listed", rows, frozenset(range(0, 40, 9)))
            if n % 4 == 3:
                await asyncio.to_thread(same_as_delta_rs, eng)
        assert first.log.keeps(path) and second.log.keeps(path)  # not listed afresh
        await upsert(first, "listed", [{"id": 7, "name": "x", "ts": moment, "extra": 1.5}])
        await asyncio.to_thread(same_as_delta_rs, second)
        await asyncio.to_thread(DeltaTable(str(path)).optimize.compact)
        await asyncio.to_thread(same_as_delta_rs, first)
        await asyncio.to_thread(same_as_delta_rs, second)
