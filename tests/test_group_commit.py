"""The group commit: the batches a node stages for a table commit together, in groups that
are bounded, gathered and paced; a group is prepared outside the table's lock and
committed under it, applying only what no other node applied meanwhile; the lock is
shared fairly, and checkpoints are written after the commit, outside it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import threading
from pathlib import Path
from typing import Any

import pytest

import deltaflow
from deltaflow import Delete, StreamerOptions
from deltaflow.engines.delta_rs import DeltaRsTableEngine
from deltaflow.errors import ServerError, UsageError
from deltaflow.server import Node, NodeConfig
from deltaflow.tables.commit import staging
from deltaflow.tables.flock import table_lock
from deltaflow.testing import at_fault_point

from .support import (
    OPTIONS,
    WRITE_PATHS,
    assert_table,
    expected,
    open_table,
    read_all,
    read_delta,
    read_spark,
    table_engine,
    upsert,
    workload,
)


@pytest.fixture(params=WRITE_PATHS, name="engine")
def engines_of_group_commits(request: pytest.FixtureRequest) -> str:
    """One engine per write path (:data:`support.WRITE_PATHS`): groups form on the node
    whatever the engine."""
    return str(request.param)


async def test_group_commit_applies_many_batches_per_commit(
    cluster: list[Node], spark: Any, warehouse: Path
) -> None:
    items = workload(n_keys=2000, rounds=2)
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            items, table="grouped", key="id", options=StreamerOptions(page_size=100)
        )
    batches = sum(s.batches_acked for s in summary.per_node.values())
    commits = sum(n.statistics().engine.commits for n in cluster)
    assert batches >= 40
    # A MERGE per batch would make `batches` commits; groups make far fewer.
    assert commits <= batches / 4, (commits, batches)
    assert_table(spark, warehouse / "grouped", expected(items))


async def test_interleaved_streams_in_one_group_equal_one_by_one_application(
    cluster: list[Node], spark: Any, warehouse: Path
) -> None:
    def stream_items(offset: int) -> list[Any]:
        items: list[Any] = []
        for r in range(4):
            items += [
                {"id": offset + k, "name": f"s{offset}-r{r}", "value": float(r)} for k in range(300)
            ]
            items += [Delete({"id": offset + k}) for k in range(r, 300, 7)]
        return items

    a, b = stream_items(0), stream_items(10_000)
    async with deltaflow.connect([cluster[0].address]) as client:
        await asyncio.gather(
            client.stream_data(a, table="mixed", key="id", options=OPTIONS),
            client.stream_data(b, table="mixed", key="id", options=OPTIONS),
        )
    # Keys of the two streams are disjoint, so applying one stream after the other, item by
    # item, is the reference result.
    assert_table(spark, warehouse / "mixed", expected(a + b))
    grouped = sum(n.statistics().engine.batches_committed for n in cluster)
    commits = sum(n.statistics().engine.commits for n in cluster)
    assert commits < grouped  # batches of both streams shared commits


@pytest.mark.parametrize("engine", ["spark", "delta-rs", "spark-dv", "delta-rs-dv"], indirect=True)
async def test_a_group_prepared_before_another_node_applied_part_of_it_applies_only_the_rest(
    warehouse: Path, engine: str
) -> None:
    """A group is prepared (its rows collapsed and, for merge-on-read, its files written)
    before its node takes the table's lock. Meanwhile the node that took one of its lanes over
    applies that lane's batch and a later one. The commit applies only the group's other
    batch: the lane's later value stays."""
    loop = asyncio.get_running_loop()
    path = warehouse / "handover"
    async with (
        table_engine(engine, warehouse) as first,
        table_engine(engine, warehouse, node_id="t2") as second,
    ):
        await upsert(first, "handover", [{"id": i, "name": "a"} for i in range(10)])

        async def second_applies_the_lane() -> None:
            for seq, name in ((0, "old"), (1, "new")):
                rows = [{"id": 3, "name": name}]
                await (
                    await second.stage(
                        "handover", ["id"], rows, frozenset(), mark=("s/0", (seq, 0))
                    )
                )

        took_over: list[str] = []

        def other_node() -> None:  # on the first engine's commit thread, before its lock
            if not took_over:
                took_over.append("s/0")
                asyncio.run_coroutine_threadsafe(second_applies_the_lane(), loop).result(120)

        running = True  # both writes are held until both are staged: they make one group
        staged = [
            await first.stage(
                "handover", ["id"], rows, frozenset(), mark=(lane, (0, 0)), held=lambda: running
            )
            for lane, rows in (
                ("s/0", [{"id": 3, "name": "old"}]),
                ("s/1", [{"id": 5, "name": "x"}]),
            )
        ]
        with at_fault_point("prepared", other_node):
            running = False
            first.release()
            await asyncio.gather(*staged)
        assert took_over == ["s/0"]
        assert first.stats.batches_deduplicated == 1
    want = {i: "a" for i in range(10)} | {3: "new", 5: "x"}
    assert {k: r["name"] for k, r in read_delta(path).items()} == want


