"""A table that lives for months: a node that starts reads the last checkpoint and the commits
after it, never the whole log, and still applies no batch twice (``tables/marks.py``, the
``txn`` actions); lanes idle past their retention leave the node's memory."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import deltaflow
from deltaflow import StreamerOptions
from deltaflow.tables.engine import TableEngine
from deltaflow.tables.log import commit_versions, latest_version
from deltaflow.tables.mark_store import MarkStore
from deltaflow.tables.marks import CARRIED_APP, TXN_PREFIX, LaneMarks, txn_version

from .support import StartCluster, open_table, read_all, table_engine
from .test_marks import commit

#: The local write paths: delta-rs (appends, MERGE, merge-on-read) and Spark (its direct writer,
#: and its SQL writer, whose marks follow the MERGE in a commit of their own).
ENGINES = ("delta-rs", "delta-rs-dv", "spark", "spark-sql")


async def write(eng: TableEngine, table: str, lane: str, seqs: range, key: list[str]) -> None:
    """One commit per batch ``seq`` of ``lane``: rows ``seq * 10 ..`` (ten of them)."""
    for seq in seqs:
        rows = [{"id": seq * 10 + i, "v": seq} for i in range(10)]
        await (await eng.stage(table, key, rows, frozenset(), mark=(lane, (seq, 0))))


def forget_the_log_before_a_checkpoint(path: Path) -> int:
    """A checkpoint at the latest version, and every commit file before it deleted (as log
    clean-up does after ``delta.logRetentionDuration``); the checkpoint's version."""
    table = open_table(path)
    table.create_checkpoint()
    version = int(table.version())
    for old in range(version):
        (path / "_delta_log" / f"{old:020d}.json").unlink()
    return version


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("key", [[], ["id"]], ids=["append", "upsert"])
async def test_a_replay_after_a_restart_is_skipped_when_its_marks_are_only_in_a_checkpoint(
    warehouse: Path, engine: str, key: list[str]
) -> None:
    """Batches 0-5 of a lane land; the table is checkpointed and its commit files deleted. A
    new node (nothing in memory) gets the replay of batches 3-5 and new batches 6-7: the
    replay is skipped, from the marks the checkpoint carries, and every row lands once."""
    if engine.startswith("spark") and key == []:
        pytest.skip("appends take the same commit paths as upserts on Spark")
    lane = "nightly-1/abc/7"
    async with table_engine(engine, warehouse) as eng:
        await write(eng, "kept", lane, range(6), key)
    checkpointed = forget_the_log_before_a_checkpoint(warehouse / "kept")
    # Independently of deltaflow: delta-rs reads the lane's mark from the checkpoint.
    table = open_table(warehouse / "kept")
    assert table.transaction_version(TXN_PREFIX + lane) == txn_version((5, 0))
    assert table.transaction_version(CARRIED_APP) == 1
    async with table_engine(engine, warehouse) as eng:
        await write(eng, "kept", lane, range(3, 8), key)
    ids = Counter(r["id"] for r in read_all(warehouse / "kept"))
    assert ids == Counter(range(80)), (
        f"{80 - len(ids)} rows lost, {sum(ids.values()) - len(ids)} written twice "
        f"(checkpoint at version {checkpointed})"
    )


def test_a_starting_node_reads_the_checkpoint_and_the_commits_from_it_on(tmp_path: Path) -> None:
    """Marks carried by a checkpoint's ``txn`` actions count; commits before the checkpoint
    are not read (here: they hold a mark the checkpoint does not, which must stay unseen); a
    commitInfo mark of the checkpoint's own commit, carried by no txn, counts too."""
    commit(tmp_path, 0, lanes={"old/0": (9, 0)})
    commit(tmp_path, 1, lanes={"s/0": (1, 0)})
    write_checkpoint(tmp_path, 2, {"s/0": (1, 0)}, carried=True)
    commit(tmp_path, 2, lanes={"q/0": (4, 0)})  # its commitInfo only (the SQL writer's)
    commit(tmp_path, 3, lanes={"s/0": (2, 0)})
    marks = LaneMarks(tmp_path)
    marks.refresh()
    assert marks.started_at == 2 and marks.scanned == 3
    assert marks.applied("s/0", (2, 0)) and not marks.applied("s/0", (3, 0))
    assert marks.applied("q/0", (4, 0))
    assert not marks.applied("old/0", (0, 0)), "a commit before the checkpoint was read"
    # The mark no txn carries goes into the next commit's txn actions; the table needs no
    # second "carried" txn.
    carried = {a["txn"]["appId"]: a["txn"]["version"] for a in marks.carrying({"s/0": (3, 0)})}
    assert carried == {"deltaflow:q/0": txn_version((4, 0)), "deltaflow:s/0": txn_version((3, 0))}


