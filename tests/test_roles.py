"""Roles: strangers get a refusal, clients stream and read the map, only peers and operators
change membership or drain, and no secret goes to an address that has not proven itself
(docs/security.md, "Roles"). Real nodes on 127.0.0.1; the impostors are real HTTP servers."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from deltaflow.errors import UsageError
from deltaflow.security import NodeTls, call_proof
from deltaflow.server import Node, NodeConfig, NodeState
from deltaflow.server.identity import NodeKey
from deltaflow.server.peer_gate import call_message
from deltaflow.tables.commit.prepared import PreparedCommit
from deltaflow.testing import free_port
from deltaflow.testing.certificates import CertificateAuthority

TOKEN = "the-client-token-clients-hold"
PEER_TOKEN = "the-peer-token-only-nodes-hold"


def config(warehouse: Path, node_id: str, **options: Any) -> NodeConfig:
    return NodeConfig(
        node_id=node_id,
        warehouse=warehouse,
        port=0,
        engine="delta-rs",
        heartbeat_interval=0.1,
        failure_timeout=2.0,
        **options,
    )


@pytest.fixture
async def pair(warehouse: Path) -> AsyncIterator[tuple[Node, Node]]:
    """Two nodes with a client token and a peer token of their own."""
    first = Node(config(warehouse, "n1", token=TOKEN, peer_token=PEER_TOKEN))
    await first.start()
    second = Node(
        config(warehouse, "n2", token=TOKEN, peer_token=PEER_TOKEN, peers=[first.address])
    )
    await second.start()
    try:
        await asyncio.gather(first.wait_for_members(2), second.wait_for_members(2))
        yield first, second
    finally:
        await second.stop()
        await first.stop()


async def members(node: Node) -> dict[str, dict[str, Any]]:
    """The node's members by address, as a client holding the token reads them."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"http://{node.address}/v1/cluster", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp,
    ):
        assert resp.status == 200
        return {m["address"]: m for m in (await resp.json())["members"]}


