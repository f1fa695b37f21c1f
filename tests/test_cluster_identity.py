"""Cluster identity: a node with another warehouse or partition count is refused by the
cluster instead of taking partitions; dead peers leave; ``cluster status`` says why."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import pytest
from aiohttp import web
from deltalake import DeltaTable

import deltaflow
from deltaflow.errors import UsageError
from deltaflow.partitioning import PartitionMap
from deltaflow.server import Node, NodeConfig, NodeState
from deltaflow.server.identity import (
    CLUSTER_FILE,
    Candidate,
    FileIdentityStore,
    NodeIdentity,
    decide,
    load_identity,
    refusal_message,
    winning_identity,
)
from deltaflow.testing import free_port

FAST = {"heartbeat_interval": 0.1, "failure_timeout": 1.0}


class StartNode(Protocol):
    def __call__(
        self, node_id: str, warehouse: Path, peers: list[str] | None = None, **config: Any
    ) -> Awaitable[Node]: ...


@pytest.fixture
async def start_node() -> AsyncIterator[StartNode]:
    """Starts delta-rs nodes on 127.0.0.1 (fast heartbeats); stops them all at the end."""
    nodes: list[Node] = []

    async def start(
        node_id: str, warehouse: Path, peers: list[str] | None = None, **config: Any
    ) -> Node:
        settings = {"port": 0, **FAST, **config}
        node = Node(
            NodeConfig(
                node_id=node_id,
                warehouse=warehouse,
                engine="delta-rs",
                peers=peers or [],
                **settings,
            )
        )
        await node.start()
        nodes.append(node)
        return node

    yield start
    for node in reversed(nodes):
        await node.stop()


async def cluster_body(node: Node) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{node.address}/v1/cluster") as resp,
    ):
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body


async def member_row(node: Node, address: str) -> dict[str, Any] | None:
    """``node``'s row for the peer at ``address`` in its ``/v1/cluster`` answer."""
    rows = (await cluster_body(node))["members"]
    return next((r for r in rows if r["address"] == address and not r["self"]), None)