def test_a_table_written_before_txn_marks_is_read_whole_and_carried_once(tmp_path: Path) -> None:
    """A checkpoint without the ``deltaflow`` txn (a table written before this format): its
    log is read whole, and the next commit carries every lane's mark and says so; once that
    commit is read, the table counts as carried."""
    commit(tmp_path, 0, lanes={"a/0": (3, 1)})
    commit(tmp_path, 1, lanes={"b/5": (7, 0)})
    write_checkpoint(tmp_path, 1, {}, carried=False)
    commit(tmp_path, 2, lanes={"a/0": (4, 0)})
    marks = LaneMarks(tmp_path)
    marks.refresh()
    assert marks.started_at is None and marks.applied("b/5", (7, 0))
    actions = marks.carrying({})
    assert {a["txn"]["appId"]: a["txn"]["version"] for a in actions} == {
        "deltaflow:a/0": txn_version((4, 0)),
        "deltaflow:b/5": txn_version((7, 0)),
        CARRIED_APP: 1,
    }
    commit(tmp_path, 3, *actions, lanes={})
    marks.refresh()
    assert marks.carried and marks.carrying({}) == []


def test_idle_lanes_leave_memory_after_their_retention_and_not_before(tmp_path: Path) -> None:
    """A stream's lane stays for the table's txn retention (7 days here), a random id's lane
    (``~``) for ``random_marks_seconds`` (an hour): both after their last commit."""
    day = 86_400.0
    now = [1_700_000_000.0]
    ms = int(now[0] * 1000)
    commit(tmp_path, 0, lanes={"s/0": (1, 0), "~r/0": (1, 0)}, timestamp=ms)
    marks = LaneMarks(tmp_path, clock=lambda: now[0])
    marks.refresh()
    assert len(marks) == 2
    now[0] += 3599
    marks.refresh()
    assert marks.applied("~r/0", (1, 0)), "a random id's lane expired before its hour"
    now[0] += 120
    marks.refresh()
    assert not marks.applied("~r/0", (1, 0)) and marks.applied("s/0", (1, 0))
    now[0] += 6 * day
    marks.refresh()
    assert marks.applied("s/0", (1, 0)), "a stream's lane expired before its 7 days"
    now[0] += day
    marks.refresh()
    assert len(marks) == 0
    # A checkpoint's txn actions past their retention are not loaded at all.
    other = tmp_path / "other"
    commit(other, 0, lanes={})
    write_checkpoint(other, 0, {"s/0": (1, 0)}, carried=True, last_updated=ms)
    fresh = LaneMarks(other, clock=lambda: now[0])
    fresh.refresh()
    assert fresh.started_at == 0 and len(fresh) == 0


