"""A peer cannot forge another (issue 47, findings 2, 5 and 6; docs/security.md, "Roles").

A commit call is proven in headers over its body's digest, so a stranger's body is refused
unread; it must carry the signature of the node it names, with the key the warehouse holds
for that node, so the peer token alone cannot commit as a live node; the committer commits a
node's group only within that node's partitions; a file path that is not one of the table's
own is refused. A node's polls and leaves must be signed too, and so are its answers: a
peer-token holder can neither join as a node nor answer polls as one. Real nodes on
127.0.0.1, the tables read back with ``deltalake``; the fake node is a real HTTP server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import deltaflow
from deltaflow.security import answer_proof, call_proof
from deltaflow.server import Node, NodeConfig
from deltaflow.server.identity import NodeKey
from deltaflow.server.local_cluster import start_local_nodes
from deltaflow.tables.commit.prepared import PreparedCommit, WireError
from deltaflow.testing import free_port

from .support import Eventually, StartCluster, engine_options, open_table

TOKEN = "the-client-token"
PEER_TOKEN = "the-peer-token"
MiB = 1024 * 1024
#: The header names of a commit call's proof (docs/protocol.md, "Peer calls").
HEADERS = {
    "node": "X-Deltaflow-Node",
    "address": "X-Deltaflow-Address",
    "nonce": "X-Deltaflow-Nonce",
    "challenge": "X-Deltaflow-Challenge",
    "proof": "X-Deltaflow-Call-Proof",
    "digest": "X-Deltaflow-Digest",
    "signature": "X-Deltaflow-Signature",
}


@pytest.fixture
async def two_nodes(warehouse: Path) -> AsyncIterator[list[Node]]:
    """Two delta-rs nodes with a client and a peer token, 8 partitions and tables of 8 fixed
    buckets (bucket b holds partition b); a short failure timeout, so that a refused group's
    wait for the committer's map to change is short."""
    config = NodeConfig(
        node_id="node-1",
        warehouse=warehouse,
        port=0,
        token=TOKEN,
        peer_token=PEER_TOKEN,
        partitions=8,
        table_buckets=8,
        table_bucket_rows=0,
        heartbeat_interval=0.2,
        failure_timeout=1.5,
        **engine_options("delta-rs"),
    )
    nodes = await start_local_nodes(2, config)
    try:
        yield nodes
    finally:
        for node in reversed(nodes):
            await node.stop()


async def live_table(nodes: list[Node], warehouse: Path, rows: int = 200) -> tuple[Node, Node]:
    """Table ``live`` with ``rows`` rows streamed by a client; its committer and the other
    node (the writer of some of its partitions)."""
    async with deltaflow.connect([n.address for n in nodes], token=TOKEN) as client:
        summary = await client.stream_data(
            [{"id": i, "v": "x"} for i in range(rows)], table="live", key="id"
        )
    assert summary.items_acked == rows
    committer_id = nodes[0].partition_map.committer("live")
    committer = next(n for n in nodes if n.node_id == committer_id)
    writer = next(n for n in nodes if n is not committer)
    return committer, writer


def table_state(warehouse: Path) -> tuple[int, int]:
    """The version and row count of ``live``, by delta-rs."""
    table = open_table(warehouse / "live")
    return table.version(), table.to_pyarrow_table().num_rows


def live_lanes(warehouse: Path) -> dict[str, list[int]]:
    lanes: dict[str, list[int]] = {}
    for entry in open_table(warehouse / "live").history():
        if "userMetadata" in entry:
            lanes |= json.loads(entry["userMetadata"])["deltaflow"].get("lanes", {})
    return lanes


def live_files(warehouse: Path) -> list[str]:
    return sorted(open_table(warehouse / "live").file_uris())


def relative(warehouse: Path, uri: str) -> str:
    return uri.removeprefix("file://").removeprefix(str(warehouse / "live") + "/")


