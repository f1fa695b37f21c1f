"""The certificate checks TLS is worth nothing without: a client checks that a node's
certificate names the host it dialled, and a node checks its peers' certificates (the CA that
signed them, and the host they name) before it counts them as members. Real nodes and a real
TLS listener on 127.0.0.1, certificates from CAs made in the test (docs/security.md)."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

import deltaflow
from deltaflow.errors import TlsError
from deltaflow.security import ClientTls, NodeTls
from deltaflow.server import Node, NodeConfig
from deltaflow.testing import free_port
from deltaflow.testing.certificates import CertificateAuthority, Issued

TOKEN = "a-cluster-token-of-some-length"
#: The hosts a genuine node's certificate names: those its clients and peers dial.
HERE = ["127.0.0.1", "localhost"]


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path / "ca")


class Impostor:
    """A TLS listener on 127.0.0.1 serving ``issued`` (a certificate the cluster's CA signed,
    but for another host: one taken from another machine, say) and keeping the headers of
    every request it is sent, where a client's token would show."""

    def __init__(self, issued: Issued) -> None:
        self.issued = issued
        self.headers: list[dict[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def _answer(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        return web.json_response({}, status=503)

    async def __aenter__(self) -> Impostor:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.issued.cert, self.issued.key)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port, ssl_context=context).start()
        self.address = f"127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_a_client_refuses_a_node_whose_certificate_names_another_host(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    """The cluster's CA signed the certificate, but for other.example: served at 127.0.0.1 it
    proves nothing about who listens there. Without the host-name check the client sent the
    token to that listener; now the client API and the command line both refuse, and the
    listener gets no request at all."""
    async with Impostor(ca.issue("other", hosts=["other.example"])) as impostor:
        with pytest.raises(TlsError, match="is not trusted") as refused:
            async with deltaflow.connect(
                [impostor.address], token=TOKEN, tls=ClientTls(ca=ca.cert)
            ):
                pass
        assert impostor.address in str(refused.value)
        assert "names the host clients use" in str(refused.value)
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN)
        status = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "deltaflow.cli", "cluster", "status", "--node",
             impostor.address, "--token-file", str(token_file), "--tls-ca", ca.cert],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 2, status.stdout + status.stderr
        assert "is not trusted" in status.stderr
        assert impostor.headers == [], "the impostor was sent requests (and the token)"


def peer(warehouse: Path, node_id: str, issued: Issued, ca: CertificateAuthority) -> Node:
    """A node under mutual TLS serving ``issued`` and trusting the cluster's CA (so it can
    poll the genuine nodes): the certificate is the only credential a peer shows."""
    tls = NodeTls(issued.cert, issued.key, ca.cert, client_auth=True)
    return Node(
        NodeConfig(
            node_id=node_id, warehouse=warehouse, port=0, engine="delta-rs", tls=tls,
            heartbeat_interval=0.1,
        )
    )  # fmt: skip


async def test_a_node_admits_no_peer_whose_certificate_it_cannot_verify(
    warehouse: Path, ca: CertificateAuthority, tmp_path: Path
) -> None:
    """Three peers on the node's warehouse (so of its cluster identity) answer its polls:
    a genuine one, one whose certificate another CA signed, and one whose certificate the
    cluster's CA signed for another host. Only the genuine one takes partitions: with the
    host-name check off, the one for another host took a share, and with no check at all
    (before certificates carried a peer role) both impostors did."""
    other_ca = CertificateAuthority(tmp_path / "other-ca", "another-ca")
    peers = {
        "genuine": peer(warehouse, "genuine", ca.issue("genuine", HERE, peer=True), ca),
        "other-ca": peer(warehouse, "other-ca", other_ca.issue("other-ca", HERE, peer=True), ca),
        "other-host": peer(
            warehouse, "other-host", ca.issue("other-host", ["other.example"], peer=True), ca
        ),
    }
    started: list[Node] = []
    try:
        for node in peers.values():
            await node.start()
            started.append(node)
        issued = ca.issue("n1", HERE, peer=True)
        n1 = Node(
            NodeConfig(
                node_id="n1", warehouse=warehouse, port=0, engine="delta-rs",
                tls=NodeTls(issued.cert, issued.key, ca.cert, client_auth=True),
                peers=[p.address for p in peers.values()], heartbeat_interval=0.1,
            )
        )  # fmt: skip
        await n1.start()
        started.append(n1)
        # start() polled every peer once and decided: an impostor it admitted is in the map.
        assert set(n1.partition_map.addresses) <= {"n1", "genuine"}, n1.partition_map.addresses
        try:
            await n1.wait_for_members(2, timeout=30.0)
        except TimeoutError:
            pytest.fail(f"the genuine peer was never admitted: {n1.partition_map.addresses}")
        assert set(n1.partition_map.owners) == {"n1", "genuine"}
    finally:
        for node in reversed(started):
            await node.stop()