def test_a_node_finds_new_commits_by_name_and_never_lists_a_long_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commits after a known version, and a starting node's commits from the last
    checkpoint on, are found by name: the cost follows the new commits, not the month of
    commits a log directory keeps. Only a reader whose version the clean-up passed lists it."""
    for version in range(8):
        commit(tmp_path, version, lanes={})
    write_checkpoint(tmp_path, 5, {}, carried=True)
    log = tmp_path / "_delta_log"
    with monkeypatch.context() as listing:
        listing.setattr(Path, "iterdir", _no_listing)
        assert commit_versions(tmp_path) == [5, 6, 7]
        assert latest_version(tmp_path) == 7 and latest_version(tmp_path, 7) == 7
        assert commit_versions(tmp_path, 2) == [3, 4, 5, 6, 7]
        assert commit_versions(tmp_path, 7) == []
        commit(tmp_path, 8, lanes={})
        assert commit_versions(tmp_path, 7) == [8] and latest_version(tmp_path, 6) == 8
    # Every kept commit when asked, and a version the clean-up passed: a listing says.
    assert commit_versions(tmp_path, every=True) == list(range(9))
    for old in range(4):
        (log / f"{old:020d}.json").unlink()
    assert commit_versions(tmp_path, 1) == [4, 5, 6, 7, 8]
    assert commit_versions(tmp_path, every=True) == [4, 5, 6, 7, 8]


def test_a_table_kept_open_is_opened_afresh_from_a_newer_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """delta-rs keeps what each incremental update read (about 55 KB a commit): a node's kept
    table is opened again from the newest checkpoint once it is REOPEN_AFTER versions old, so
    its memory follows the commits since the checkpoint, not the months it has been open. A
    table that writes no checkpoint costs a look at ``_last_checkpoint`` per REOPEN_LOOK
    versions, not one per commit."""
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    import deltaflow.tables.log_reader as log_reader
    from deltaflow.tables.log_reader import REOPEN_AFTER, REOPEN_LOOK, LogReader

    def append(value: int) -> None:
        write_deltalake(str(tmp_path), pa.table({"id": [value]}), mode="append")

    # Checkpoints by hand only (delta-rs would write one at version 100 itself).
    write_deltalake(
        str(tmp_path), pa.table({"id": [0]}), configuration={"delta.checkpointInterval": "1000"}
    )
    looks: list[Any] = []
    look = log_reader.last_checkpoint_version
    monkeypatch.setattr(log_reader, "last_checkpoint_version", lambda d: looks.append(d) or look(d))
    reader = LogReader()
    kept = reader.latest(tmp_path)
    for i in range(1, REOPEN_AFTER + REOPEN_LOOK):
        append(i)
        assert reader.latest(tmp_path) is kept, "no checkpoint since: brought up to date"
    assert len(looks) == 1, "_last_checkpoint read at every commit"
    DeltaTable(str(tmp_path)).create_checkpoint()
    append(-1)
    fresh = reader.latest(tmp_path)
    version = REOPEN_AFTER + REOPEN_LOOK
    assert fresh is not kept and fresh.version() == version and len(looks) == 2
    assert len(fresh.to_pyarrow_table()) == version + 1
    append(-2)
    assert reader.latest(tmp_path) is fresh, "opened at the checkpoint: kept again"


def test_a_description_holds_across_commits_that_change_no_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table's schema and properties, once read, are read again only when a later commit
    changes them: a failover's new committer describes a long-lived table without loading it."""
    import pyarrow as pa
    from deltalake import write_deltalake

    import deltaflow.tables.log_reader as log_reader

    write_deltalake(
        str(tmp_path), pa.table({"id": [0]}), configuration={"delta.appendOnly": "false"}
    )
    reader = log_reader.LogReader()
    assert reader.describe(tmp_path).properties == {"delta.appendOnly": "false"}
    loads: list[Path] = []
    latest = reader.latest
    monkeypatch.setattr(reader, "latest", lambda p, *a: loads.append(p) or latest(p, *a))
    for i in range(1, 6):
        write_deltalake(str(tmp_path), pa.table({"id": [i]}), mode="append")
    assert reader.describe(tmp_path).schema.names == ["id"] and loads == []
    more = pa.table({"id": [6], "v": [1.0]})
    write_deltalake(str(tmp_path), more, mode="append", schema_mode="merge")
    assert reader.describe(tmp_path).schema.names == ["id", "v"] and loads == [tmp_path]


def _no_listing(self: Path) -> Any:
    raise AssertionError(f"{self} was listed")


