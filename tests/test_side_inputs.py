"""Side inputs: retrieved by one leader, versioned in the warehouse, swapped in on every node."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import itertools
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import pytest

import deltaflow
from deltaflow.errors import SideInputError
from deltaflow.receivers import MAX_SIDE_INPUT_BYTES, SideInput
from deltaflow.server import Node, NodeConfig, NodeState
from deltaflow.server.side_inputs import SideInputStore, load_side_inputs
from deltaflow.server.side_inputs.directory import Directory, LeaseLostError
from deltaflow.storage.paths import Location, location
from deltaflow.testing import (
    SIDE_INPUT_FILE_ENV,
    NodeProcess,
    at_fault_point,
    check_stamped,
    stamped_value,
)
from deltaflow.testing.object_store import S3Server

from .support import Eventually, StartCluster

FILE = "deltaflow.testing.FileSideInput"
FAILING = "deltaflow.testing.FailingSideInput"
ECHO = "deltaflow.testing.SideInputEcho"


def replace_file(path: Path, data: bytes) -> None:
    """Change the side input's source atomically, so a retrieval never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


async def until(condition: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)


def stamp_on(node: Node) -> Any:
    assert node.side_inputs is not None
    return node.side_inputs.get("file", check_stamped)["stamp"]


def versions_stored(warehouse: Location) -> list[int]:
    """The version numbers whose files the warehouse keeps for side input ``file``."""
    files = (warehouse / ".deltaflow/side_inputs/file").glob("v*.bin")
    return sorted(int(p.name[1:9]) for p in files)