async def header_call(
    http: aiohttp.ClientSession,
    address: str,
    body: bytes,
    *,
    caller: Node | None,
    node_id: str,
    node_address: str,
    secret: str | None = PEER_TOKEN,
    digest: str | None = None,
    proven: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """A commit call proven in headers (the HMAC over the body's digest), signed with
    ``caller``'s key when given: first an empty call for a challenge, then the body."""
    from deltaflow.server.peer_gate import call_message

    nonce = secrets.token_hex(16)
    fields = {"node": node_id, "address": node_address, "nonce": nonce, "digest": "0" * 64}
    asked = {HEADERS[k]: v for k, v in fields.items()}
    async with http.post(f"http://{address}/v1/peer/commit", data=b"", headers=asked) as resp:
        assert resp.status == 401
        challenge = (await resp.json())["challenge"]
    digest = digest or hashlib.sha256(body).hexdigest()
    fields |= {"challenge": challenge, "digest": digest}
    if secret is not None:
        covered = proven or digest  # the HMAC's payload: the digest (unless told otherwise)
        fields["proof"] = call_proof(
            secret, "commit", challenge, nonce, node_id, node_address, covered
        )
    if caller is not None:
        message = call_message("commit", challenge, nonce, node_id, node_address, digest)
        fields["signature"] = caller.key.sign(message)
    headers = {HEADERS[k]: v for k, v in fields.items()}
    async with http.post(f"http://{address}/v1/peer/commit", data=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def body_call(
    http: aiohttp.ClientSession, address: str, payload: str, *, node_id: str, node_address: str
) -> int:
    """A commit call proven in its JSON body, as peers made them before (the peer token
    alone)."""
    nonce = "0" * 32
    call: dict[str, Any] = {"node": node_id, "address": node_address, "nonce": nonce}
    call["payload"] = payload
    async with http.post(f"http://{address}/v1/peer/commit", json=call) as resp:
        challenge = (await resp.json()).get("challenge")
    call["challenge"] = challenge
    call["proof"] = call_proof(
        PEER_TOKEN, "commit", str(challenge), nonce, node_id, node_address, payload
    )
    async with http.post(f"http://{address}/v1/peer/commit", json=call) as resp:
        return resp.status


def rss_peak() -> int:
    """This process's peak resident memory since the last :func:`reset_peak`, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS


async def test_a_strangers_commit_body_is_refused_unread_and_memory_stays_bounded(
    warehouse: Path, start_cluster: StartCluster
) -> None:
    """Finding 2: 8 bodies of ``[{},{},...]`` (8 MiB each), 4 at a time, without a proof:
    the node parsed each on its event loop before looking at the proof (RSS +1.6 GB, kept by
    a reference cycle; ``/healthz`` 1.0-1.6 s). Now each is refused 401 unread."""
    (node,) = await start_cluster(
        warehouse, count=1, engine="delta-rs", token=TOKEN, peer_token=PEER_TOKEN
    )
    bomb = b"[" + b"{}," * ((8 * MiB - 16) // 3) + b"{}]"
    url = f"http://{node.address}/v1/peer/commit"
    statuses: list[int] = []
    slowest = 0.0
    done = asyncio.Event()

    async def probe(http: aiohttp.ClientSession) -> None:
        nonlocal slowest
        while not done.is_set():
            started = time.monotonic()
            async with http.get(f"http://{node.address}/healthz") as resp:
                assert resp.status == 200
            slowest = max(slowest, time.monotonic() - started)
            await asyncio.sleep(0.02)

    async def attack(http: aiohttp.ClientSession, limit: asyncio.Semaphore) -> None:
        async with limit:
            try:
                async with http.post(url, data=bomb) as resp:
                    statuses.append(resp.status)
            except aiohttp.ClientError:
                statuses.append(0)  # refused mid-send: the node closed without reading

    await asyncio.sleep(0)
    reset_peak()
    before = rss_peak()
    async with aiohttp.ClientSession() as http:
        prober = asyncio.create_task(probe(http))
        limit = asyncio.Semaphore(4)
        await asyncio.gather(*(attack(http, limit) for _ in range(8)))
        done.set()
        await prober
    grown = rss_peak() - before
    assert grown < 256 * MiB, f"RSS grew by {grown / MiB:.0f} MiB"
    assert slowest < 0.5, f"/healthz took {slowest:.2f} s while the bodies arrived"
    assert set(statuses) <= {401, 0}, statuses


async def test_a_commit_is_proven_in_headers_over_its_body(two_nodes: list[Node]) -> None:
    """A proven commit's body is read and must be the one its digest names; a node sends
    only its own groups; a table the warehouse does not hold gets no committer; a body past
    8 MiB is refused 413 unread."""
    first, second = two_nodes
    body = json.dumps(PreparedCommit("t", second.node_id, 0, [], {}, {}).to_wire()).encode()
    swapped = body.replace(b'"read_version": 0', b'"read_version": 7')
    other = json.dumps(PreparedCommit("t", first.node_id, 0, [], {}, {}).to_wire()).encode()
    me = {"caller": second, "node_id": second.node_id, "node_address": second.address}
    async with aiohttp.ClientSession() as http:
        status, answer = await header_call(http, first.address, body, secret=TOKEN, **me)
        assert status == 401 and "wrong peer proof" in answer["error"]
        # The peer proof covers the digest too, not the signature alone.
        status, answer = await header_call(http, first.address, body, proven="1" * 64, **me)
        assert status == 401 and "wrong peer proof" in answer["error"]
        digest = hashlib.sha256(body).hexdigest()
        status, answer = await header_call(http, first.address, swapped, digest=digest, **me)
        assert status == 400 and "digest" in answer["error"]
        assert (await header_call(http, first.address, other, **me))[0] == 403
        status, answer = await header_call(http, first.address, body, **me)
        assert status == 404 and "no table 't'" in answer["error"]
        huge = {"Content-Length": str(9 * MiB)}
        async with http.post(f"http://{first.address}/v1/peer/commit", headers=huge) as resp:
            assert resp.status == 413
    assert first.engine.tables() == {}


async def test_the_peer_token_alone_cannot_commit_as_a_live_node(
    warehouse: Path, two_nodes: list[Node]
) -> None:
    """Finding 5: with the peer token, claiming to be a live node, lane marks ``[10^6, 0]``
    on a live stream's lanes (its next rows acked and never written) and the removal of a
    live file (the table emptied) were committed. In either form of the call, the token alone
    commits nothing now: the call must carry the named node's signature."""
    nodes = two_nodes
    committer, writer = await live_table(nodes, warehouse)
    version, rows = table_state(warehouse)
    assert rows == 200
    forged = PreparedCommit(
        "live",
        writer.node_id,
        version,
        [
            {"remove": {"path": relative(warehouse, f), "dataChange": True}}
            for f in live_files(warehouse)
        ],
        {lane: (10**6, 0) for lane in live_lanes(warehouse)},
        {lane: (10**6, 0) for lane in live_lanes(warehouse)},
    )
    payload = json.dumps(forged.to_wire())
    impostor = {"node_id": writer.node_id, "node_address": writer.address}
    async with aiohttp.ClientSession() as http:
        assert await body_call(http, committer.address, payload, **impostor) != 200
        status, answer = await header_call(
            http, committer.address, payload.encode(), caller=None, **impostor
        )
        assert status == 401 and f"node {writer.node_id}" in answer["error"]
    assert table_state(warehouse) == (version, 200)


async def test_a_group_outside_its_writers_partitions_is_sent_back(
    warehouse: Path, two_nodes: list[Node]
) -> None:
    """Even a node's own signed call commits only within its partitions: a lane of a
    partition it does not own, or the removal of a file in a bucket of none of its
    partitions, is answered ``retry`` with the reason, and the table keeps its rows."""
    nodes = two_nodes
    committer, writer = await live_table(nodes, warehouse)
    pmap = committer.partition_map
    theirs = next(p for p, owner in enumerate(pmap.owners) if owner != writer.node_id)
    mine = next(p for p, owner in enumerate(pmap.owners) if owner == writer.node_id)
    version, _ = table_state(warehouse)
    foreign_file = next(
        relative(warehouse, f) for f in live_files(warehouse) if f"_deltaflow_bucket={theirs}/" in f
    )
    me = {"caller": writer, "node_id": writer.node_id, "node_address": writer.address}

    def group(actions: list[dict[str, Any]], lane: str) -> bytes:
        marks = {lane: (1, 0)}
        prepared = PreparedCommit("live", writer.node_id, version, actions, marks, marks)
        return json.dumps(prepared.to_wire()).encode()

    remove = [{"remove": {"path": foreign_file, "dataChange": True}}]
    async with aiohttp.ClientSession() as http:
        for body, reason in (
            (group([], f"forged/{theirs}"), f"does not own partition {theirs}"),
            (group(remove, f"forged/{mine}"), f"bucket {theirs} holds no partition"),
        ):
            status, answer = await header_call(http, committer.address, body, **me)
            assert status == 200, answer
            assert answer["outcome"]["kind"] == "retry"
            assert reason in answer["outcome"]["reason"]
        assert table_state(warehouse) == (version, 200)
        # Within its own partitions the same node's group commits.
        status, answer = await header_call(
            http, committer.address, group([], f"probe/{mine}"), **me
        )
        assert status == 200 and answer["outcome"]["kind"] == "committed", answer
    assert table_state(warehouse) == (version + 1, 200)


@pytest.mark.parametrize(
    "path",
    [
        "%2E%2E/live/_deltaflow_bucket=1/part-00000-0-c000.snappy.parquet",
        "%2e%2e/live/part-0.parquet",
        "%252E%252E/live/part-0.parquet",
        "_deltaflow_bucket=1/%2E%2E/%2E%2E/live/part-0.parquet",
        "_deltaflow_bucket=1/../part-0.parquet",
        "_deltaflow_bucket=1/..part-0.parquet",
        "other_column=1/part-0.parquet",
        "_deltaflow_bucket=01/part-0.parquet",
        "_deltaflow_bucket=1/sub/part-0.parquet",
        "part-0.parquet.crc",
        "_delta_log/00000000000000000001.json",
        "\uff0e\uff0e/live/part-0.parquet",
    ],
)
def test_a_path_outside_the_tables_own_layout_is_refused(path: str) -> None:
    """Finding 6: ``%2E%2E/live/_deltaflow_bucket=1/part-....parquet`` passed the path check
    and Spark decoded it, reading another table's rows. Only the names the writers produce
    pass: a bucket directory, a parquet file, nothing encoded."""
    group = PreparedCommit("t", "n1", 0, [{"add": {"path": path, "size": 1}}], {}, {})
    with pytest.raises(WireError, match="inside the table's own layout"):
        PreparedCommit.from_wire(group.to_wire())
    for good in (
        "_deltaflow_bucket=7/part-00000-6a20a301-d29e-4f17-a1c7-d76a575b9369-c000.snappy.parquet",
        "part-00000-cc7901dd-ce9f-456d-add0-1d07e1f54687-c000.zstd.parquet",
    ):
        ok = PreparedCommit("t", "n1", 0, [{"add": {"path": good, "size": 1}}], {}, {})
        assert PreparedCommit.from_wire(ok.to_wire()).actions == ok.actions


class FakeNode:
    """An HTTP server on 127.0.0.1 that answers polls as node ``node_id`` at its own address,
    as a peer-token holder can: each answer proves the token over its exact bytes, carries the
    cluster's identity (anyone who reads the map can copy it) and is signed with a key of its
    own, which the warehouse does not hold. It records every other request."""

    def __init__(self, node_id: str, identity: dict[str, Any]) -> None:
        self.node_id, self.identity = node_id, identity
        self.key = NodeKey(node_id)  # never published: it may not write the warehouse
        self.paths: list[str] = []
        self.answered = asyncio.Event()
        self.address = f"127.0.0.1:{free_port()}"
        self._runner: web.AppRunner | None = None

    async def _poll(self, request: web.Request) -> web.Response:
        from deltaflow.server.peer_gate import answer_message

        nonce = (await request.json())["nonce"]
        answer = {
            "node": self.node_id, "address": self.address, "identity": self.identity,
            "serving": True, "refused": None, "map": None, "members": [], "draining": False,
            "receivers": [], "challenge": secrets.token_hex(16),
        }  # fmt: skip
        data = json.dumps(answer).encode()
        headers = {
            "X-Deltaflow-Proof": answer_proof(PEER_TOKEN, nonce, data),
            "X-Deltaflow-Answer-Signature": self.key.sign(
                answer_message(self.node_id, nonce, data)
            ),
        }
        self.answered.set()
        return web.Response(body=data, content_type="application/json", headers=headers)

    async def _other(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        return web.Response(status=404)

    async def __aenter__(self) -> FakeNode:
        app = web.Application()
        app.router.add_post("/v1/peer/poll", self._poll)
        app.router.add_route("*", "/{tail:.*}", self._other)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", int(self.address.rsplit(":", 1)[1])).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


def node_config(warehouse: Path, node_id: str, peers: list[str]) -> NodeConfig:
    return NodeConfig(
        node_id=node_id, warehouse=warehouse, port=0, token=TOKEN, peer_token=PEER_TOKEN,
        partitions=8, heartbeat_interval=0.1, failure_timeout=2.0, peers=peers,
        **engine_options("delta-rs"),
    )  # fmt: skip


async def cluster_view(node: Node) -> dict[str, Any]:
    """``GET /v1/cluster`` of ``node``, as a client holding the token reads it."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"http://{node.address}/v1/cluster", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp,
    ):
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body


async def test_a_token_holding_fake_answering_as_a_live_node_is_refused_and_owns_nothing(
    warehouse: Path, eventually: Eventually
) -> None:
    """Finding 5, the answers: a peer-token holder answering polls as live node ``n2`` at
    another address (in n1's --peers after n2's) was counted as n2, and n1's map sent n2's
    partitions, and so clients, to it. Its answer is not signed with n2's key now: it is
    refused, says why, and no node's map names its address."""
    n2 = Node(node_config(warehouse, "n2", []))
    await n2.start()
    assert n2.identity is not None
    try:
        async with FakeNode("n2", n2.identity.to_wire()) as fake:
            n1 = Node(node_config(warehouse, "n1", [n2.address, fake.address]))
            await n1.start()
            try:
                await n1.wait_for_members(2, timeout=10)
                await eventually(
                    lambda: any(
                        m["address"] == fake.address and m["node"] == "n2" for m in n1.members()
                    ),
                    "n1 polled the fake node",
                )
                row = next(
                    m for m in (await cluster_view(n1))["members"] if m["address"] == fake.address
                )
                assert row["state"] == "refused", row
                assert "did not prove it is node n2: no key of n2 in the warehouse" in str(
                    row["refused"]
                )
                for node in (n1, n2):
                    nodes = (await cluster_view(node))["map"]["nodes"]
                    assert fake.address not in nodes.values(), nodes
                assert n1.partition_map.addresses == {"n1": n1.address, "n2": n2.address}
                async with deltaflow.connect([n1.address], token=TOKEN) as client:
                    summary = await client.stream_data(
                        [{"id": i} for i in range(100)], table="t", key="id"
                    )
                assert summary.items_acked == 100 and set(summary.per_node) <= {"n1", "n2"}
                assert fake.paths == [], "a client or a peer was sent to the fake node"
            finally:
                await n1.stop()
    finally:
        await n2.stop()


async def test_an_unsigned_poll_claiming_a_node_is_refused_and_not_learned(
    two_nodes: list[Node],
) -> None:
    """Finding 5, the calls: a poll proving the peer token, claiming live node node-2 at
    another address, made the node learn that address and poll it (the step before a fake
    answers there). A poll must be signed with the named node's key now: refused 401, and
    the address is never a member."""
    first, second = two_nodes
    impostor = f"127.0.0.1:{free_port()}"
    nonce = "2" * 32
    call: dict[str, Any] = {"node": second.node_id, "address": impostor, "nonce": nonce}
    async with aiohttp.ClientSession() as http:
        url = f"http://{first.address}/v1/peer/poll"
        async with http.post(url, json=call) as resp:
            assert resp.status == 401
            challenge = (await resp.json())["challenge"]
        call["challenge"] = challenge
        call["proof"] = call_proof(PEER_TOKEN, "poll", challenge, nonce, second.node_id, impostor)
        async with http.post(url, json=call) as resp:
            assert resp.status == 401
            error = (await resp.json())["error"]
    assert f"not signed with the key the warehouse holds for node {second.node_id}" in error
    addresses = [m["address"] for m in first.members()]
    assert impostor not in addresses and len(addresses) == 2, addresses
