"""A table's committer: writers prepare their groups (files written, actions pinned to the
version they read), the committer commits the groups that arrive together as one version,
sends back a group the table changed under, and answers ``applied`` to a group that already
landed (a late committer, a resend). Engines alone here, no server; the node-level behaviour
(the committer chosen by the map, its death) is tests/test_committer_cluster.py's."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from deltaflow.partitioning import partition_of
from deltaflow.tables.commit.prepared import (
    MAX_ACTIONS,
    Outcome,
    OutcomeKind,
    PreparedCommit,
    WireError,
)
from deltaflow.tables.engine import TableEngine
from deltaflow.tables.settings import DEFAULT_BUCKETS
from deltaflow.testing import at_fault_point

from .support import Eventually, open_table, read_all, read_delta, table_engine


@pytest.fixture(params=["delta-rs", "delta-rs-dv", "spark", "delta-rs-s3"])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


#: Keys 0-39 by the parity of their bucket (a table's keys are bucketed by partition).
EVEN = [i for i in range(40) if partition_of(i, DEFAULT_BUCKETS) % 2 == 0]
ODD = [i for i in range(40) if partition_of(i, DEFAULT_BUCKETS) % 2 == 1]


class Through:
    """A commit sink that sends every prepared group to one engine's coordinator, and
    remembers the groups and outcomes."""

    def __init__(self, committer: TableEngine) -> None:
        self.committer = committer
        self.sent: list[PreparedCommit] = []
        self.outcomes: list[Outcome] = []

    async def submit(self, prepared: PreparedCommit) -> Outcome:
        self.sent.append(prepared)
        outcome = await self.committer.committer(prepared.table).submit(prepared)
        self.outcomes.append(outcome)
        return outcome


def _last_commit(path: Any) -> dict[str, Any]:
    [entry] = open_table(path).history(1)
    return json.loads(entry["userMetadata"])["deltaflow"]


async def _stage(eng: TableEngine, rows: list[dict[str, Any]], lane: str, seq: int) -> Any:
    return await eng.stage("t", ["id"], rows, frozenset(), mark=(lane, (seq, 0)))


async def test_groups_of_two_writers_land_in_one_version(
    engine: str, warehouse: Path, eventually: Eventually
) -> None:
    # Every bucket from the first row: the writers' buckets hold different files even in a
    # table this small (with growing buckets it would be one file, and one group sent back).
    fixed = {"table_bucket_rows": 0}
    async with (
        table_engine(engine, warehouse, node_id="w1", **fixed) as first,
        table_engine(engine, warehouse, node_id="w2", **fixed) as second,
        table_engine(engine, warehouse, node_id="w3", **fixed) as third,
    ):
        await (await _stage(first, [{"id": i, "v": 0} for i in range(40)], "a/0", 0))
        for writer in (first, second, third):
            writer.commit_sink = Through(first)
        # Hold the committer's first commit until the other writers' groups have arrived.
        release, reached = threading.Event(), threading.Event()

        def hold() -> None:
            reached.set()
            release.wait(30)

        with at_fault_point("before_combined_commit", hold):
            one = await _stage(first, [{"id": 100, "v": 1}], "a/0", 1)
            await asyncio.to_thread(reached.wait, 30)
            # Each writer updates the keys of its own buckets, as partition owners do.
            two = await _stage(second, [{"id": i, "v": 2} for i in EVEN], "b/0", 0)
            three = await _stage(third, [{"id": i, "v": 3} for i in ODD], "c/0", 0)
            coordinator = first.committer("t")
            await eventually(lambda: coordinator.waiting == 2, "both groups arrived")
            release.set()
            await asyncio.wait_for(asyncio.gather(one, two, three), 60)
    path = warehouse / "t"
    assert {k: r["v"] for k, r in read_delta(path).items()} == {
        **{i: 2 for i in EVEN},
        **{i: 3 for i in ODD},
        100: 1,
    }
    last = _last_commit(path)
    assert last["node"] == "w1" and last["writers"] == ["w2", "w3"]
    assert last["lanes"] == {"b/0": [0, 0], "c/0": [0, 0]}
    assert first.stats.combined_commits == 2 and first.stats.combined_groups == 3


async def test_a_group_whose_files_were_replaced_meanwhile_is_prepared_again(
    engine: str, warehouse: Path
) -> None:
    """Both writers update keys in the same files (a partition moved between them): the
    second's group was prepared against files the first's commit replaced; it is sent back,
    prepared again, and both updates land."""
    async with (
        table_engine(engine, warehouse, node_id="w1") as first,
        table_engine(engine, warehouse, node_id="w2") as second,
    ):
        await (await _stage(first, [{"id": i, "v": 0} for i in range(40)], "a/0", 0))
        first.commit_sink = sink = Through(first)
        second.commit_sink = Through(first)
        done = 0

        def first_commits_first() -> None:
            nonlocal done
            if threading.current_thread().name.startswith("deltaflow") and done == 0:
                done = 1
                fut = asyncio.run_coroutine_threadsafe(
                    _commit_now(first, [{"id": i, "v": 1} for i in range(0, 40, 2)]), loop
                )
                fut.result(60)

        loop = asyncio.get_running_loop()
        with at_fault_point("commit_prepared", first_commits_first):
            await asyncio.wait_for(
                await _stage(second, [{"id": i, "v": 2} for i in range(1, 40, 2)], "b/0", 0), 60
            )
    assert {k: r["v"] for k, r in read_delta(warehouse / "t").items()} == {
        i: 1 if i % 2 == 0 else 2 for i in range(40)
    }
    kinds = [o.kind for o in sink.outcomes]
    assert OutcomeKind.RETRY in [o.kind for o in second.commit_sink.outcomes]  # type: ignore[union-attr]
    assert kinds.count(OutcomeKind.COMMITTED) >= 1


async def _commit_now(eng: TableEngine, rows: list[dict[str, Any]]) -> None:
    await (await _stage(eng, rows, "a/0", 1))


@pytest.mark.parametrize("engine", ["delta-rs-s3", "spark-s3"], indirect=True)
async def test_a_late_committer_finds_the_group_applied(engine: str, warehouse: Path) -> None:
    """Two committers get the same prepared group (a writer resent it when the first stopped
    answering): the second commits it; the first, paused after reading the marks, finds the
    version it planned taken, reads again and answers ``applied``; the rows land once. (On a
    store: in a local warehouse the paused committer holds the table's lock, and the next
    waits for it.)"""
    async with (
        table_engine(engine, warehouse, node_id="w1") as writer,
        table_engine(engine, warehouse, node_id="c1") as late,
        table_engine(engine, warehouse, node_id="c2") as next_,
    ):
        await (await writer.stage("t", [], [{"id": -1}], frozenset(), mark=("a/0", (0, 0))))
        captured = Capture()
        writer.commit_sink = captured
        staged = await writer.stage(
            "t", [], [{"id": i} for i in range(10)], frozenset(), mark=("a/0", (1, 0))
        )
        prepared = await captured.arrived
        release, reached = threading.Event(), threading.Event()

        def pause() -> None:
            if not reached.is_set():  # the first committer to get there: the late one
                reached.set()
                release.wait(30)

        with at_fault_point("before_combined_commit", pause):
            first = asyncio.ensure_future(late.committer("t").submit(prepared))
            assert await asyncio.to_thread(reached.wait, 60), (
                "the first committer never paused",
                first.result() if first.done() else "pending",
            )
            second = await next_.committer("t").submit(prepared)
            release.set()
            late_outcome = await asyncio.wait_for(first, 30)
        captured.answer(second)
        await asyncio.wait_for(staged, 30)
    assert second.kind is OutcomeKind.COMMITTED
    assert late_outcome.kind is OutcomeKind.APPLIED
    assert sorted(r["id"] for r in read_all(warehouse / "t")) == list(range(-1, 10))


async def _captured(eng: TableEngine, seq: int, ids: range) -> PreparedCommit:
    """The group ``eng`` prepares for appending ``ids`` as batch ``seq`` of lane ``a/0``."""
    captured = Capture()
    eng.commit_sink = captured
    await eng.stage("t", [], [{"id": i} for i in ids], frozenset(), mark=("a/0", (seq, 0)))
    return await asyncio.wait_for(captured.arrived, 30)


@pytest.mark.parametrize("engine", ["delta-rs"], indirect=True)
async def test_two_groups_of_one_lane_in_a_commit_apply_it_once(
    engine: str, warehouse: Path
) -> None:
    """The same lane's batch prepared twice (its old owner's group, and the new owner's after
    the client resent it) arrives in one combined commit: one is committed, the other sent
    back, and the rows land once."""
    async with (
        table_engine(engine, warehouse, node_id="w1") as writer,
        table_engine(engine, warehouse, node_id="c1") as committer,
    ):
        await (await writer.stage("t", [], [{"id": -1}], frozenset(), mark=("a/0", (0, 0))))
        prepared = await _captured(writer, 1, range(10))
        coordinator = committer.committer("t")
        outcomes = await asyncio.gather(coordinator.submit(prepared), coordinator.submit(prepared))
    assert sorted(o.kind for o in outcomes) == [OutcomeKind.COMMITTED, OutcomeKind.RETRY]
    assert sorted(r["id"] for r in read_all(warehouse / "t")) == list(range(-1, 10))


@pytest.mark.parametrize("engine", ["delta-rs"], indirect=True)
async def test_a_group_whose_lane_was_partly_applied_meanwhile_is_sent_back(
    engine: str, warehouse: Path
) -> None:
    """A group holds batches 1 and 2 of a lane; another owner's commit applied batch 1 after
    the group was prepared. The group is sent back (it would apply batch 1 again), not
    committed."""
    async with (
        table_engine(engine, warehouse, node_id="w1") as first,
        table_engine(engine, warehouse, node_id="w2") as second,
        table_engine(engine, warehouse, node_id="c1") as committer,
    ):
        await (await first.stage("t", [], [{"id": -1}], frozenset(), mark=("a/0", (0, 0))))
        one = await _captured(first, 1, range(10))
        two = await _captured(second, 2, range(10, 20))
        both = PreparedCommit(
            "t",
            "w2",
            two.read_version,
            one.actions + two.actions,
            {"a/0": (2, 0)},
            {"a/0": (1, 0)},
            rows=20,
            batches=2,
        )
        coordinator = committer.committer("t")
        assert (await coordinator.submit(one)).kind is OutcomeKind.COMMITTED
        late = await coordinator.submit(both)
    assert late.kind is OutcomeKind.RETRY, late
    assert sorted(r["id"] for r in read_all(warehouse / "t")) == list(range(-1, 10))


class Capture:
    """A commit sink that hands the test the prepared group and waits for its answer."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.arrived: asyncio.Future[PreparedCommit] = loop.create_future()
        self._outcome: asyncio.Future[Outcome] = loop.create_future()

    async def submit(self, prepared: PreparedCommit) -> Outcome:
        if not self.arrived.done():
            self.arrived.set_result(prepared)
        return await self._outcome

    def answer(self, outcome: Outcome) -> None:
        self._outcome.set_result(outcome)


