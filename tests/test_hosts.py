"""Three nodes on three "hosts" that share nothing but a network: each node in a network
namespace of its own (its own address on a bridge the test makes, its own scratch directory),
the object store on the machine behind the bridge, TLS and a token between everyone. A client
streams, one node is SIGKILLed, and the table in the bucket is checked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import deltaflow
from deltaflow.security import ClientTls, client_context
from deltaflow.storage.paths import location
from deltaflow.testing import NodeProcess, wait_for_members
from deltaflow.testing.certificates import CertificateAuthority
from deltaflow.testing.netns import Hosts, unavailable
from deltaflow.testing.object_store import S3Server

from .support import FAILOVER_OPTIONS, FailoverWatch, read_delta

REASON = unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"no separate hosts here: {REASON}"),
]

PORT = 7700  # every host has its own: the same port on each, as in a real deployment
TOKEN = "hosts-share-this-token-and-nothing-else"


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with Hosts(3) as made:
        yield made


@pytest.fixture
def store(hosts: Hosts, tmp_path: Path) -> Iterator[S3Server]:
    """The object store, on the machine's address on the bridge: the only thing the hosts
    have in common."""
    with S3Server(tmp_path / "s3", host=hosts.gateway) as server:
        yield server.start()


async def test_nodes_on_separate_hosts_stream_fail_over_and_land_every_row(
    hosts: Hosts, store: S3Server, tmp_path: Path
) -> None:
    bucket = await asyncio.to_thread(store.create_bucket, "lake")
    ca = CertificateAuthority(tmp_path / "ca")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    addresses = [f"{h.address}:{PORT}" for h in hosts]
    flags = ["--engine", "delta-rs", "--token-file", str(token_file),
             "--tls-ca", ca.cert, "--tls-client-auth"]  # fmt: skip
    nodes = []
    for i, host in enumerate(hosts.hosts):
        cert = ca.issue(f"node-{i + 1}", hosts=[host.address], peer=True)
        scratch = tmp_path / f"host-{i + 1}"  # nothing on disk in common
        scratch.mkdir()
        nodes.append(
            NodeProcess(
                f"node-{i + 1}",
                location(f"{bucket}/warehouse"),
                host=host.address,
                port=PORT,
                prefix=host.prefix,
                peers=[a for a in addresses if a != addresses[i]],
                extra=[*flags, "--tls-cert", cert.cert, "--tls-key", cert.key],
                env={**store.storage_options, "TMPDIR": str(scratch)},
            )
        )
    client_cert = ca.issue("client")
    tls = ClientTls(ca=ca.cert, cert=client_cert.cert, key=client_cert.key)
    try:
        await asyncio.gather(*(node.start(timeout=120) for node in nodes))
        await wait_for_members(
            addresses, token=TOKEN, tls=await asyncio.to_thread(client_context, tls)
        )
        n = 100_000

        async def rows() -> AsyncIterator[dict[str, Any]]:
            # Paced, so rows of node-2's partitions are still coming after it is killed (a
            # burst could be all acked by then, leaving nothing to fail over).
            for start in range(0, n, 1_000):
                for i in range(start, start + 1_000):
                    yield {"id": i % 20_000, "v": i}
                await asyncio.sleep(0.02)

        async with deltaflow.connect([addresses[0]], token=TOKEN, tls=tls) as client:
            assert sorted(client.partition_map.addresses.values()) == addresses
            watch = FailoverWatch(nodes[1], n // 4, client.partition_map, grace=0.2)
            summary = await client.stream_data(
                rows(), table="events", key="id", on_ack=watch, options=FAILOVER_OPTIONS
            )
        assert summary.items_acked == n and summary.items_failed == 0
        table = await asyncio.to_thread(
            read_delta, location(f"{bucket}/warehouse/events", store.storage_options)
        )
        assert {k: r["v"] for k, r in table.items()} == {k: 80_000 + k for k in range(20_000)}
        print(  # noqa: T201
            f"\nthree hosts (network namespaces) over one bucket, TLS: {n:,} upserts, node-2 "
            f"SIGKILLed; first ack by a new owner {watch.failover:.2f}s after the kill"
        )
    finally:
        for node in nodes:
            if node.proc is not None and node.proc.returncode is None:
                await node.stop()
