"""A receiver rolled out node by node: a stream to it waits until every live node serves it,
and fails before sending anything when some never do (a stream once applied 454 items on
the restarted nodes and failed 546 with UNKNOWN_RECEIVER on the others)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

import deltaflow
from deltaflow import DataStreamerError, StreamerOptions
from deltaflow.errors import UnknownReceiverError
from deltaflow.server import Node, NodeConfig

ECHO = "deltaflow.testing.Echo"


async def node(config: NodeConfig, node_id: str, receivers: list[str], peers: list[str]) -> Node:
    started = Node(dataclasses.replace(config, node_id=node_id, receivers=receivers, peers=peers))
    await started.start()
    return started


@pytest.fixture
def base(tmp_path: Path) -> NodeConfig:
    return NodeConfig(
        node_id="n", warehouse=tmp_path, port=0, engine="delta-rs", heartbeat_interval=0.1,
        failure_timeout=1.0, peer_expiry=5.0,
    )  # fmt: skip


async def test_a_stream_fails_before_sending_when_a_node_lacks_its_receiver(
    base: NodeConfig,
) -> None:
    first = await node(base, "node-1", [ECHO], [])
    second = await node(base, "node-2", [], [first.address])
    try:
        await asyncio.gather(first.wait_for_members(2), second.wait_for_members(2))
        async with deltaflow.connect([first.address]) as client:
            with pytest.raises(DataStreamerError) as info:
                await client.stream_data(
                    range(1000), key=lambda i: i, receiver=ECHO,
                    options=StreamerOptions(receiver_wait=0.5),
                )  # fmt: skip
        assert isinstance(info.value.__cause__, UnknownReceiverError)
        assert f"served by node-1 but not by node-2 ({second.address}) after 0.5s" in str(
            info.value
        )
        assert info.value.failed_items == []  # nothing was taken from the source
        # Nothing was sent: no batch reached the node that serves it.
        assert first.statistics().dispatcher.batches_received == 0
    finally:
        await second.stop()
        await first.stop()


async def test_a_stream_waits_for_a_rolling_restart_that_adds_its_receiver(
    base: NodeConfig,
) -> None:
    first = await node(base, "node-1", [ECHO], [])
    second = await node(base, "node-2", [], [first.address])
    restarted: Node | None = None
    try:
        await asyncio.gather(first.wait_for_members(2), second.wait_for_members(2))
        results: list[int] = []
        async with deltaflow.connect([first.address]) as client:
            stream = asyncio.create_task(
                client.stream_data(
                    range(1000),
                    key=lambda i: i,
                    receiver=ECHO,
                    on_result=results.append,
                    options=StreamerOptions(receiver_wait=30),
                )
            )
            # node-2 is restarted with the receiver (drained first, as SIGTERM does).
            await second.drain()
            restarted = await node(base, "node-2", [ECHO], [first.address])
            summary = await stream
        assert summary.items_acked == 1000 and summary.items_failed == 0
        assert sorted(results) == list(range(1000))
    finally:
        if restarted is not None:
            await restarted.stop()
        await second.stop()
        await first.stop()


def test_a_peers_receiver_list_is_bounded() -> None:
    """What a peer says it serves is read within bounds: at most 256 names, each a string of
    1 to 256 characters (a hostile peer cannot make a node keep more)."""
    from deltaflow.server.peers import MAX_PEER_RECEIVERS, _receivers

    said = ["a.B"] * 1000 + [1, "", "x" * 1000, None]
    kept = _receivers(said)
    assert kept is not None and len(kept) == MAX_PEER_RECEIVERS == 256
    assert _receivers(["ok.One", 7, "", "y" * 257, "ok.Two"]) == ("ok.One", "ok.Two")
    assert _receivers("not a list") is None