def test_a_node_s_readers_of_a_table_share_one_mark_per_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner's side and the committer of one table on a node keep one store of marks: a
    checkpoint's marks are read once, a lane costs one entry, and a mark only rises whichever
    reader keeps it (a lower one kept later never hides a batch the table holds)."""
    import deltaflow.tables.marks as marks_module

    now = 1_700_000_000_000
    commit(tmp_path, 0, lanes={})
    write_checkpoint(tmp_path, 0, {"s/0": (5, 0), "~r/1": (7, 1)}, carried=True, last_updated=now)
    commit(tmp_path, 1, lanes={"s/2": (1, 0)}, timestamp=now)
    store = MarkStore()
    owner = LaneMarks(tmp_path, store=store, clock=lambda: now / 1000)
    owner.refresh()
    monkeypatch.setattr(marks_module, "checkpoint_txns", _read_twice)
    committer = LaneMarks(tmp_path, history=8, store=store, clock=lambda: now / 1000)
    committer.refresh()
    assert committer.started_at == 0 and committer.scanned == 1
    assert committer.applied("~r/1", (7, 1)) and committer.applied("s/2", (1, 0))
    assert len(store) == len(owner) == len(committer) == 3
    committer.absorb({"s/0": (9, 0)})
    owner.absorb({"s/0": (6, 0)})
    assert owner.applied("s/0", (9, 0)) and not owner.applied("s/0", (10, 0))
    # A newer checkpoint the store has read every commit up to (a failover's new committer,
    # which as an owner read on): its marks are not read again.
    commit(tmp_path, 2, {"txn": {"appId": TXN_PREFIX + "s/3", "version": 4}}, timestamp=now)
    commit(tmp_path, 3, lanes={}, timestamp=now)
    owner.refresh()
    write_checkpoint(tmp_path, 2, {"s/0": (5, 0), "~r/1": (7, 1), "s/3": (0, 4)}, carried=True)
    successor = LaneMarks(tmp_path, store=store, clock=lambda: now / 1000)
    successor.refresh()
    assert successor.started_at == 2 and successor.scanned == 3
    assert successor.applied("s/3", (0, 4)) and successor.applied("s/0", (9, 0))


def _read_twice(checkpoint: Path) -> Any:
    raise AssertionError(f"{checkpoint}'s txn actions were read twice")


def write_checkpoint(
    table: Path,
    version: int,
    lanes: dict[str, tuple[int, int]],
    *,
    carried: bool,
    last_updated: int = 0,
) -> None:
    """A classic checkpoint at ``version`` holding only ``txn`` actions, and the
    ``_last_checkpoint`` that names it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    txns = [
        {"appId": TXN_PREFIX + lane, "version": txn_version(mark), "lastUpdated": last_updated}
        for lane, mark in lanes.items()
    ]
    if carried:
        txns.append({"appId": CARRIED_APP, "version": 1, "lastUpdated": last_updated})
    log = table / "_delta_log"
    txn_type = pa.struct(
        [("appId", pa.string()), ("version", pa.int64()), ("lastUpdated", pa.int64())]
    )
    add_type = pa.struct([("path", pa.string())])
    rows = pa.table(
        {"txn": pa.array(txns, txn_type), "add": pa.array([None] * len(txns), add_type)}
    )
    pq.write_table(rows, log / f"{version:020d}.checkpoint.parquet")
    (log / "_last_checkpoint").write_text(json.dumps({"version": version, "size": len(txns)}))


def txn_lanes(path: Path) -> dict[str, int]:
    """The lane marks the table's snapshot holds as txn actions, by delta-rs."""
    out: dict[str, int] = {}
    for name in sorted((path / "_delta_log").glob("*.json")):
        for line in name.read_text().splitlines():
            action: dict[str, Any] = json.loads(line)
            if "txn" in action and action["txn"]["appId"].startswith(TXN_PREFIX):
                out[action["txn"]["appId"][len(TXN_PREFIX) :]] = action["txn"]["version"]
    return out