async def peer_call(
    http: aiohttp.ClientSession,
    address: str,
    op: str,
    *,
    secret: str | None,
    caller: str = "n9",
    caller_address: str = "127.0.0.1:1",
    headers: dict[str, str] | None = None,
    payload: str = "",
    proven: str | None = None,
    key: NodeKey | None = None,
) -> tuple[int, dict[str, Any]]:
    """A peer call as a peer makes it: fetch a challenge, prove ``secret`` over it (and over
    ``proven``, else ``payload``, the payload sent), and sign it with ``key`` if given."""
    path = "/v1/drain" if op == "drain" else f"/v1/peer/{op}"
    body: dict[str, Any] = {"node": caller, "address": caller_address, "nonce": "0" * 32}
    if payload:
        body["payload"] = payload
    async with http.post(f"http://{address}{path}", json=body, headers=headers) as resp:
        first = await resp.json()
        if resp.status != 401 or secret is None:
            return resp.status, first
    challenge = first["challenge"]
    body["challenge"] = challenge
    covered = payload if proven is None else proven
    body["proof"] = call_proof(secret, op, challenge, "0" * 32, caller, caller_address, covered)
    if key is not None:
        digest = hashlib.sha256(payload.encode()).hexdigest()
        message = call_message(op, challenge, "0" * 32, caller, caller_address, digest)
        body["signature"] = key.sign(message)
    async with http.post(f"http://{address}{path}", json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def published_key(warehouse: Path, node_id: str) -> NodeKey:
    """A key for ``node_id``, published where nodes publish theirs: what a caller who may
    write the warehouse can do (it then speaks as that node, as a node would)."""
    key = NodeKey(node_id)
    await asyncio.to_thread(key.publish, warehouse)
    return key


async def cluster_identity(warehouse: Path) -> dict[str, Any]:
    """The warehouse's cluster identity as a node shows it (anyone who may read the map can
    copy it)."""
    probe = Node(config(warehouse, "probe"))
    await probe.start()
    assert probe.identity is not None
    identity = probe.identity.to_wire()
    await probe.stop()
    return identity


class Listener:
    """A plain HTTP server on 127.0.0.1 that records every request it gets, whole, and
    answers each like a node would if it copied a node's identity (anyone allowed to read the
    map can): it knows no secret, so its proof is made up. ``answer`` replaces the body."""

    def __init__(self, identity: dict[str, Any] | None = None, answer: bytes | None = None) -> None:
        self.identity = identity
        self.answer = answer
        self.seen: list[bytes] = []
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def _answer(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = "".join(f"{k}: {v}\n" for k, v in request.headers.items())
        self.seen.append(f"{request.method} {request.path_qs}\n{headers}".encode() + body)
        proof = {"X-Deltaflow-Proof": secrets.token_hex(32)}
        if self.answer is not None:
            return web.Response(body=self.answer, content_type="application/json", headers=proof)
        return web.json_response(
            {"node": "intruder", "address": self.address, "identity": self.identity,
             "serving": True, "refused": None, "map": None, "members": [],
             "challenge": "1.2.3"}, headers=proof,
        )  # fmt: skip

    async def __aenter__(self) -> Listener:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.address = f"127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_no_secret_reaches_an_address_in_peers_that_has_not_proven_itself(
    warehouse: Path, eventually: Any
) -> None:
    """Finding 1: a node polled its peers with ``Authorization: Bearer <token>``, so a plain
    listener at an address in --peers got the token on the first poll, then proved it and
    took 4 of 8 partitions. Now a poll proves the secret over the callee's challenge and
    carries none; the listener's made-up proof gets it nothing."""
    async with Listener(await cluster_identity(warehouse)) as listener:
        node = Node(
            config(warehouse, "n1", token=TOKEN, peer_token=PEER_TOKEN, peers=[listener.address])
        )
        await node.start()
        try:
            await eventually(lambda: len(listener.seen) >= 5, "five polls of the listener")
            seen = b"\n".join(listener.seen)
            assert TOKEN.encode() not in seen
            assert PEER_TOKEN.encode() not in seen
            assert b"Authorization" not in seen
            state = (await members(node))[listener.address]
            assert state["state"] == "refused"
            assert "did not prove it holds the peer secret" in state["refused"]
            assert set(node.partition_map.owners) == {"n1"}
        finally:
            await node.stop()


async def test_a_client_cannot_push_a_live_node_out_or_drain_one(
    pair: tuple[Node, Node],
) -> None:
    """Finding 6: with the client token, ``POST /v1/leave`` naming a live node pushed it out
    of its peer's map, and ``POST /v1/drain`` stopped a node. Both are peer calls now; the
    client token proves nothing there."""
    first, second = pair
    victim = f"n2@{second.address}"
    async with aiohttp.ClientSession() as http:
        bearer = {"Authorization": f"Bearer {TOKEN}", "X-Deltaflow-Peer": victim}
        for _ in range(5):
            async with http.post(f"http://{first.address}/v1/leave", headers=bearer) as resp:
                assert resp.status in (404, 405)
            status, body = await peer_call(
                http, first.address, "leave", secret=TOKEN, caller="n2",
                caller_address=second.address, headers=bearer,
            )  # fmt: skip
            assert status == 401, body
            assert "wrong peer proof" in body["error"]
        status, body = await peer_call(http, second.address, "drain", secret=TOKEN, headers=bearer)
        assert status == 401
    assert first.partition_map.addresses == {"n1": first.address, "n2": second.address}
    assert second.state is NodeState.RUNNING


async def test_a_leave_is_taken_only_from_the_leaving_node_itself(
    pair: tuple[Node, Node], caplog: pytest.LogCaptureFixture
) -> None:
    """Even a caller holding the peer secret cannot take a live node out: its leave in the
    node's name is refused unless signed with that node's key, and even so the node that is
    told someone leaves asks that node, and a node that does not drain says so."""
    first, second = pair
    leave = {"secret": PEER_TOKEN, "caller": "n2", "caller_address": second.address}
    async with aiohttp.ClientSession() as http:
        status, body = await peer_call(http, first.address, "leave", **leave)
        assert status == 401, body
        assert "not signed with the key the warehouse holds for node n2" in body["error"]
        with caplog.at_level(logging.WARNING, logger="deltaflow.server.topology"):
            status, body = await peer_call(http, first.address, "leave", key=second.key, **leave)
    assert status == 200
    assert body["taken"] is False
    assert "n2" in first.partition_map.addresses
    assert "its own answer says it does not drain" in caplog.text


async def test_invented_peers_are_not_enrolled_and_learned_ones_are_capped(
    warehouse: Path, pair: tuple[Node, Node], caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 6: 200 requests with invented ``X-Deltaflow-Peer`` values grew the member list
    to 201 and made the node poll addresses of the caller's choosing. The client's map
    request enrols no one now, nor does a poll proving the peer token without a node's key;
    a peer's proven and signed poll does, up to ``MAX_LEARNED_PEERS``, each logged with who
    asked."""
    from deltaflow.server.topology import MAX_LEARNED_PEERS

    first, _ = pair
    async with aiohttp.ClientSession() as http:
        for i in range(50):
            headers = {"Authorization": f"Bearer {TOKEN}", "X-Deltaflow-Peer": f"x{i}@10.0.0.{i}:1"}
            async with http.get(f"http://{first.address}/v1/cluster", headers=headers) as resp:
                assert resp.status == 200
            status, _ = await peer_call(
                http, first.address, "poll", secret=TOKEN, caller=f"x{i}",
                caller_address=f"127.0.0.1:{1 + i}",
            )  # fmt: skip
            assert status == 401
            status, _ = await peer_call(
                http, first.address, "poll", secret=PEER_TOKEN, caller=f"x{i}",
                caller_address=f"127.0.0.1:{1 + i}",
            )  # fmt: skip
            assert status == 401  # the peer token, but no key of x<i> in the warehouse
        assert len(await members(first)) == 2
        with caplog.at_level(logging.INFO, logger="deltaflow.server.topology"):
            for i in range(MAX_LEARNED_PEERS + 8):
                key = await published_key(warehouse, f"y{i}")
                status, _ = await peer_call(
                    http, first.address, "poll", secret=PEER_TOKEN, caller=f"y{i}",
                    caller_address=f"127.0.0.1:{1 + i}", key=key,
                )  # fmt: skip
                assert status == 200
    # n1 itself, and the peers it learned of: n2 (it polled n1 first) and the invented ones.
    assert len(await members(first)) == 1 + MAX_LEARNED_PEERS
    assert caplog.text.count("learned of peer y") == MAX_LEARNED_PEERS - 1
    assert "ignored peer y" in caplog.text


async def test_a_wrong_proof_in_a_peers_answer_is_refused(warehouse: Path) -> None:
    """A peer whose answer carries a proof, but not the right one, owns nothing (the check
    compares the proof; a missing proof is not the only way to fail it)."""
    async with Listener(await cluster_identity(warehouse)) as listener:
        node = Node(config(warehouse, "n1", peer_token=PEER_TOKEN, peers=[listener.address]))
        await node.start()
        try:
            state = (await members(node))[listener.address]
            assert state["state"] == "refused"
            assert set(node.partition_map.owners) == {"n1"}
        finally:
            await node.stop()


async def test_a_wrong_proof_in_a_call_is_refused_and_a_challenge_serves_once(
    warehouse: Path, pair: tuple[Node, Node]
) -> None:
    first, _ = pair
    key = await published_key(warehouse, "n9")
    async with aiohttp.ClientSession() as http:
        body: dict[str, Any] = {"node": "n9", "address": "127.0.0.1:1", "nonce": "1" * 32}
        async with http.post(f"http://{first.address}/v1/peer/poll", json=body) as resp:
            assert resp.status == 401
            challenge = (await resp.json())["challenge"]
        good = call_proof(PEER_TOKEN, "poll", challenge, "1" * 32, "n9", "127.0.0.1:1")
        empty = hashlib.sha256(b"").hexdigest()
        signed = call_message("poll", challenge, "1" * 32, "n9", "127.0.0.1:1", empty)
        body["signature"] = key.sign(signed)
        for proof, status in (("0" * 64, 401), (good, 200), (good, 401)):
            body.update(challenge=challenge, proof=proof)
            async with http.post(f"http://{first.address}/v1/peer/poll", json=body) as resp:
                assert resp.status == status


async def test_hostile_peer_calls_are_refused_within_bounds(pair: tuple[Node, Node]) -> None:
    first, _ = pair
    cases: list[tuple[bytes, int]] = [
        (b"x" * 100_000, 413),
        (b"not json", 400),
        (b"[1, 2]", 400),
        (b'{"node": "a\\nWARNING forged", "address": "h:1", "nonce": "' + b"0" * 32 + b'"}', 400),
        (b'{"node": "n9", "address": "h:1", "nonce": "short"}', 400),
    ]
    async with aiohttp.ClientSession() as http:
        for data, status in cases:
            async with http.post(f"http://{first.address}/v1/peer/poll", data=data) as resp:
                assert resp.status == status, data[:40]
                assert len(await resp.read()) < 300


async def test_a_commit_call_is_proven_and_bounded(pair: tuple[Node, Node]) -> None:
    """``POST /v1/peer/commit``: only a node's proof in headers admits it (its body form
    of old, even with the peer token, is refused; the header form is
    tests/test_peer_identity.py's); a body past 8 MiB is refused unread."""
    first, _ = pair
    payload = json.dumps(PreparedCommit("t", "n9", 0, [], {}, {}).to_wire())
    async with aiohttp.ClientSession() as http:
        call = functools.partial(peer_call, http, first.address, "commit")
        assert (await call(secret=TOKEN, payload=payload))[0] == 401  # a client's token
        status, body = await call(secret=PEER_TOKEN, payload=payload)
        assert status == 401 and "X-Deltaflow-Digest" in body["error"]
        assert first.engine.tables() == {}
        huge = {"node": "n9", "address": "127.0.0.1:1", "nonce": "0" * 32}
        data = json.dumps({**huge, "payload": "x" * (9 * 1024 * 1024)}).encode()
        async with http.post(f"http://{first.address}/v1/peer/commit", data=data) as resp:
            assert resp.status == 413


def test_beyond_loopback_a_token_needs_tls_and_peers_a_credential_of_their_own(
    tmp_path: Path,
) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    issued = ca.issue("n1", hosts=["127.0.0.1"], peer=True)
    tls = NodeTls(issued.cert, issued.key, ca.cert)
    wide = {"host": "0.0.0.0", "advertise": "h:7700"}
    with pytest.raises(UsageError, match="with a token but without TLS"):
        NodeConfig(node_id="n1", warehouse=tmp_path, token=TOKEN, peer_token=PEER_TOKEN, **wide)
    with pytest.raises(UsageError, match="with neither a token nor mutual TLS"):
        NodeConfig(node_id="n1", warehouse=tmp_path, peer_token=PEER_TOKEN, tls=tls, **wide)
    with pytest.raises(UsageError, match="with a client token only"):
        NodeConfig(node_id="n1", warehouse=tmp_path, token=TOKEN, tls=tls, **wide)
    NodeConfig(
        node_id="n1", warehouse=tmp_path, token=TOKEN, peer_token=PEER_TOKEN, tls=tls, **wide
    )
    NodeConfig(node_id="n1", warehouse=tmp_path, token=TOKEN, tls=tls, insecure=True, **wide)
    with pytest.raises(UsageError, match="token is empty"):
        NodeConfig(node_id="n1", warehouse=tmp_path, token="  ")
    with pytest.raises(UsageError, match="node_id"):
        NodeConfig(node_id="n1\nWARNING forged", warehouse=tmp_path)


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    """Finding 8: an empty --token-file gave the token "" (anyone sending none got in)."""
    empty = tmp_path / "token"
    empty.write_text("\n")
    for flag in ("--token-file", "--peer-token-file"):
        served = subprocess.run(
            [sys.executable, "-m", "deltaflow.cli", "serve", "--node-id", "n1", "--port", "0",
             "--warehouse", str(tmp_path / "w"), "--engine", "delta-rs", flag, str(empty)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert served.returncode == 78, served.stderr  # EX_CONFIG
        assert f"{flag} {str(empty)!r} is empty" in served.stderr
        assert "Traceback" not in served.stderr


async def test_under_mutual_tls_a_client_certificate_cannot_act_as_a_peer(
    warehouse: Path, tmp_path: Path
) -> None:
    """Without a peer token, the peer role is in the certificate: a client's certificate,
    signed by the same CA, is refused at every peer endpoint."""
    import ssl

    ca = CertificateAuthority(tmp_path / "ca")
    issued = ca.issue("n1", hosts=["127.0.0.1"], peer=True)
    node = Node(config(warehouse, "n1", tls=NodeTls(issued.cert, issued.key, ca.cert, True)))
    await node.start()
    try:
        client = ca.issue("client")
        context = ssl.create_default_context(cafile=ca.cert)
        context.load_cert_chain(client.cert, client.key)
        body = {"node": "n9", "address": "127.0.0.1:1", "nonce": "0" * 32}
        async with aiohttp.ClientSession() as http:
            for path in ("/v1/peer/poll", "/v1/peer/leave", "/v1/peer/status", "/v1/drain"):
                async with http.post(
                    f"https://{node.address}{path}", json=body, ssl=context
                ) as resp:
                    assert resp.status == 403
                    assert "certificate is a client's" in (await resp.json())["error"]
        assert node.state is NodeState.RUNNING
    finally:
        await node.stop()


async def test_operators_read_and_drain_with_the_peer_token_and_clients_cannot(
    pair: tuple[Node, Node], tmp_path: Path
) -> None:
    """``cluster status`` and ``node drain`` take ``--peer-token-file``; the drain is a peer
    call, so the client token alone is refused (exit 2) and the node keeps running."""
    first, second = pair
    client_file, peer_file = tmp_path / "token", tmp_path / "peer-token"
    client_file.write_text(TOKEN)
    peer_file.write_text(PEER_TOKEN)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "deltaflow.cli", *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    status = await asyncio.to_thread(
        cli, "cluster", "status", "--node", first.address, "--peer-token-file", str(peer_file)
    )
    assert status.returncode == 0, status.stderr
    assert "n2" in status.stdout
    refused = await asyncio.to_thread(
        cli, "node", "drain", "--node", second.address, "--token-file", str(client_file)
    )
    assert refused.returncode == 2
    assert "refused the drain: wrong peer proof" in refused.stderr
    assert second.state is NodeState.RUNNING
    drained = await asyncio.to_thread(
        cli, "node", "drain", "--node", second.address, "--peer-token-file", str(peer_file)
    )
    assert drained.returncode == 0, drained.stderr
    assert "partitions now: n1 64" in drained.stdout
    await second.wait_stopped()


class Relay:
    """A TCP relay on 127.0.0.1 to ``target``: what a stranger at an address in --peers can
    do with a real node's answers when peers talk in plain text."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.server: asyncio.Server | None = None
        self.address = ""

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.target.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except OSError:
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def __aenter__(self) -> Relay:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def test_a_relay_at_an_address_in_peers_cannot_pass_a_real_nodes_answers_off(
    warehouse: Path,
) -> None:
    """A stranger at an address in --peers that relays a real node's answers (plain text)
    would be that node at its own address, routing clients through itself. An answer proves
    its exact bytes, address included, so the relay is refused."""
    real = Node(config(warehouse, "n2", peer_token=PEER_TOKEN))
    await real.start()
    try:
        async with Relay(real.address) as relay:
            node = Node(config(warehouse, "n1", peer_token=PEER_TOKEN, peers=[relay.address]))
            await node.start()
            try:
                state = (await members(node))[relay.address]
                assert state["state"] == "refused"
                assert f"says it is reached at {real.address}" in state["refused"]
                assert relay.address not in node.partition_map.addresses.values()
            finally:
                await node.stop()
    finally:
        await real.stop()


async def test_a_cluster_of_16384_partitions_forms(warehouse: Path) -> None:
    """A poll's answer holds the whole map: read to its end (within its bound), not only
    what arrived first."""
    options = {"token": TOKEN, "peer_token": PEER_TOKEN, "partitions": 16384}
    first = Node(config(warehouse, "n1", **options))
    await first.start()
    second = Node(config(warehouse, "n2", peers=[first.address], **options))
    await second.start()
    try:
        await asyncio.wait_for(
            asyncio.gather(first.wait_for_members(2), second.wait_for_members(2)), 20
        )
    finally:
        await second.stop()
        await first.stop()


@pytest.mark.parametrize(
    "answer",
    [b"[" * 200_000 + b"]" * 200_000, b'{"node": "n9\\nERROR forged line", "address": "x"}'],
    ids=["deep", "forged-name"],
)
async def test_a_hostile_answer_to_a_poll_harms_nothing(
    warehouse: Path, answer: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    async with Listener(answer=answer) as listener:
        node = Node(config(warehouse, "n1", peer_token=PEER_TOKEN, peers=[listener.address]))
        with caplog.at_level(logging.INFO):
            await node.start()  # polls the listener once before it serves
        try:
            assert len(listener.seen) >= 1
            assert (await members(node))[listener.address]["state"] == "dead"
            assert "forged" not in caplog.text
            assert node.state is NodeState.RUNNING
        finally:
            await node.stop()