async def wait_for(check: Callable[[], Awaitable[Any]], failure: str, timeout: float = 10.0) -> Any:
    """Poll ``check`` until it returns something truthy (there is no event for a peer's view
    changing over HTTP); fail with ``failure`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := await check()):
        assert time.monotonic() < deadline, f"{failure} (within {timeout}s)"
        await asyncio.sleep(0.05)
    return value


def uri(path: Path) -> str:
    return path.resolve().as_uri()


# -- The defect: a node with a typo'd warehouse ---------------------------------------------


async def test_a_node_on_another_warehouse_is_refused_and_gets_no_rows(
    tmp_path: Path, start_node: StartNode, caplog: pytest.LogCaptureFixture
) -> None:
    wh, other = tmp_path / "wh", tmp_path / "wh2"
    n1 = await start_node("n1", wh)
    n2 = await start_node("n2", wh, peers=[n1.address])
    await asyncio.gather(n1.wait_for_members(2), n2.wait_for_members(2))
    n3 = await start_node("n3", other, peers=[n1.address, n2.address])

    async def knows_n3(node: Node) -> bool:
        row = await member_row(node, n3.address)
        return row is not None and row["node"] == "n3"

    for node in (n1, n2):  # both have polled n3 since it announced itself
        await wait_for(lambda node=node: knows_n3(node), f"{node.node_id} never polled n3")

    rows = [{"id": i, "v": i * 3} for i in range(10_000)]
    async with deltaflow.connect([n1.address]) as client:
        summary = await client.stream_data(rows, table="events", key="id")
    assert summary.items_acked == 10_000
    landed = DeltaTable(str(wh / "events")).to_pyarrow_table().to_pylist()
    assert sorted(r["id"] for r in landed) == list(range(10_000)), "rows missing from the cluster"
    assert not (other / "events").exists(), "rows were committed into n3's other warehouse"
    assert n3.statistics().owned_partitions == 0
    assert set(summary.per_node) <= {"n1", "n2"}

    row = await member_row(n1, n3.address)
    assert row is not None and row["state"] == "refused" and row["live"] is False, row
    assert uri(other) in row["refused"] and uri(wh) in row["refused"], row["refused"]
    assert f"start n3 with --warehouse {wh.resolve()}" in row["refused"]
    own = await cluster_body(n3)
    assert own["serving"] is False and own["refused"], own
    assert uri(other) in own["refused"] and uri(wh) in own["refused"]
    assert set(own["map"]["nodes"]) == {"n1", "n2"}, "n3 must hand out the cluster's map"
    assert own["identity"]["warehouse"] == uri(other)
    n3_errors = [
        r for r in caplog.records if r.levelno == logging.ERROR and "node n3 refused" in r.message
    ]
    assert len(n3_errors) == 3, "once on each of n1, n2 and n3: " + repr(n3_errors)

    # A client that reaches only n3 is sent to the real owners, with a warning.
    with caplog.at_level(logging.WARNING, logger="deltaflow.client.router"):
        async with deltaflow.connect([n3.address]) as client:
            summary = await client.stream_data(rows[:1000], table="via_n3", key="id")
    assert summary.items_acked == 1000 and "n3" not in summary.per_node
    assert len(DeltaTable(str(wh / "via_n3")).to_pyarrow_table()) == 1000
    assert not (other / "via_n3").exists()
    assert any("refused by its cluster" in r.message for r in caplog.records)

    # A client whose stale map names n3 as the owner is sent on by n3's NOT_OWNER.
    async with deltaflow.connect([n3.address]) as client:
        client._router._map = PartitionMap.build(0, {"n3": n3.address}, 64)
        summary = await client.stream_data(rows[:1000], table="redirected", key="id")
    assert summary.items_acked == 1000
    assert summary.per_node["n3"].errors > 0, "no batch went to n3"
    assert summary.per_node["n3"].items_acked == 0, "n3 applied rows"
    assert len(DeltaTable(str(wh / "redirected")).to_pyarrow_table()) == 1000
    assert not (other / "redirected").exists()


async def test_with_a_peer_token_a_node_on_another_warehouse_still_refuses_itself(
    tmp_path: Path, start_node: StartNode
) -> None:
    # Its peers' keys are in their warehouse, which it cannot read: their proven answers of
    # another identity refuse it all the same, without handing out a map it cannot check.
    wh, other = tmp_path / "wh", tmp_path / "wh2"
    creds = {"token": "client-token", "peer_token": "peer-token"}
    n1 = await start_node("n1", wh, **creds)
    n3 = await start_node("n3", other, peers=[n1.address], **creds)

    async def body(node: Node) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"http://{node.address}/v1/cluster",
                headers={"Authorization": "Bearer client-token"},
            ) as resp,
        ):
            assert resp.status == 200
            answer: dict[str, Any] = await resp.json()
            return answer

    async def n3_refused() -> bool:
        return bool((await body(n3))["refused"])

    await wait_for(n3_refused, "n3, on another warehouse, never refused itself")
    own = await body(n3)
    assert own["serving"] is False and uri(wh) in own["refused"], own["refused"]
    assert n3.statistics().owned_partitions == 0
    assert "n1" not in own["map"]["nodes"], "n3 handed out a map it could not check"

    # n1 cannot check n3's key either: n3's polls only learn who n1 is, and n1 owns all.
    assert set((await body(n1))["map"]["nodes"]) == {"n1"}


async def test_a_new_cluster_leaves_out_its_one_typo_even_when_it_starts_first(
    tmp_path: Path, start_node: StartNode
) -> None:
    wh, typo = tmp_path / "wh", tmp_path / "typo"
    ports = {name: free_port() for name in ("n1", "n2", "n3")}
    addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}

    async def start(name: str, warehouse: Path) -> Node:
        peers = [a for n, a in addresses.items() if n != name]
        # A long peer_expiry: n3 cannot count as serving before it has heard from both others.
        return await start_node(name, warehouse, peers, port=ports[name], peer_expiry=30.0)

    n3 = await start("n3", typo)  # alone, it serves its own warehouse for now
    n1 = await start("n1", wh)
    n2 = await start("n2", wh)
    pmap = await n1.wait_for_members(2, timeout=10)
    assert set(pmap.addresses) == {"n1", "n2"}
    await n2.wait_for_members(2, timeout=10)

    async def n3_refused() -> bool:
        return bool((await cluster_body(n3))["refused"])

    await wait_for(n3_refused, "n3, the only node on another warehouse, was never refused")
    assert n3.statistics().owned_partitions == 0
    owned = [n.statistics().owned_partitions for n in (n1, n2)]
    assert sum(owned) == 64 and min(owned) > 0, owned


# -- The decision, unit by unit --------------------------------------------------------------

CLUSTER = NodeIdentity(
    cluster_id="9f8e7d6c" + "0" * 24,
    created_at_ms=2_000,
    warehouse="file:///data/wh",
    partitions=64,
)
TYPO = NodeIdentity(
    cluster_id="1a2b3c4d" + "0" * 24,
    created_at_ms=1_000,  # older: age alone must not let it win
    warehouse="file:///data/wh2",
    partitions=64,
)


def other(**changes: Any) -> NodeIdentity:
    fields = {**CLUSTER.to_wire(), **changes}
    return NodeIdentity(**fields)


def views(nodes: list[Candidate]) -> dict[str, bool]:
    """Each node's own verdict, deciding from all the others: node id -> admitted."""
    return {own.node_id: decide(own, [c for c in nodes if c is not own]).admitted for own in nodes}