async def test_a_cluster_restarted_on_a_checkpointed_table_skips_a_replay(
    start_cluster: StartCluster, warehouse: Path
) -> None:
    """Two nodes append 3,000 rows under a stream id (through the table's committer, many
    groups per version), and a stream with a random id appends 500 more. The table is
    checkpointed and its commit files deleted; two new nodes get the named stream's replay
    (the same items, so the same batches) and a new stream's 1,000 rows: each row lands once.
    The random id's lanes are marked as such."""
    append = {"receiver": "deltaflow.testing.AppendRows", "receiver_args": {"table": "log"}}
    options = StreamerOptions(page_size=100, auto_flush_interval=0.0)
    nodes = await start_cluster(warehouse, engine="delta-rs")
    async with deltaflow.connect([n.address for n in nodes]) as client:
        first = [{"id": i} for i in range(3000)]
        await client.stream_data(first, key="id", options=options, stream_id="orders", **append)
        other = [{"id": -1 - i} for i in range(500)]
        await client.stream_data(other, key="id", options=options, **append)
    for node in nodes:
        await node.stop()
    lanes = txn_lanes(warehouse / "log")
    assert lanes and all(lane.startswith(("orders/", "~")) for lane in lanes), sorted(lanes)[:5]
    assert any(lane.startswith("~") for lane in lanes) and any(
        lane.startswith("orders/") for lane in lanes
    )
    forget_the_log_before_a_checkpoint(warehouse / "log")
    nodes = await start_cluster(warehouse, engine="delta-rs")
    async with deltaflow.connect([n.address for n in nodes]) as client:
        # The same items under the same id: the same batches, every one held already.
        replay = await client.stream_data(
            first, key="id", options=options, stream_id="orders", **append
        )
        new = [{"id": 3000 + i} for i in range(1000)]
        await client.stream_data(new, key="id", options=options, stream_id="orders-2", **append)
    assert replay.items_acked == 3000
    ids = Counter(r["id"] for r in read_all(warehouse / "log"))
    assert ids == Counter([*range(4000), *(-1 - i for i in range(500))]), (
        f"{4500 - len(ids)} rows lost, {sum(ids.values()) - len(ids)} written twice"
    )


async def test_tombstones_hold_across_a_restart_whose_log_before_a_checkpoint_is_gone(
    tmp_path: Path,
) -> None:
    """A ``sequence_by`` table's deletes live in its commits only; its owners snapshot them
    once per checkpoint interval, so a node that starts after the log's clean-up still drops
    an upsert older than a delete (without the snapshot the key would come back)."""
    from .test_cdc import apply, change, table_of

    warehouse = tmp_path / "warehouse"
    path = warehouse / "cdc"
    async with table_engine("delta-rs", warehouse) as eng:
        await apply(eng, [change(1, 5, "a"), change(2, 5, "a")])
    open_table(path).alter.set_table_properties({"delta.checkpointInterval": "4"})
    async with table_engine("delta-rs", warehouse) as eng:
        await apply(eng, [change(1, 9, "")], deletes=frozenset({0}))
        for i in range(4):
            await apply(eng, [change(100 + i, 1, "x")])
    snapshots = sorted(p.name for p in (path / "_deltaflow" / "tombstones").iterdir())
    assert snapshots, "no snapshot of the tombstones was written"
    forget_the_log_before_a_checkpoint(path)
    async with table_engine("delta-rs", warehouse, node_id="t2") as eng:
        await apply(eng, [change(1, 7, "undead"), change(3, 1, "new")])
    table = table_of(warehouse)
    assert 1 not in table, "an upsert older than the delete brought the key back"
    assert table[3] == (1, "new") and table[2] == (5, "a")


