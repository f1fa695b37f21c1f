"""Two node processes committing to one Delta table at the same time: no commit is lost.

Each node runs with no peers and one partition, so it owns everything and applies every
batch it gets; with one batch in flight per stream every batch is its own commit, racing the
other process's commits to the same table: 2 x 100 appends through two Spark JVMs and
2 x 150 merges through delta-rs.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import deltaflow
from deltaflow import StreamerOptions
from deltaflow.storage import flock as lock
from deltaflow.storage.paths import Location, location, storage_options
from deltaflow.tables.flock import others_waiting, table_lock, table_lock_path
from deltaflow.testing import NodeProcess
from deltaflow.testing.object_store import S3Server

from .support import open_table, read_delta

APPEND_RECEIVER = "deltaflow.testing.AppendRows"


async def race(
    warehouse: Location,
    engine: str | tuple[str, str],
    batches: int,
    rows: int,
    *,
    append: bool,
    keys: int | None = None,
    extra: tuple[str, ...] = (),
) -> float:
    """Both nodes stream ``batches`` one-batch commits of ``rows`` rows; returns the seconds the
    two streams took. Merges into a keyed table, or appends to a keyless one. With ``keys``,
    each node's rows cycle through that many ids, so every batch after the first few updates
    rows of the node's earlier commits. ``engine``: both nodes', or each one's. A warehouse on
    the S3 server is given to the nodes with its settings in their environment."""
    engines = (engine, engine) if isinstance(engine, str) else engine
    flags = ("--partitions", "1", *extra)
    if append:
        flags += ("--receiver", APPEND_RECEIVER)
    total = batches * rows
    distinct = keys or total
    env = storage_options(warehouse) or {}
    nodes = [
        NodeProcess(
            f"{name}-{i}",
            warehouse,
            extra=(*flags, "--engine", name),
            env=env,  # type: ignore[arg-type]
        )
        for i, name in enumerate(engines, start=1)
    ]
    await asyncio.gather(*(n.start() for n in nodes))
    opts = StreamerOptions(page_size=rows, max_in_flight=1, auto_flush_interval=0)

    async def stream(node: NodeProcess, offset: int) -> deltaflow.StreamSummary:
        data = [{"id": offset + i % distinct, "writer": node.node_id, "n": i} for i in range(total)]
        async with deltaflow.connect([node.address]) as client:
            if append:
                return await client.stream_data(
                    data,
                    key=lambda row: row["id"],
                    receiver=APPEND_RECEIVER,
                    receiver_args={"table": "shared"},
                    options=opts,
                )
            return await client.stream_data(data, table="shared", key="id", options=opts)

    started = time.monotonic()
    try:
        summaries = await asyncio.gather(stream(nodes[0], 0), stream(nodes[1], 1_000_000))
    finally:
        elapsed = time.monotonic() - started
        await asyncio.gather(*(n.stop() for n in nodes))
    assert all(s.items_acked == batches * rows for s in summaries)
    path = warehouse / "shared"
    table = open_table(path)
    # Every version is there, none overwritten: the table's creation, then one commit per
    # batch, each carrying its writer's lane marks.
    versions = sorted(h["version"] for h in table.history(10_000))
    assert versions == list(range(2 * batches + 1))
    writers = [_writer(path, v) for v in versions]
    assert writers[0] == ""  # the creation (a commit of its own, without rows)
    assert sorted(writers[1:]) == sorted([n.node_id for n in nodes] * batches)
    data = {k: (r["writer"], r["n"]) for k, r in read_delta(path).items()}
    # Each id holds its last write: n is the last of its cycle.
    assert data == {
        offset + k: (node.node_id, last)
        for node, offset in ((nodes[0], 0), (nodes[1], 1_000_000))
        for k in range(distinct)
        for last in [max(i for i in range(total) if i % distinct == k)]
    }
    return elapsed


def _writer(path: Location, version: int) -> str:
    """The node recorded in a commit's lane marks ('' for a commit without them)."""
    for line in (path / "_delta_log" / f"{version:020d}.json").read_text().splitlines():
        info = json.loads(line).get("commitInfo")
        if info is not None:
            meta = json.loads(info.get("userMetadata") or "{}")
            return str(meta.get("deltaflow", {}).get("node", ""))
    return ""