@pytest.fixture(params=["disk", "s3"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Location, dict[str, str]]:
    """A warehouse the nodes share: a directory, or a prefix in a fresh bucket of the real S3
    server; and the environment node processes need to reach it."""
    if request.param == "disk":
        return tmp_path / "warehouse", {}
    server: S3Server = request.getfixturevalue("s3_server")
    uri = f"{request.getfixturevalue('bucket')}/warehouse"
    return location(uri, server.storage_options), server.storage_options


async def single_node(warehouse: Location, **config: Any) -> Node:
    node = Node(NodeConfig(node_id="n1", warehouse=warehouse, port=0, engine="delta-rs", **config))
    await node.start()
    return node


async def test_items_after_a_change_see_the_new_value_and_none_sees_a_torn_one(
    warehouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_cluster: StartCluster
) -> None:
    rounds, size = 4, 400_000
    source = tmp_path / "side.json"
    replace_file(source, stamped_value(1, size))
    monkeypatch.setenv(SIDE_INPUT_FILE_ENV, str(source))
    nodes = await start_cluster(
        warehouse,
        2,
        engine="delta-rs",
        receivers=[ECHO],
        side_inputs=[FILE],
        side_input_poll_interval=0.05,
    )
    try:
        assert all(stamp_on(n) == 1 for n in nodes)  # serving waited for the value
        phase: dict[int, tuple[str, int]] = {}
        results: dict[int, dict[str, Any]] = {}
        arrived = asyncio.Event()
        wanted = 0

        def on_result(result: dict[str, Any]) -> None:
            results[result["item"]] = result
            if len(results) >= wanted:
                arrived.set()

        async def items() -> AsyncIterator[int]:
            nonlocal wanted
            item = 0
            for stamp in range(1, rounds + 1):
                # Settled: every node serves `stamp`, so every item must see it.
                for _ in range(300):
                    phase[item] = ("settled", stamp)
                    yield item
                    item += 1
                wanted = item
                arrived.clear()
                if len(results) < wanted:
                    async with asyncio.timeout(60):  # a lost result fails the stream, not hangs
                        await arrived.wait()
                if stamp == rounds:
                    return
                # Changing: the stream keeps running while the new value spreads.
                replace_file(source, stamped_value(stamp + 1, size))
                while not all(stamp_on(n) == stamp + 1 for n in nodes):
                    phase[item] = ("changing", stamp)
                    yield item
                    item += 1
                    await asyncio.sleep(0.002)  # pace the producer, not a synchronisation

        options = deltaflow.StreamerOptions(page_size=40, auto_flush_interval=0.01)
        async with deltaflow.connect([nodes[0].address]) as client:
            await client.stream_data(
                items(), key=lambda i: i, receiver=ECHO, on_result=on_result, options=options
            )

        assert set(results) == set(phase)
        assert all(r["ok"] for r in results.values()), "a receiver saw a torn value"
        for item, (kind, stamp) in phase.items():
            seen = results[item]["stamp"]
            if kind == "settled":
                assert seen == stamp, f"item {item} processed after the change saw {seen}"
            else:
                assert seen in (stamp, stamp + 1), f"item {item} saw {seen} during {stamp}"
        assert {r["node"] for r in results.values()} == {"node-1", "node-2"}
        changing = sum(1 for kind, _ in phase.values() if kind == "changing")
        print(f"\n{len(phase)} items, {changing} while a new value spread")  # noqa: T201

        stats = [n.statistics().side_inputs[0] for n in nodes]
        assert [s.version for s in stats] == [rounds, rounds]
        assert sum(s.is_leader for s in stats) == 1
        assert sum(s.published for s in stats) == rounds
        assert len({s.leader for s in stats}) == 1
        assert versions_stored(warehouse) == list(range(1, rounds + 1))
    finally:
        for node in reversed(nodes):
            await node.stop()


async def cluster_view(session: aiohttp.ClientSession, proc: NodeProcess) -> dict[str, Any]:
    async with session.get(f"http://{proc.address}/v1/cluster") as resp:
        body = await resp.json()
    return dict(body["side_inputs"]["file"])


@pytest.mark.slow
async def test_a_killed_leader_is_replaced_and_new_values_reach_the_survivors(
    shared: tuple[Location, dict[str, str]], tmp_path: Path
) -> None:
    warehouse, store_env = shared
    lease = 1.5
    source = tmp_path / "side.json"
    replace_file(source, stamped_value(1, 50_000))
    extra = [
        "--engine",
        "delta-rs",
        "--receiver",
        ECHO,
        "--side-input",
        FILE,
        "--side-input-lease",
        str(lease),
        "--side-input-poll-interval",
        "0.1",
    ]
    env = {SIDE_INPUT_FILE_ENV: str(source), **store_env}
    procs = [NodeProcess(f"n{i}", warehouse, extra=extra, env=env) for i in (1, 2, 3)]
    by_id = {p.node_id: p for p in procs}
    try:
        await asyncio.gather(*(p.start(timeout=60) for p in procs))
        async with aiohttp.ClientSession() as session:

            async def look(of: list[NodeProcess]) -> list[dict[str, Any]]:
                return list(await asyncio.gather(*(cluster_view(session, p) for p in of)))

            deadline = time.monotonic() + 20
            while True:
                views = await look(procs)
                leaders = {v["leader"] for v in views}
                if all(v["version"] == 1 for v in views) and len(leaders) == 1:
                    break
                assert time.monotonic() < deadline, f"no agreed leader: {views}"
                await asyncio.sleep(0.05)
            leader = by_id[leaders.pop()]
            survivors = [p for p in procs if p is not leader]
            survivor_ids = {p.node_id for p in survivors}

            leader.kill()
            killed = time.monotonic()
            await leader.wait()
            replace_file(source, stamped_value(2, 50_000))

            took_over: float | None = None
            new_value: float | None = None
            deadline = killed + 30
            while new_value is None:
                views = await look(survivors)
                now = time.monotonic() - killed
                leaders = {v["leader"] for v in views}
                if took_over is None and len(leaders) == 1 and leaders <= survivor_ids:
                    took_over = now
                if all(v["version"] == 2 for v in views):
                    new_value = now
                assert time.monotonic() < deadline, f"no version 2 on the survivors: {views}"
                await asyncio.sleep(0.05)
            state = warehouse / ".deltaflow/side_inputs/file/state"
            holder = json.loads(state.read_text())["lease"]["holder"]
            assert holder in survivor_ids
            print(  # noqa: T201
                f"\nside-input leader {leader.node_id} SIGKILLed (lease {lease}s): {holder} "
                f"seen leading after {took_over or new_value:.2f}s, version 2 on every "
                f"survivor after {new_value:.2f}s"
            )
            # Expiry (at most the lease after the last renewal) plus one renewal period.
            assert new_value < lease * 4 / 3 + 4.0

        for survivor in survivors:
            got: list[dict[str, Any]] = []
            async with deltaflow.connect([survivor.address]) as client:
                await client.stream_data(
                    range(50), key=lambda i: i, receiver=ECHO, on_result=got.append
                )
            assert len(got) == 50
            assert {(r["stamp"], r["ok"]) for r in got} == {(2, True)}
    finally:
        for p in procs:
            if p.proc is not None and p.proc.returncode is None:
                await p.stop()


async def test_a_node_whose_side_input_keeps_failing_does_not_start(warehouse: Path) -> None:
    node = Node(
        NodeConfig(
            node_id="n1",
            warehouse=warehouse,
            port=0,
            engine="delta-rs",
            side_inputs=[FAILING],
            side_input_timeout=1.0,
        )
    )
    with pytest.raises(SideInputError) as raised:
        await node.start()
    message = str(raised.value)
    assert "side input 'failing'" in message
    assert "deltaflow.testing.FailingSideInput" in message
    assert "the side input's source is down" in message
    assert node.state is NodeState.STOPPED
    assert node.side_inputs is not None
    stats = node.side_inputs.statistics()[0]
    assert stats.version == 0 and stats.failures >= 2 and not stats.is_leader

    # From the command line: the process exits with the same message and never listens.
    proc = NodeProcess(
        "n2",
        warehouse,
        extra=["--engine", "delta-rs", "--side-input", FAILING, "--side-input-timeout", "1"],
    )
    with pytest.raises(RuntimeError) as exited:
        await proc.start(timeout=60)
    assert await proc.wait() == 2
    assert "node n2 does not start" in str(exited.value)
    assert "side input 'failing'" in str(exited.value)
    assert not any("ready on" in line for line in proc.output)


async def test_declined_unchanged_or_oversized_retrievals_make_no_new_version(
    shared: tuple[Location, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warehouse, _ = shared
    source = tmp_path / "side.json"
    replace_file(source, stamped_value(1, 1000))
    monkeypatch.setenv(SIDE_INPUT_FILE_ENV, str(source))
    node = await single_node(warehouse, side_inputs=[FILE], side_input_poll_interval=0.05)
    try:
        assert node.side_inputs is not None
        store = node.side_inputs

        def stats() -> Any:
            return store.statistics()[0]

        assert stats().version == 1 and stats().is_leader

        source.unlink()  # FileSideInput declines while its file is missing
        declined = stats().declined
        await until(lambda: stats().declined >= declined + 3, timeout=10, what="declines")
        assert stats().version == 1 and stamp_on(node) == 1
        assert versions_stored(warehouse) == [1]

        replace_file(source, stamped_value(1, 1000))  # the same bytes again
        unchanged = stats().unchanged
        await until(lambda: stats().unchanged >= unchanged + 3, timeout=10, what="unchanged")
        assert stats().version == 1

        replace_file(source, b"x" * (MAX_SIDE_INPUT_BYTES + 1))
        failures = stats().failures
        await until(lambda: stats().failures > failures, timeout=10, what="a size failure")
        assert "more than the limit of 1,048,576" in (stats().last_error or "")
        assert stats().version == 1 and stamp_on(node) == 1

        replace_file(source, stamped_value(2, 1000))
        await until(lambda: stats().version == 2, timeout=10, what="version 2")
        assert stamp_on(node) == 2
        assert versions_stored(warehouse) == [1, 2]
        assert stats().declined >= 3 and stats().published == 2
    finally:
        await node.stop()


async def test_readers_in_threads_parse_once_per_version_and_never_go_back(
    warehouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "side.json"
    replace_file(source, stamped_value(1, 200_000))
    monkeypatch.setenv(SIDE_INPUT_FILE_ENV, str(source))
    node = await single_node(warehouse, side_inputs=[FILE], side_input_poll_interval=0.05)
    try:
        assert node.side_inputs is not None
        store = node.side_inputs
        parsed: list[int] = []

        def parse(raw: bytes) -> dict[str, Any]:
            value = check_stamped(raw)
            parsed.append(value["stamp"])
            return value

        stop = threading.Event()

        def reader() -> list[tuple[Any, bool]]:
            seen = []
            while True:
                # The read after `stop` starts after the last swap: it must see the last value.
                last = stop.is_set()
                value = store.get("file", parse)
                seen.append((value["stamp"], value["ok"]))
                if last:
                    return seen

        assert store.get("file", parse)["stamp"] == 1
        readers = [asyncio.create_task(asyncio.to_thread(reader)) for _ in range(4)]
        for stamp in (2, 3):
            replace_file(source, stamped_value(stamp, 200_000))
            await until(lambda s=stamp: stamp_on(node) == s, timeout=10, what=f"stamp {stamp}")
        stop.set()
        for seen in await asyncio.gather(*readers):
            assert seen and all(ok for _, ok in seen)
            stamps = [s for s, _ in seen]
            assert stamps == sorted(stamps), "a reader went back to an older version"
            assert stamps[-1] == 3
        assert parsed == sorted(set(parsed)), f"a version parsed twice: {parsed}"
        assert {1, 3} <= set(parsed)

        with pytest.raises(SideInputError, match=r"'nope' is not configured.*file"):
            store.get("nope")
        with pytest.raises(SideInputError, match="parsing side input 'file' version 3"):
            store.get("file", lambda raw: 1 / 0)
        assert store.get("file") == stamped_value(3, 200_000)
    finally:
        await node.stop()


class Recovering(SideInput):
    """Fails its first three retrievals, then returns a value; due once a minute."""

    name = "recovering"
    interval = 60.0
    calls: ClassVar[list[float]] = []

    def retrieve(self) -> bytes:
        Recovering.calls.append(time.monotonic())
        if len(Recovering.calls) <= 3:
            raise ConnectionError("injected: down for now")
        return b"up"


async def test_a_failed_retrieval_is_retried_with_doubling_waits_until_it_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, eventually: Eventually
) -> None:
    Recovering.calls = []
    store = SideInputStore(
        tmp_path, node_id="n1", classes=load_side_inputs([Recovering]), lease=3.0
    )
    with caplog.at_level("WARNING", logger="deltaflow.server.side_inputs"):
        await store.start()
        try:
            await store.wait_ready(10)
            # The watcher may serve the new version before the retrieval counts its publish.
            await eventually(lambda: store.statistics()[0].published == 1, "the publish counted")
        finally:
            await store.stop()
    assert store.get("recovering") == b"up"
    [stats] = store.statistics()
    assert (stats.retrievals, stats.failures, stats.published) == (4, 3, 1)
    # Waits of 0.5, 1 and 2 s: not the schedule's minute, and not at once.
    calls = Recovering.calls
    gaps = [later - earlier for earlier, later in itertools.pairwise(calls)]
    for gap, wait in zip(gaps, (0.5, 1.0, 2.0), strict=True):
        assert wait - 0.05 <= gap < wait + 0.5, gaps
    retrying = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert [m.split("retrying in ")[1].split("s:")[0] for m in retrying] == ["0.5", "1.0", "2.0"]
    assert all(r.name == "deltaflow.server.side_inputs" for r in caplog.records)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_leader_replaced_while_it_stalled_cannot_publish(
    shared: tuple[Location, dict[str, str]],
) -> None:
    warehouse, _ = shared
    place = Directory(warehouse / ".deltaflow/side_inputs/fenced")
    assert place.try_lease("n1", "n1/a", 0.5, None)[0]
    first = place.publish("n1", "n1/a", b"one", digest(b"one"))
    assert first is not None and first.version == 1

    def stall_past_the_lease() -> None:
        # n1 read its lease, valid, and is about to publish; it stalls until n2 has taken over.
        deadline = time.monotonic() + 10
        while not place.try_lease("n2", "n2/b", 30.0, None)[0]:
            assert time.monotonic() < deadline, "n1's lease never ran out"
            time.sleep(0.05)

    with at_fault_point("side_input_publish", stall_past_the_lease):
        with pytest.raises(LeaseLostError) as lost:
            place.publish("n1", "n1/a", b"two", digest(b"two"))
    assert lost.value.args[0] == "n2"
    kept = place.load_newer("fenced", 0)
    assert kept is not None and (kept.version, kept.data) == (1, b"one")

    # The new leader publishes the next version; the fenced leader's file does not shadow it.
    third = place.publish("n2", "n2/b", b"three", digest(b"three"))
    assert third is not None and third.version == 2
    loaded = place.load_newer("fenced", 1)
    assert loaded is not None and loaded.data == b"three"


def race_for_lease(place: Directory, racers: int, incarnation: str) -> list[tuple[bool, Any]]:
    """What each of ``racers`` threads, released at once, got from ``try_lease``."""
    start = threading.Barrier(racers)

    def race(i: int) -> tuple[bool, Any]:
        start.wait()
        return place.try_lease(f"n{i}", f"n{i}/{incarnation}", 30.0, None)

    with concurrent.futures.ThreadPoolExecutor(racers) as pool:
        return list(pool.map(race, range(racers)))


def test_of_nodes_racing_for_a_free_lease_exactly_one_takes_it(
    shared: tuple[Location, dict[str, str]],
) -> None:
    warehouse, _ = shared
    place = Directory(warehouse / ".deltaflow/side_inputs/raced")
    racers = 8
    for round_ in range(3):
        results = race_for_lease(place, racers, f"round{round_}")
        winners = [i for i, (held, _) in enumerate(results) if held]
        assert len(winners) == 1, f"round {round_}: {winners} all took the lease"
        assert {lease.holder for _, lease in results} == {f"n{winners[0]}"}
        lease = place.read_lease()
        assert lease is not None and lease.epoch == round_ + 1
        place.release(f"n{winners[0]}/round{round_}", None)