# -- the wire form a committer reads from peers ---------------------------------------------


def _wire(**changes: Any) -> dict[str, Any]:
    base = PreparedCommit(
        "t",
        "w1",
        3,
        [
            {
                "add": {
                    "path": "_deltaflow_bucket=7/part-1.parquet",
                    "partitionValues": {"_deltaflow_bucket": "7"},
                    "size": 10,
                    "modificationTime": 1,
                    "dataChange": True,
                    "stats": "{}",
                }
            },
            {
                "remove": {
                    "path": "_deltaflow_bucket=7/part-0.parquet",
                    "deletionTimestamp": 1,
                    "dataChange": True,
                    "extendedFileMetadata": True,
                    "partitionValues": {"_deltaflow_bucket": "7"},
                    "size": 10,
                }
            },
        ],
        {"s1/abc/7": (4, 0)},
        {"s1/abc/7": (2, 0)},
        rows=1,
        batches=1,
    ).to_wire()
    return {**base, **changes}


def test_a_prepared_commit_crosses_the_wire_unchanged() -> None:
    data = json.loads(json.dumps(_wire(forgotten=["~r/n1/3"])))
    prepared = PreparedCommit.from_wire(data)
    assert prepared.to_wire() == _wire(forgotten=["~r/n1/3"])
    assert prepared.forgotten == ("~r/n1/3",)
    assert prepared.removes == {"_deltaflow_bucket=7/part-0.parquet"}


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("../other/part-0.parquet", "inside"),
        ("a/../../etc/passwd", "inside"),
        ("/etc/passwd", "inside"),
        ("s3://bucket/elsewhere.parquet", "inside"),
        ("", "inside"),
    ],
)
def test_a_file_outside_the_table_is_refused(path: str, field: str) -> None:
    data = _wire()
    data["actions"][0]["add"]["path"] = path
    with pytest.raises(WireError, match=field):
        PreparedCommit.from_wire(data)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"read_version": -1}, "read_version"),
        ({"read_version": "3"}, "read_version"),
        ({"table": "t\n"}, "table"),
        ({"writer": "w 1"}, "writer"),
        ({"lanes": {"s/0": [1]}}, "mark"),
        ({"lanes": {"s/0": [True, 0]}}, "mark"),
        ({"lanes": {"s\n0": [1, 0]}}, "lane"),
        ({"forgotten": ["named/n1/0"]}, "not a random id's lane"),
        ({"forgotten": "~r/n1/0"}, "forgotten"),
        ({"forgotten": ["~r\n0"]}, "forgotten"),
        ({"starts": {"s1/abc/7": [5, 0]}}, "starts"),
        ({"starts": {"s1/abc/8": [1, 0]}}, "starts"),
        ({"actions": [{"metaData": {}}]}, "add or remove"),
        ({"actions": [{"add": {"path": "a.parquet", "size": -1}}]}, "size"),
        ({"actions": [{"add": {"path": "a.parquet", "tags": {}}}]}, "unexpected field"),
        ({"actions": [{"add": {"path": "a.parquet"}}] * (MAX_ACTIONS + 1)}, "at most"),
        (
            {
                "actions": [
                    {
                        "remove": {
                            "path": "a.parquet",
                            "deletionVector": {"storageType": "p", "pathOrInlineDv": "/x"},
                        }
                    }
                ]
            },
            "deletionVector",
        ),
        (
            {
                "actions": [
                    {
                        "remove": {
                            "path": "a.parquet",
                            "deletionVector": {
                                "storageType": "u",
                                "pathOrInlineDv": "../" + "a" * 20,
                            },
                        }
                    }
                ]
            },
            "prefix",
        ),
    ],
)
def test_a_malformed_prepared_commit_is_refused_naming_the_field(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(WireError, match=message):
        PreparedCommit.from_wire(_wire(**changes))


@pytest.mark.parametrize("engine", ["delta-rs", "delta-rs-s3"], indirect=True)
async def test_a_writer_that_loses_a_table_s_creation_hands_its_rows_to_the_committer(
    engine: str, warehouse: Path
) -> None:
    """Another writer creates the table while this one is creating it: this one counts a
    creation race, not a lost version, and its rows go to the table's committer (no writer
    races the committer for the versions after the creation)."""
    import pyarrow as pa

    async with (
        table_engine(engine, warehouse, node_id="w1") as first,
        table_engine(engine, warehouse, node_id="w2") as second,
    ):
        for writer in (first, second):
            writer.commit_sink = Through(first)
        path = warehouse / "t"
        created: list[int] = []

        def w1_creates_it_first() -> None:
            if not created:
                created.append(1)
                schema = pa.schema([("id", pa.int64()), ("v", pa.int64())])
                first.create("t", path, schema, first.settings.new_table(("id",)))

        with at_fault_point("creating", w1_creates_it_first):
            await asyncio.wait_for(await _stage(second, [{"id": 1, "v": 2}], "b/0", 0), 60)
        assert created == [1]
        assert (second.stats.creation_races, second.stats.commit_conflicts) == (1, 0)
    assert {k: r["v"] for k, r in read_delta(path).items()} == {1: 2}
    last = _last_commit(path)
    assert last["node"] == "w1" and last["writers"] == ["w2"]


@pytest.mark.parametrize("engine", ["delta-rs", "delta-rs-dv", "delta-rs-s3"], indirect=True)
async def test_of_writers_creating_a_table_at_once_exactly_one_does(
    engine: str, warehouse: Path
) -> None:
    """Four writers create each of ten tables at the same moment: one creates it, the others
    are told another writer did, and the table is version 0 alone. (delta-rs's own create,
    refused version 0, retried at version 1: two or three creators succeeded for most tables,
    each giving the table a new id.)"""
    import pyarrow as pa

    schema = pa.schema([("id", pa.int64()), ("v", pa.int64())])
    async with table_engine(engine, warehouse, node_id="w") as writer:
        settings = writer.settings.new_table(("id",))

        def create(name: str, start: threading.Barrier) -> str:
            start.wait()
            try:
                writer.create(name, warehouse / name, schema, settings)
                return "created"
            except Exception as exc:
                return type(exc).__name__

        for table in (f"t{i}" for i in range(10)):
            start = threading.Barrier(4)
            outcomes = await asyncio.gather(
                *(asyncio.to_thread(create, table, start) for _ in range(4))
            )
            assert sorted(outcomes) == ["CommitConflictError"] * 3 + ["created"], (table, outcomes)
            made = open_table(warehouse / table)
            assert made.version() == 0, table
            # Composed elsewhere, it names no other place than the table's own.
            assert "deltaflow-create-" not in json.dumps(made.history()), made.history()


def test_a_committer_forgets_only_the_lanes_of_the_writers_own_partitions() -> None:
    """A writer may ask a commit to forget lanes of its own partitions only: a lane of another
    node's partition, or one naming no partition, is passed over (not the whole group)."""
    from deltaflow.partitioning import PartitionMap
    from deltaflow.tables.commit.ownership import owned_lanes

    pmap = PartitionMap.build(1, {"n1": "127.0.0.1:1", "n2": "127.0.0.1:2"}, 8)
    lanes = [f"~r/n1/{p}" for p in range(8)] + ["~r/n1/x", "~r/n1/99"]
    mine = [f"~r/n1/{p}" for p in range(8) if pmap.owners[p] == "n1"]
    assert 0 < len(mine) < 8
    assert owned_lanes(lanes, "n1", [pmap]) == mine