def test_a_newcomer_with_another_warehouse_loses_to_a_serving_node() -> None:
    nodes = [Candidate("n1", CLUSTER, serving=True), Candidate("n3", TYPO, serving=False)]
    assert views(nodes) == {"n1": True, "n3": False}
    assert refusal_message("n3", TYPO, "n1", CLUSTER) == (
        "node n3 refused by the cluster: its warehouse file:///data/wh2 (cluster 1a2b3c4d) "
        "differs from node n1's file:///data/wh (cluster 9f8e7d6c); "
        "start n3 with --warehouse /data/wh"
    )


def test_among_fresh_nodes_the_identity_of_most_nodes_wins() -> None:
    nodes = [
        Candidate("n1", CLUSTER, serving=False),
        Candidate("n2", CLUSTER, serving=False),
        Candidate("n3", TYPO, serving=False),
    ]
    assert views(nodes) == {"n1": True, "n2": True, "n3": False}
    # Serving outranks numbers: two newcomers do not take over one serving node.
    joined = [Candidate("n0", TYPO, serving=True), *nodes[:2]]
    assert views(joined) == {"n0": True, "n1": False, "n2": False}


def test_a_partition_count_mismatch_is_refused_with_the_flag_to_fix() -> None:
    fewer = other(partitions=32)
    nodes = [Candidate("n1", CLUSTER, serving=True), Candidate("n2", fewer, serving=False)]
    assert views(nodes) == {"n1": True, "n2": False}
    message = refusal_message("n2", fewer, "n1", CLUSTER)
    assert message.endswith("start n2 with --partitions 64"), message
    assert "its partition count 32 differs from node n1's 64" in message


def test_a_warehouse_path_holding_another_cluster_is_named_as_such() -> None:
    elsewhere = other(cluster_id="5" * 32, created_at_ms=3_000)
    message = refusal_message("n2", elsewhere, "n1", CLUSTER)
    assert "its warehouse file:///data/wh holds cluster 55555555" in message, message
    assert "node n1's holds cluster 9f8e7d6c" in message
    assert "mount the warehouse of node n1 at /data/wh on n2's machine" in message


def test_ties_break_the_same_way_on_every_node_whatever_the_order() -> None:
    # Same serving and count: the oldest record wins, then the smallest identity.
    older = [Candidate("a", CLUSTER, False), Candidate("b", TYPO, False)]
    same_age = [
        Candidate("a", other(warehouse="file:///mnt/b"), False),
        Candidate("b", other(warehouse="file:///mnt/a"), False),
    ]
    for nodes, want in ((older, TYPO), (same_age, other(warehouse="file:///mnt/a"))):
        winners = {winning_identity(p) for p in itertools.permutations(nodes)}
        assert winners == {want}
        assert sum(views(nodes).values()) == 1


def test_a_refused_node_never_serves_on_its_own_authority() -> None:
    alone = decide(Candidate("n3", TYPO, False), [], refused=True)
    assert not alone.admitted, "the cluster that refused it is gone: it stays refused"
    beside = decide(Candidate("n3", TYPO, False), [Candidate("n4", TYPO, True)], refused=True)
    assert beside.admitted, "it rejoins a serving node of its own identity"


# -- The identity file -------------------------------------------------------------------------