def test_a_snapshot_keeps_every_tombstone_with_its_time_and_only_the_newest_two_stay(
    tmp_path: Path,
) -> None:
    """Restored deletes expire when the originals would have: after the table's tombstone
    retention, not before; a writer leaves the newest two snapshots."""
    from deltaflow.tables.sequence import Tombstones
    from deltaflow.tables.tombstone_snapshots import newest_snapshot, write_snapshot

    day_ms = 86_400_000
    held = Tombstones()
    held.absorb({"keys": [1, [2, "b"]], "seqs": [9, [3, 4]]}, 10 * day_ms)
    held.absorb({"keys": [1], "seqs": [7]}, 11 * day_ms)
    for version in (100, 200, 300):
        assert write_snapshot(tmp_path, version, held)
    assert not write_snapshot(tmp_path, 300, Tombstones()), "a snapshot was replaced"
    names = sorted(p.name for p in (tmp_path / "_deltaflow" / "tombstones").iterdir())
    assert names == [f"{v:020d}.json" for v in (200, 300)]
    # A newer file that is not a snapshot is passed over, not a failed start.
    (tmp_path / "_deltaflow" / "tombstones" / f"{400:020d}.json").write_text("[]")
    found = newest_snapshot(tmp_path)
    assert found is not None and found[0] == 300
    restored = Tombstones()
    for deleted in found[1]:
        restored.absorb(deleted, deleted["at"])
    assert restored.by_time() == held.by_time() and len(restored) == 2
    restored.expire(7 * 86_400, now=(17 * day_ms - 1000) / 1000)
    assert len(restored) == 2, "a tombstone expired before its retention"
    restored.expire(7 * 86_400, now=(18 * day_ms + 61_000) / 1000)
    assert len(restored) == 0


async def test_a_node_forgets_a_random_id_s_marks_when_its_client_closes_the_stream(
    warehouse: Path, start_cluster: StartCluster
) -> None:
    """Only the client of a stream whose id it made up could resend its batches, and it closes
    the stream after their answers: the node's marks follow the streams open, not the streams
    it served. A named stream's marks stay (its batches may be replayed), and skip a replay."""
    import asyncio

    [node] = await start_cluster(warehouse, count=1, engine="delta-rs", partitions=4)
    async with deltaflow.connect([node.address]) as client:
        await client.stream_data([{"id": 1, "v": 1.0}], table="other", key="id", stream_id="o")
        for i in range(12):
            await client.stream_data([{"id": i, "v": 1.0}], table="served", key="id")
        named = [{"id": 100 + i, "v": 2.0} for i in range(8)]
        await client.stream_data(named, table="served", key="id", stream_id="named")
    async with asyncio.timeout(10):  # the last close frames are still on their way
        while node.dispatcher.stats.streams:  # noqa: ASYNC110 - no event says a frame was read
            await asyncio.sleep(0.01)
    store = node.engine.mark_stores.of(warehouse / "served")
    assert store.lanes() and all(lane.startswith("named/") for lane in store.lanes())
    # Forgotten where the streams wrote, not in every table the node holds.
    other = node.engine.mark_stores.of(warehouse / "other")
    assert store.forgotten() >= 12 and other.forgotten() == 0 and len(other) >= 1
    async with deltaflow.connect([node.address]) as client:
        replay = [{"id": 100 + i, "v": 3.0} for i in range(8)]
        summary = await client.stream_data(replay, table="served", key="id", stream_id="named")
    assert summary.items_acked == 8
    rows = {r["id"]: r["v"] for r in read_all(warehouse / "served")}
    assert len(rows) == 20 and all(rows[100 + i] == 2.0 for i in range(8)), "a replay applied"


def test_a_lane_forgotten_for_good_is_not_kept_again_by_a_late_reader() -> None:
    """A reader that reads a closed random stream's last commit after the close does not bring
    its mark back, for :data:`FORGOTTEN_SECONDS`; after that the lane is a lane again."""
    import time

    from deltaflow.tables.mark_store import FORGOTTEN_SECONDS

    store = MarkStore()
    store.keep([("~a/0", 5, 1), ("s/0", 3, 1)])
    store.forget(["~a/0"])
    store.keep([("~a/0", 5, 1), ("s/0", 4, 1)])
    assert store.lanes() == ["s/0"] and store.applied("s/0", 4)
    assert store.unlogged() == ["~a/0"]
    store.forget([], now=time.monotonic() + FORGOTTEN_SECONDS + 1)
    assert store.unlogged() == [], "a lane waits to be forgotten in the log no longer"
    store.keep([("~a/0", 6, 1)])
    assert store.applied("~a/0", 6)