@pytest.mark.parametrize("engine", ["delta-rs", "delta-rs-dv"])
async def test_a_group_whose_preparation_fails_is_applied_by_its_commit(
    warehouse: Path, engine: str
) -> None:
    """Preparing a group outside the lock (for merge-on-read, writing its files) can fail, on
    a full disk say. The commit then does all of it under the lock, where an error would be
    reported per batch, and the node goes on committing. delta-rs only: the base class runs
    the two stages."""
    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "unprepared", [{"id": i, "name": "a"} for i in range(3)])

        def disk_full() -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        with at_fault_point("prepared", disk_full):
            async with asyncio.timeout(60):
                await upsert(eng, "unprepared", [{"id": 1, "name": "b"}])
        await upsert(eng, "unprepared", [{"id": 2, "name": "c"}])
    path = warehouse / "unprepared"
    assert {k: r["name"] for k, r in read_delta(path).items()} == {0: "a", 1: "b", 2: "c"}


async def test_max_group_bytes_bounds_a_group(warehouse: Path) -> None:
    """Engine-independent (the base class cuts groups): delta-rs only, for speed."""
    async with table_engine("delta-rs", warehouse, max_group_bytes=1) as eng:
        futures = [
            await eng.stage("small_groups", ["id"], [{"id": i, "v": 1.0}], frozenset())
            for i in range(4)
        ]
        await asyncio.gather(*futures)
        assert eng.stats.commits == eng.stats.batches_committed == 4
        assert eng.stats.largest_group_rows == 1
    async with table_engine("delta-rs", warehouse) as eng:
        await upsert(eng, "big_groups", [{"id": 0, "v": 0.0}])
        loop = asyncio.get_running_loop()
        waiting = asyncio.Event()
        lock = table_lock(warehouse, "big_groups")
        await asyncio.to_thread(lock.__enter__)  # off the loop: the last commit releases it there
        with contextlib.ExitStack() as held:
            held.push(lock)  # released when the block ends
            held.enter_context(
                at_fault_point("prepared", lambda: loop.call_soon_threadsafe(waiting.set))
            )
            first = await eng.stage("big_groups", ["id"], [{"id": 1, "v": 1.0}], frozenset())
            await waiting.wait()  # its group is prepared, and waits for the lock
            futures = [
                await eng.stage("big_groups", ["id"], [{"id": i, "v": 1.0}], frozenset())
                for i in range(2, 5)
            ]
        await asyncio.gather(first, *futures)
        # A group is taken and prepared before it waits for the lock: everything that queued
        # while another writer held the lock commits as the next group, not one by one.
        assert eng.stats.commits == 3 and eng.stats.largest_group_rows == 3


