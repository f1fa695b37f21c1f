"""TLS between clients, nodes and peers; who may join a cluster (docs/security.md). Real nodes
on 127.0.0.1, certificates from a CA made in the test."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import deltaflow
from deltaflow.errors import TlsError, UsageError
from deltaflow.security import ClientTls, NodeTls
from deltaflow.server import Node, NodeConfig
from deltaflow.testing.certificates import CertificateAuthority

from .support import StartCluster, read_delta

TOKEN = "a-cluster-token-of-some-length"


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path / "ca")


def node_tls(ca: CertificateAuthority, name: str, *, client_auth: bool = False) -> NodeTls:
    issued = ca.issue(name, hosts=["127.0.0.1", "localhost"], peer=True)
    return NodeTls(issued.cert, issued.key, ca.cert, client_auth)


async def one_node(warehouse: Path, **config: Any) -> Node:
    node = Node(NodeConfig(node_id="n1", warehouse=warehouse, port=0, engine="delta-rs", **config))
    await node.start()
    return node


async def stream_ten(node: Node, **connect: Any) -> None:
    async with deltaflow.connect([node.address], token=TOKEN, **connect) as client:
        await client.stream_data(({"id": i} for i in range(10)), table="t", key="id")


async def test_a_cluster_under_mutual_tls_streams_exactly(
    warehouse: Path, ca: CertificateAuthority, start_cluster: StartCluster
) -> None:
    """Clients and peers both present certificates; the peers find each other over TLS."""
    nodes = await start_cluster(
        warehouse, 2, engine="delta-rs", token=TOKEN, tls=node_tls(ca, "node", client_auth=True)
    )
    client_cert = ca.issue("client")
    tls = ClientTls(ca=ca.cert, cert=client_cert.cert, key=client_cert.key)
    rows = [{"id": i, "v": f"v{i}"} for i in range(3000)]
    updates = [{"id": i, "v": f"w{i}"} for i in range(0, 3000, 3)]
    async with deltaflow.connect([nodes[0].address], token=TOKEN, tls=tls) as client:
        assert client.partition_map.addresses.keys() == {"node-1", "node-2"}
        summary = await client.stream_data(rows + updates, table="t", key="id")
    assert summary.items_acked == 4000 and set(summary.per_node) == {"node-1", "node-2"}
    table = read_delta(warehouse / "t")
    assert len(table) == 3000
    assert all(table[i]["v"] == (f"w{i}" if i % 3 == 0 else f"v{i}") for i in range(3000))


async def test_a_node_whose_ca_the_client_does_not_trust_is_refused(
    warehouse: Path, ca: CertificateAuthority, tmp_path: Path
) -> None:
    other = CertificateAuthority(tmp_path / "other", "another-ca")
    node = await one_node(warehouse, token=TOKEN, tls=node_tls(ca, "node"))
    try:
        with pytest.raises(TlsError, match="is not trusted") as refused:
            await stream_ten(node, tls=ClientTls(ca=other.cert))
        assert node.address in str(refused.value)
        assert "trusts the CA that signed the nodes' certificates" in str(refused.value)
        await stream_ten(node, tls=ClientTls(ca=ca.cert))  # the right CA: accepted
    finally:
        await node.stop()


async def test_a_client_without_a_certificate_is_refused_under_mutual_tls(
    warehouse: Path, ca: CertificateAuthority, tmp_path: Path
) -> None:
    node = await one_node(warehouse, token=TOKEN, tls=node_tls(ca, "node", client_auth=True))
    stranger = CertificateAuthority(tmp_path / "stranger", "stranger-ca").issue("client")
    try:
        with pytest.raises(TlsError, match="requires a client certificate"):
            await stream_ten(node, tls=ClientTls(ca=ca.cert))
        # A certificate the cluster's CA did not sign is no better than none.
        with pytest.raises(TlsError, match="requires a client certificate"):
            await stream_ten(node, tls=ClientTls(ca=ca.cert, cert=stranger.cert, key=stranger.key))
        assert node.statistics().dispatcher.batches_acked == 0
    finally:
        await node.stop()


class Recorder:
    """A TCP relay on 127.0.0.1 that keeps every byte a client sends to ``target``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.sent = bytearray()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Recorder:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, _, port = self.target.rpartition(":")
        up_reader, up_writer = await asyncio.open_connection(host, int(port))

        async def pipe(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, keep: bytearray | None
        ) -> None:
            try:
                while data := await src.read(65536):
                    if keep is not None:
                        keep += data
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, self.sent), pipe(up_reader, writer, None))

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def test_a_plain_client_to_a_tls_node_is_refused_before_the_token_is_sent(
    warehouse: Path, ca: CertificateAuthority
) -> None:
    node = await one_node(warehouse, token=TOKEN, tls=node_tls(ca, "node"))
    try:
        async with Recorder(node.address) as relay:
            with pytest.raises(TlsError, match="serves TLS and this client spoke plain text"):
                async with deltaflow.connect([relay.address], token=TOKEN):
                    pass
            assert relay.sent, "the client sent nothing at all"
            assert TOKEN.encode() not in relay.sent
            # The command line alike: a clear error, exit 2, and no token on the wire.
            token_file = warehouse.parent / "token"
            token_file.write_text(TOKEN)
            before = len(relay.sent)
            status = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "deltaflow.cli", "cluster", "status",
                 "--node", relay.address, "--token-file", str(token_file)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert status.returncode == 2, status.stdout + status.stderr
            assert "serves TLS" in status.stderr and "--tls-ca" in status.stderr
            assert len(relay.sent) > before and TOKEN.encode() not in relay.sent
    finally:
        await node.stop()


def test_a_node_reachable_beyond_loopback_needs_a_credential(
    tmp_path: Path, ca: CertificateAuthority
) -> None:
    base: dict[str, Any] = {
        "node_id": "n1", "warehouse": tmp_path, "host": "0.0.0.0", "advertise": "h:7700",
    }  # fmt: skip
    with pytest.raises(UsageError) as refused:
        NodeConfig(**base)
    assert "listens on '0.0.0.0' with neither a token nor mutual TLS" in str(refused.value)
    assert "--token-file" in str(refused.value) and "--insecure" in str(refused.value)
    # Each of these is enough; loopback needs none.
    NodeConfig(**base, token=TOKEN, peer_token="peers", tls=node_tls(ca, "node"))
    NodeConfig(**base, tls=node_tls(ca, "node", client_auth=True))
    NodeConfig(**base, insecure=True)
    NodeConfig(node_id="n1", warehouse=tmp_path)
    # TLS without client certificates is encryption, not a credential.
    with pytest.raises(UsageError):
        NodeConfig(**base, tls=node_tls(ca, "node"))
    served = subprocess.run(
        [sys.executable, "-m", "deltaflow.cli", "serve", "--node-id", "n1", "--host", "0.0.0.0",
         "--advertise", "h:7700", "--warehouse", str(tmp_path), "--engine", "delta-rs"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert served.returncode == 78  # EX_CONFIG
    assert "with neither a token nor mutual TLS" in served.stderr


async def test_a_tls_client_to_a_plain_node_is_told_so(
    warehouse: Path, ca: CertificateAuthority
) -> None:
    node = await one_node(warehouse, token=TOKEN)
    try:
        with pytest.raises(TlsError, match="does not serve TLS; connect without tls="):
            await stream_ten(node, tls=ClientTls(ca=ca.cert))
    finally:
        await node.stop()