@pytest.mark.slow
async def test_hammer_60_appends_from_two_spark_processes(warehouse: Path) -> None:
    # Spark's HDFSLogStore is the log store whose put-if-absent is atomic only inside one JVM:
    # two JVMs, 60 commits, none may be lost. Appends rather than MERGEs, which take several
    # times longer: the commit path and its lock are the same.
    await race(warehouse, "spark", batches=30, rows=4, append=True)


@pytest.mark.slow
async def test_a_spark_node_and_a_delta_rs_node_share_a_table_on_s3(
    s3_server: S3Server, bucket: str
) -> None:
    """Two one-node clusters, one on each engine, appending to one table in a bucket: no lock
    they share, only the store's conditional create (delta-rs's own, and Spark's through
    deltaflow's log store). 2 x 25 commits, none lost."""
    warehouse = location(f"{bucket}/warehouse", s3_server.storage_options)
    await race(warehouse, ("spark", "delta-rs"), batches=25, rows=4, append=True)


@pytest.mark.slow
async def test_hammer_300_commits_from_two_delta_rs_processes(warehouse: Path) -> None:
    await race(warehouse, "delta-rs", batches=150, rows=4, append=False)


@pytest.mark.slow
async def test_hammer_300_merge_on_read_commits_from_two_delta_rs_processes(
    warehouse: Path,
) -> None:
    # Tables with deletion vectors are committed by deltaflow's own log writer (delta-rs's
    # transactions take no deletion vectors): every batch replaces rows of earlier commits.
    await race(
        warehouse,
        "delta-rs",
        batches=150,
        rows=4,
        append=False,
        keys=20,
        extra=("--deletion-vectors",),
    )


def test_a_waiter_killed_while_waiting_stops_counting_as_waiting(tmp_path: Path) -> None:
    """A process SIGKILLed while it waits for a table's lock cannot remove its marker; left
    there, it would make every holder step aside after each release for good."""
    lock_path = table_lock_path(tmp_path, "t")
    script = (
        "import sys; from pathlib import Path; "
        "from deltaflow.tables.flock import table_lock; "
        "table_lock(Path(sys.argv[1]), 't').__enter__()"
    )
    with table_lock(tmp_path, "t"):
        waiter = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)])
        try:
            deadline = time.monotonic() + 60
            while not others_waiting(lock_path):  # the waiter's marker, once it found the lock held
                assert waiter.poll() is None and time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            waiter.kill()
            waiter.wait()
        assert not others_waiting(lock_path)
    assert not any(lock_path.parent.glob("*.waiting/*"))


class FakeClock:
    """The lock module's clock: ``sleep`` advances it (and runs ``on_sleep``), no time passes."""

    def __init__(self, on_sleep: Any = None) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        self.on_sleep = on_sleep

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(len(self.sleeps))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(lock, "time", fake)
    return fake