async def test_a_burst_of_writes_to_an_idle_table_commits_as_one_group(
    warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client flushes a batch per partition at once. The first write queued wakes the idle
    committer, which waits for the writes still being converted rather than committing a
    fragment of the burst while the rest waits a whole commit. delta-rs only: the base class
    forms groups."""
    monkeypatch.setattr(staging, "GATHER_SECONDS", 60.0)  # the bound is not under test
    async with table_engine("delta-rs", warehouse) as eng:
        await upsert(eng, "burst", [{"id": 0, "v": 0.0}])  # the table exists: groups prepare
        commits = eng.stats.commits
        prepared, passed = threading.Event(), threading.Lock()

        def slow_but_first() -> None:  # the first conversion passes; the others take 0.5 s,
            if not passed.acquire(blocking=False):  # or end once a group is prepared
                prepared.wait(timeout=0.5)

        with at_fault_point("converting", slow_but_first), at_fault_point("prepared", prepared.set):
            futures = await asyncio.gather(
                *(eng.stage("burst", ["id"], [{"id": i, "v": 1.0}], frozenset()) for i in (1, 2, 3))
            )
            await asyncio.gather(*futures)
        assert eng.stats.commits - commits == 1
        assert eng.stats.largest_group_rows == 3


async def test_min_commit_interval_spaces_commits_but_a_whole_group_goes_at_once(
    warehouse: Path,
) -> None:
    """A node's commit rate cap: writes queued within the interval after a commit wait and
    commit together; a queue holding a whole group commits without waiting. delta-rs only:
    the base class paces groups."""
    async with table_engine(
        "delta-rs", warehouse, min_commit_interval=60.0, max_group_rows=3
    ) as eng:
        await upsert(eng, "capped", [{"id": 0, "v": 0.0}])  # the first commit does not wait
        commits = eng.stats.commits
        futures = [
            await eng.stage("capped", ["id"], [{"id": i, "v": 1.0}], frozenset()) for i in (1, 2)
        ]
        done, _ = await asyncio.wait(futures, timeout=0.5)  # far longer than a commit takes
        assert not done
        async with asyncio.timeout(30):  # half the interval: only a full group gets through
            futures.append(await eng.stage("capped", ["id"], [{"id": 3, "v": 1.0}], frozenset()))
            await asyncio.gather(*futures)
        # Held back until the third made a whole group, then one commit.
        assert eng.stats.commits - commits == 1
        assert eng.stats.largest_group_rows == 3
    # Writes of a receiver still running do not make a whole group until it returns.
    async with table_engine(
        "delta-rs", warehouse, min_commit_interval=60.0, max_group_rows=3
    ) as eng:
        await upsert(eng, "held", [{"id": 0, "v": 0.0}])
        running = True
        held = await eng.stage(
            "held",
            ["id"],
            [{"id": 1, "v": 1.0}, {"id": 2, "v": 1.0}],
            frozenset(),
            held=lambda: running,
        )
        free = await eng.stage("held", ["id"], [{"id": 3, "v": 1.0}], frozenset())
        done, _ = await asyncio.wait({held, free}, timeout=0.5)
        assert not done
        running = False
        eng.release()
        async with asyncio.timeout(30):
            await asyncio.gather(held, free)
    # A group larger than the queue may hold: a full queue goes at once too (staging waits).
    async with table_engine(
        "delta-rs", warehouse, min_commit_interval=60.0, max_group_rows=10, max_queued_rows=2
    ) as eng:
        await upsert(eng, "full_queue", [{"id": 0, "v": 0.0}])
        async with asyncio.timeout(30):
            futures = [
                await eng.stage("full_queue", ["id"], [{"id": i, "v": 1.0}], frozenset())
                for i in (1, 2)
            ]
            await asyncio.gather(*futures)
    async with table_engine("delta-rs", warehouse, min_commit_interval=0.3) as eng:
        await upsert(eng, "spaced", [{"id": 0, "v": 0.0}])
        first = eng._owners["spaced"].queue.last_taken_at
        await upsert(eng, "spaced", [{"id": 1, "v": 1.0}])  # the interval had not passed
        second = eng._owners["spaced"].queue.last_taken_at
        assert first is not None and second is not None and second - first >= 0.3
    assert [r["id"] for r in read_all(warehouse / "capped")] == [0, 1, 2, 3]
    with pytest.raises(UsageError, match="min_commit_interval must be between 0 and 600"):
        NodeConfig(node_id="n", warehouse=warehouse, min_commit_interval=-1)


async def test_a_committer_that_fails_fails_its_group_and_goes_on(warehouse: Path) -> None:
    """An error nothing else handles (standing for a bug) fails the group it took, with the
    table named, instead of leaving its batches waiting for ever; the next group commits."""
    failures = iter([RuntimeError("injected committer bug")])

    def once() -> None:
        error = next(failures, None)
        if error is not None:
            raise error

    async with table_engine("delta-rs", warehouse) as eng:
        with at_fault_point("taken", once):
            async with asyncio.timeout(30):
                doomed = await eng.stage("bug", ["id"], [{"id": 1, "v": 1.0}], frozenset())
                with pytest.raises(ServerError, match="committer of table 'bug' failed"):
                    await doomed
                await upsert(eng, "bug", [{"id": 2, "v": 2.0}])
        assert eng.stats.batches_failed == 1
    assert [r["id"] for r in read_all(warehouse / "bug")] == [2]


async def test_a_node_with_a_backlog_does_not_starve_another_on_the_table_lock(
    warehouse: Path,
) -> None:
    """flock is unfair: without the yield, a committer with a backlog re-locks at once after
    every commit and a polling waiter never gets in."""
    busy = DeltaRsTableEngine(warehouse, node_id="busy", max_group_rows=1)
    other = DeltaRsTableEngine(warehouse, node_id="other")
    await busy.start()
    await other.start()
    try:
        await upsert(busy, "shared", [{"id": -1, "v": 0.0}])  # the table exists
        backlog = [
            await busy.stage("shared", ["id"], [{"id": i, "v": 1.0}], frozenset())
            for i in range(30)
        ]  # 30 one-row groups, committed back to back
        await upsert(other, "shared", [{"id": 1000, "v": 2.0}])
        commits_before_other = busy.stats.commits
        await asyncio.gather(*backlog)
    finally:
        await other.stop()
        await busy.stop()
    # The other node got the lock after a commit or two, not after the whole backlog.
    assert commits_before_other <= 5, commits_before_other
    assert len(read_all(warehouse / "shared")) == 32


@pytest.mark.parametrize("engine", ["spark", "delta-rs", "spark-dv", "delta-rs-dv"])
async def test_a_checkpoint_is_written_after_its_commit_outside_the_table_lock(
    spark: Any, warehouse: Path, engine: str
) -> None:
    """A checkpoint costs seconds on a large table. Written inside the commit, as Delta and
    delta-rs do by default, it held the table's lock, so every node's commits to the table,
    and their acks, waited for it every 100 commits."""
    path = warehouse / "checkpointed"
    loop = asyncio.get_running_loop()
    started, release = asyncio.Event(), threading.Event()

    def blocked() -> None:  # the checkpoint's thread waits here until the test is done
        loop.call_soon_threadsafe(started.set)
        release.wait(timeout=120)

    async with table_engine(engine, warehouse) as eng:
        await upsert(eng, "checkpointed", [{"id": 0, "v": 0.0}, {"id": 1, "v": 0.0}])
        due = open_table(path).version() + 2  # after the next two commits: this one,
        await asyncio.to_thread(  # and the write below, due a checkpoint (altered by Spark:
            spark.sql,  # delta-rs would add a table feature Spark cannot read)
            f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.checkpointInterval' = "
            f"'{due}', 'delta.logRetentionDuration' = 'interval 0 seconds', "
            "'delta.deletedFileRetentionDuration' = 'interval 0 seconds')",
        )
        with at_fault_point("checkpointing", blocked):
            try:  # the write is acknowledged while its checkpoint is written
                # An update: with deletion vectors, the checkpoint must carry the vector.
                await asyncio.wait_for(upsert(eng, "checkpointed", [{"id": 1, "v": 1.0}]), 60)
                await asyncio.wait_for(started.wait(), 60)
                checkpoint = path / "_delta_log" / f"{due:020d}.checkpoint.parquet"
                assert not checkpoint.exists()  # not written inside the commit
                lock = table_lock(warehouse, "checkpointed")
                await asyncio.wait_for(asyncio.to_thread(lock.__enter__), 60)
                lock.__exit__(None, None, None)  # the lock was free during the checkpoint
                await asyncio.wait_for(upsert(eng, "checkpointed", [{"id": 2, "v": 2.0}]), 60)
                assert eng.stats.checkpoints == 0
            finally:
                release.set()
    assert eng.stats.checkpoints == 1 and eng.stats.checkpoint_seconds > 0  # stop() waited
    assert checkpoint.is_file()
    assert not (path / "_delta_log" / f"{0:020d}.json").exists()  # expired: cleaned up
    assert open_table(path).version() == due + 1
    # delta-rs writes the checkpoint for either engine; both read the table through it.
    assert [(r["id"], r["v"]) for r in read_all(path)] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert {k: r["v"] for k, r in read_spark(spark, path).items()} == {0: 0.0, 1: 1.0, 2: 2.0}