def test_the_identity_file_is_created_once_and_read_by_the_next_node(tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    first = load_identity(wh, node_id="n1", partitions=64)
    written = (wh / CLUSTER_FILE).read_text()
    second = load_identity(wh, node_id="n2", partitions=64)
    assert first == second
    assert first.warehouse == uri(wh) and len(first.cluster_id) == 32
    assert (wh / CLUSTER_FILE).read_text() == written, "the second node rewrote the file"
    assert json.loads(written)["created_by"] == "n1"
    assert sorted(p.name for p in (wh / CLUSTER_FILE).parent.iterdir()) == ["cluster.json"]
    # The same directory reached by another spelling is the same warehouse.
    alias = load_identity(tmp_path / "x" / ".." / "wh", node_id="n3", partitions=64)
    assert alias == first


def test_nodes_racing_to_create_the_identity_agree_on_one(tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    barrier = threading.Barrier(8)
    ids: list[str] = []

    def create(name: str) -> None:
        store = FileIdentityStore(wh)
        barrier.wait()
        ids.append(store.load_or_create(name).cluster_id)

    threads = [threading.Thread(target=create, args=(f"n{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(ids) == 8 and len(set(ids)) == 1, ids
    assert sorted(p.name for p in (wh / CLUSTER_FILE).parent.iterdir()) == ["cluster.json"]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"cluster_id": "x"}',
        '{"cluster_id": 1, "created_at_ms": 1, "created_by": "n"}',
    ],
)
async def test_a_malformed_identity_file_stops_the_node_with_its_path(
    tmp_path: Path, content: str
) -> None:
    wh = tmp_path / "wh"
    (wh / CLUSTER_FILE).parent.mkdir(parents=True)
    (wh / CLUSTER_FILE).write_text(content)
    node = Node(NodeConfig(node_id="n1", warehouse=wh, port=0, engine="delta-rs", **FAST))
    with pytest.raises(UsageError) as raised:
        await node.start()
    assert f"cluster identity file {(wh / CLUSTER_FILE).resolve()} is malformed" in str(
        raised.value
    )
    assert node.state is NodeState.STOPPED


# -- Peers that leave --------------------------------------------------------------------------


class Listener:
    """A bare HTTP server on a port that counts the polls it gets (and answers 503)."""

    def __init__(self, port: int, want: int = 3) -> None:
        self.port, self.want, self.polls = port, want, 0
        self.reached = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def _cluster(self, request: web.Request) -> web.Response:
        self.polls += 1
        if self.polls >= self.want:
            self.reached.set()
        return web.Response(status=503)

    async def __aenter__(self) -> Listener:
        app = web.Application()
        app.router.add_post("/v1/peer/poll", self._cluster)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


async def test_a_peer_silent_for_peer_expiry_has_left_and_only_configured_ones_are_polled(
    tmp_path: Path, start_node: StartNode
) -> None:
    timing = {"heartbeat_interval": 0.1, "failure_timeout": 0.5, "peer_expiry": 1.5}
    configured = f"127.0.0.1:{free_port()}"  # in n1's --peers, never up
    n1 = await start_node("n1", tmp_path / "wh", peers=[configured], **timing)
    n2 = await start_node("n2", tmp_path / "wh", peers=[n1.address], **timing)
    await n1.wait_for_members(2)  # n1 learned n2 from n2's polls
    learned = n2.address
    await n2.stop()
    stopped = time.monotonic()
    seen: list[str] = []

    async def has_left() -> bool:
        row = await member_row(n1, learned)
        assert row is not None
        if not seen or seen[-1] != row["state"]:
            seen.append(row["state"])
        return bool(row["state"] == "left")

    await wait_for(has_left, "n2 never shown as left", timeout=10)
    assert time.monotonic() - stopped > 1.5 - 0.3, "left before peer_expiry"
    assert seen[-2:] == ["dead", "left"], seen
    row = await member_row(n1, configured)
    assert row is not None and row["state"] == "left" and row["node"] is None, row

    # n1 still polls the configured address, no longer the one it only learned.
    async with (
        Listener(int(learned.rsplit(":", 1)[1])) as gone,
        Listener(int(configured.rsplit(":", 1)[1])) as kept,
    ):
        async with asyncio.timeout(5):
            await kept.reached.wait()
        assert gone.polls == 0, "n1 still polls a peer that left and was not configured"


# -- What `deltaflow cluster status` shows ------------------------------------------------------


def cluster_status(address: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "deltaflow.cli", "cluster", "status", "--node", address],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_cluster_status_shows_the_refused_node_and_why(
    tmp_path: Path, start_node: StartNode
) -> None:
    wh, other_wh = tmp_path / "wh", tmp_path / "wh2"
    n1 = await start_node("n1", wh)
    n3 = await start_node("n3", other_wh, peers=[n1.address])

    async def refused() -> bool:
        row = await member_row(n1, n3.address)
        return row is not None and row["state"] == "refused"

    await wait_for(refused, "n1 never listed n3 as refused")
    assert n1.identity is not None and n3.identity is not None
    seen_by_n1 = await asyncio.to_thread(cluster_status, n1.address)
    assert f"  n3               {n3.address:<22} REFUSED partitions=0" in seen_by_n1, seen_by_n1
    assert f"node n3 refused by the cluster: its warehouse {uri(other_wh)}" in seen_by_n1
    assert f"  n1               {n1.address:<22} live    partitions=64" in seen_by_n1
    assert (
        f"identity: cluster {n1.identity.cluster_id}, warehouse {uri(wh)}, 64 partitions"
    ) in seen_by_n1

    seen_by_n3 = await asyncio.to_thread(cluster_status, n3.address)
    assert "REFUSED: node n3 refused by the cluster" in seen_by_n3, seen_by_n3
    assert f"start n3 with --warehouse {wh.resolve()}" in seen_by_n3
    assert f"warehouse {uri(other_wh)}" in seen_by_n3
    assert f"  n1               {n1.address:<22} live    partitions=64" in seen_by_n3
    assert "  n1: 0 1 2" in seen_by_n3, "the map shown is the cluster's"
