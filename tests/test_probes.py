"""``/healthz`` and ``/ready`` through a node's start and drain, as a Kubernetes probe sees
them: alive from the moment it listens, ready only once it can serve, not ready while it
drains."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp

import deltaflow
from deltaflow.partitioning import partition_of
from deltaflow.server import Node
from deltaflow.testing import free_port
from deltaflow.testing.side_inputs import SIDE_INPUT_FILE_ENV

from .support import Eventually, StartCluster


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(url) as resp:
        return resp.status, await resp.json()


async def test_a_starting_node_is_alive_but_not_ready_until_it_can_serve(tmp_path: Path) -> None:
    """The node waits for its side input's first value: meanwhile /healthz is 200, /ready is
    503 naming what it waits for, and the stream endpoints answer 503 "starting"."""
    port = free_port()
    source = tmp_path / "side.json"  # missing: the side input declines, the start waits
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DELTAFLOW_")},
        SIDE_INPUT_FILE_ENV: str(source),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deltaflow.cli", "serve", "--node-id", "n1", "--port", str(port),
        "--warehouse", str(tmp_path / "w"), "--engine", "delta-rs",
        "--side-input", "deltaflow.testing.side_inputs.FileSideInput",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http, asyncio.timeout(60):
            while True:  # until it listens and its engine has started
                with contextlib.suppress(aiohttp.ClientConnectionError):
                    status, body = await get(http, f"{base}/ready")
                    if body["checks"]["engine"]:
                        break
                await asyncio.sleep(0.05)
            assert status == 503
            assert body["ready"] is False
            assert body["state"] == "starting"
            assert body["checks"]["side_inputs"] is False
            assert body["checks"]["store"] and body["checks"]["identity"]
            alive, health = await get(http, f"{base}/healthz")
            assert (alive, health) == (200, {"node": "n1", "state": "starting"})
            refused, why = await get(http, f"{base}/v1/cluster")
            assert refused == 503
            assert why["starting"] is True
            source.write_text("{}")  # the side input's value: the node can serve now
            assert proc.stdout is not None
            line = (await proc.stdout.readline()).decode()
            assert "ready on" in line
            status, body = await get(http, f"{base}/ready")
            assert status == 200, body
            assert body["state"] == "running"
            assert all(body["checks"].values())
    finally:
        proc.terminate()
        await proc.wait()


async def test_a_draining_node_is_not_ready_and_its_peer_is(
    tmp_path: Path, start_cluster: StartCluster
) -> None:
    """While a node drains (a batch still in its receiver), /ready answers 503 with state
    draining; its peer, which took its partitions, stays ready."""
    from deltaflow.testing import Gated

    nodes: list[Node] = await start_cluster(tmp_path, engine="delta-rs")
    first, second = nodes
    Gated.gate = asyncio.Event()
    running = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as http:
            for node in nodes:
                status, body = await get(http, f"http://{node.address}/ready")
                assert status == 200, body
            async with deltaflow.connect([first.address]) as client:
                owners = first.partition_map.owners
                key = next(k for k in range(1000) if owners[partition_of(k, 64)] == "node-1")
                stream = asyncio.create_task(
                    client.stream_data(
                        [key, key],
                        key=lambda _: key,
                        receiver="deltaflow.testing.Gated",
                        on_result=lambda _: running.set(),
                    )
                )
                await running.wait()  # the batch is in the receiver, held by the gate
                drain = asyncio.create_task(first.drain())
                # The drain task runs (and marks the node draining) before the request is served.
                status, body = await get(http, f"http://{first.address}/ready")
                assert status == 503
                assert body["state"] == "draining"
                assert body["checks"]["serving"] is False
                assert (await get(http, f"http://{second.address}/ready"))[0] == 200
                Gated.gate.set()
                await drain
                summary = await stream
            assert summary.items_acked == 2
    finally:
        Gated.gate = None


async def test_a_node_restarted_at_its_address_is_counted_down_while_it_starts(
    tmp_path: Path, eventually: Eventually
) -> None:
    """A SIGKILLed node whose replacement already listens at its address (and answers
    "starting") is down for its peers as soon as a refused connection would make it, not after
    the failure timeout: its partitions move while the new node starts."""
    from deltaflow.server import NodeConfig
    from deltaflow.testing import NodeProcess

    port = free_port()
    extra = ["--engine", "delta-rs", "--heartbeat-interval", "0.2", "--failure-timeout", "30"]
    peer = NodeProcess("n2", tmp_path / "w", port=port, extra=extra)
    await peer.start(timeout=60)
    base = NodeConfig(
        node_id="n1", warehouse=tmp_path / "w", port=0, engine="delta-rs",
        peers=[peer.address], heartbeat_interval=0.2, failure_timeout=30.0,
    )  # fmt: skip
    node = Node(base)
    await node.start()
    # The replacement binds the port at once (in this process), then waits for a side input
    # that never has a value: it answers "starting" for as long as the test looks.
    replacement = Node(
        dataclasses.replace(
            base, node_id="n2", port=port, peers=[],
            side_inputs=["deltaflow.testing.side_inputs.FailingSideInput"],
            side_input_timeout=60.0,
        )
    )  # fmt: skip
    starting: asyncio.Task[None] | None = None
    try:
        await node.wait_for_members(2)
        peer.kill()
        await peer.wait()
        starting = asyncio.create_task(replacement.start())
        async with aiohttp.ClientSession() as http, asyncio.timeout(5):
            while True:  # until it listens: milliseconds
                with contextlib.suppress(aiohttp.ClientConnectionError):
                    health = await get(http, f"http://{peer.address}/healthz")
                    break
                await asyncio.sleep(0.01)
        assert health[1]["state"] == "starting"
        # Down by two refused-like answers 0.1 s apart: far sooner than failure_timeout (30 s).
        await eventually(lambda: node.partition_map.owners.count("n1") == 64, "n2 down", 5.0)
        assert {m["node"]: m["state"] for m in node.members()}["n2"] == "dead"
    finally:
        if starting is not None:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        await node.stop()
        await peer.stop()