def hold(path: Path) -> int:
    """Take the lock at ``path`` the way another process would: its own open file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def waiting_markers(path: Path) -> list[str]:
    waiting = path.parent / f"{path.name}.waiting"
    return sorted(p.name for p in waiting.iterdir()) if waiting.exists() else []


def test_a_free_lock_is_taken_at_once_and_excludes_every_other_holder(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = table_lock_path(tmp_path / "warehouse", "orders")
    assert path == tmp_path / "warehouse" / ".deltaflow" / "locks" / "orders.lock"
    with table_lock(tmp_path / "warehouse", "orders") as waited:
        assert waited == 0.0 and clock.sleeps == []
        # Held: another open file of it (another process, or thread) cannot lock it.
        fd = os.open(path, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    fd = hold(path)  # released on leaving the block
    os.close(fd)


def test_a_waiter_polls_until_the_holder_releases_and_reports_its_wait(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = table_lock_path(tmp_path, "t")
    path.parent.mkdir(parents=True)
    holder = hold(path)
    seen: list[bool] = []

    def release_on_third_poll(polls: int) -> None:
        seen.append(others_waiting(path))
        if polls == 3:
            os.close(holder)

    clock.on_sleep = release_on_third_poll
    with table_lock(tmp_path, "t", timeout=1.0) as waited:
        assert waited == pytest.approx(3 * lock.POLL_SECONDS)
        assert clock.sleeps == [lock.POLL_SECONDS] * 3
        assert seen == [True, True, True], "the waiter left no marker while it waited"
        assert waiting_markers(path) == [], "the marker outlived the wait"


def test_a_lock_held_past_the_timeout_raises_and_leaves_no_marker(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = table_lock_path(tmp_path, "t")
    path.parent.mkdir(parents=True)
    holder = hold(path)
    try:
        with (
            pytest.raises(TimeoutError) as info,
            table_lock(tmp_path, "t", timeout=0.1),
        ):
            pytest.fail("the lock was taken while another holder had it")
    finally:
        os.close(holder)
    assert str(info.value) == (
        f"commit lock of table 't' held by another process for more than 0.1s ({path})"
    )
    # It gave up as soon as the timeout had passed, not before, and not much later.
    assert 0.1 < sum(clock.sleeps) <= 0.1 + 2 * lock.POLL_SECONDS
    assert waiting_markers(path) == []
    assert not others_waiting(path)


def test_a_holder_that_just_released_lets_the_waiters_go_first(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = table_lock_path(tmp_path, "t")
    path.parent.mkdir(parents=True)
    with table_lock(tmp_path, "t", released_at=clock.now) as waited:
        assert waited == 0.0, "it stepped aside while no one was waiting"
    # A live waiter (this process) left its marker: the holder steps aside for YIELD_SECONDS
    # after its release, then takes the lock (the waiter did not take it meanwhile).
    waiting = path.parent / f"{path.name}.waiting"
    waiting.mkdir()
    (waiting / f"{lock._HOST}-{os.getpid()}-1").touch()
    released = clock.now
    with table_lock(tmp_path, "t", released_at=released) as waited:
        assert waited == pytest.approx(lock.YIELD_SECONDS)
        assert set(clock.sleeps) == {lock.POLL_SECONDS}
    clock.sleeps.clear()
    # Long after its release, it does not step aside.
    with table_lock(tmp_path, "t", released_at=clock.now - lock.YIELD_SECONDS) as waited:
        assert waited == 0.0 and clock.sleeps == []


def test_waiting_markers_of_dead_local_processes_are_removed_others_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = table_lock_path(tmp_path, "t")
    assert not others_waiting(path), "no marker directory: no one waits"
    waiting = path.parent / f"{path.name}.waiting"
    waiting.mkdir(parents=True)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead_pid = int(dead.stdout)
    (waiting / f"{lock._HOST}-{dead_pid}-1").touch()
    assert others_waiting(path) is False
    assert waiting_markers(path) == [], "a dead waiter's marker was kept"
    # A process of another host cannot be checked from here; nor can a marker of another form.
    for name in (f"other_host-{dead_pid}-1", f"{lock._HOST}-x1-1", f"{lock._HOST}"):
        (waiting / name).touch()
        assert others_waiting(path), name
        assert waiting_markers(path) == [name]
        (waiting / name).unlink()
    # A process that exists as another user (kill says EPERM) is alive.
    (waiting / f"{lock._HOST}-1-1").touch()

    def not_permitted(pid: int, signal: int) -> None:
        raise PermissionError(pid)

    monkeypatch.setattr(lock.os, "kill", not_permitted)
    assert others_waiting(path)
    assert waiting_markers(path) == [f"{lock._HOST}-1-1"]


def test_two_holders_removing_one_dead_marker_at_once_both_carry_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = table_lock_path(tmp_path, "t")
    waiting = path.parent / f"{path.name}.waiting"
    waiting.mkdir(parents=True)
    (waiting / f"{lock._HOST}-1-1").touch()

    def removed_by_the_other_holder(name: str) -> bool:
        (waiting / name).unlink()  # the other holder got there first
        return True

    monkeypatch.setattr(lock, "_died_waiting", removed_by_the_other_holder)
    assert others_waiting(path) is False