def test_a_commit_that_forgets_a_lane_makes_every_reader_forget_it(tmp_path: Path) -> None:
    """A ``txn`` with ``lastUpdated`` 0 forgets its lane in every node that reads the commit,
    and the node that forgot the lane first stops asking its commits to forget it."""
    store = MarkStore()
    writer = LaneMarks(tmp_path, store=store)
    reader = LaneMarks(tmp_path / "elsewhere")
    for marks in (writer, reader):
        marks.store.keep([("~r/n1/0", txn_version((3, 0)), 1), ("s/n1/0", 9, 1)])
    store.forget(["~r/n1/0"])
    carried = writer.carrying({"s/n1/0": (1, 0)}, ["~q/n2/1", "named/n2/1"])
    forgets = [a["txn"] for a in carried if a["txn"]["lastUpdated"] == 0]
    assert {t["appId"] for t in forgets} == {TXN_PREFIX + "~r/n1/0", TXN_PREFIX + "~q/n2/1"}
    for marks in (writer, reader):
        commit(marks._table, 0, *carried, lanes={"s/n1/0": (1, 0)})
        marks.refresh()
    assert reader.store.lanes() == ["s/n1/0"] and reader.store.forgotten() == 2
    assert store.unlogged() == [], "a forgotten lane is forgotten in the log once"
    assert not any(a["txn"]["lastUpdated"] == 0 for a in writer.carrying({}))


async def test_a_closed_random_streams_marks_leave_the_log_and_its_checkpoints(
    warehouse: Path, start_cluster: StartCluster
) -> None:
    """When a stream of a random id closes, the next commits of its tables forget its lanes'
    ``txn`` actions (through the table's committer, from a writer that is another node): Delta
    drops them from the snapshot and the checkpoint, so neither grows with the streams a
    cluster served. A named stream's marks stay, and still skip a replay."""
    import asyncio

    import pyarrow.parquet as pq

    nodes = await start_cluster(warehouse, count=2, engine="delta-rs", partitions=4)
    addresses = [n.address for n in nodes]
    async with deltaflow.connect(addresses) as client:
        for i in range(6):
            rows = [{"id": 10 * i + j, "v": 1.0} for j in range(10)]
            await client.stream_data(rows, table="served", key="id")
        named = [{"id": 100 + i, "v": 2.0} for i in range(10)]
        await client.stream_data(named, table="served", key="id", stream_id="named")
    async with asyncio.timeout(10):  # the last close frames are still on their way
        while any(n.dispatcher.stats.streams for n in nodes):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    path = warehouse / "served"
    random = _txn_apps(path, TXN_PREFIX + "~")
    assert len(random) >= 6, "the random streams' marks were never in the log"
    async with deltaflow.connect(addresses) as client:  # the commits that forget them
        for round_ in range(2):
            rows = [{"id": 200 + i, "v": float(round_)} for i in range(40)]
            await client.stream_data(rows, table="served", key="id", stream_id="after")
    table = open_table(path)
    assert all(table.transaction_version(app) is None for app in random)
    named_apps = _txn_apps(path, TXN_PREFIX + "named/")
    assert named_apps and all(table.transaction_version(a) is not None for a in named_apps)
    table.create_checkpoint()
    [checkpoint] = (path / "_delta_log").glob(f"{table.version():020d}.checkpoint.parquet")
    apps = {t["appId"] for t in pq.read_table(checkpoint).column("txn").to_pylist() if t}
    assert apps.isdisjoint(random) and named_apps <= apps
    async with deltaflow.connect(addresses) as client:
        summary = await client.stream_data(named, table="served", key="id", stream_id="named")
    assert summary.items_acked == 10
    assert len(read_all(path)) == 110, "a replay of the named stream was applied again"


def _txn_apps(path: Path, prefix: str) -> set[str]:
    """The ``appId`` of every ``txn`` action the table's commit files hold that starts with
    ``prefix``."""
    return {
        app
        for commit in (path / "_delta_log").glob("*.json")
        for line in commit.read_text().splitlines()
        if line.startswith('{"txn"') and (app := json.loads(line)["txn"]["appId"])
        if app.startswith(prefix)
    }
