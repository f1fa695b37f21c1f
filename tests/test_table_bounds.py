"""A node's tables are bounded, and one client's input fails only itself: past ``max_tables``
a stream to a new table is refused while the node's tables keep working, the peers' poll
answer stays small whatever the count, and a badly typed batch sharing a new table's first
group with another client's good batch fails alone."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pyarrow as pa

import deltaflow
from deltaflow import DataStreamerError
from deltaflow.errors import OverloadedError
from deltaflow.server.peers import PeerClient
from deltaflow.tables.commit import staging
from deltaflow.testing import at_fault_point

from .support import StartCluster, Within, open_table, read_delta

TOKEN = "client-token"
PEER_TOKEN = "peer-token"


async def _stream(address: str, rows: list[dict[str, Any]], table: str = "t") -> Any:
    """One client's stream of ``rows`` to ``table``: its summary, or the error it ended with."""
    async with deltaflow.connect([address], token=TOKEN) as client:
        try:
            return await client.stream_data(rows, table=table, key="id")
        except DataStreamerError as exc:
            return exc


async def test_a_stream_to_a_table_past_max_tables_is_refused_and_the_node_s_tables_go_on(
    warehouse: Path, start_cluster: StartCluster
) -> None:
    [node] = await start_cluster(
        warehouse, count=1, engine="delta-rs", partitions=1, token=TOKEN, max_tables=3
    )
    for i in range(3):
        done = await _stream(node.address, [{"id": 1, "v": i}], table=f"t{i}")
        assert not isinstance(done, Exception), done
    refused = await _stream(node.address, [{"id": 1, "v": 3}], table="t3")
    assert isinstance(refused, DataStreamerError)
    reason = refused.failures[0].reason
    # The error names the cap, the setting and what to do; no retry would change it.
    for said in ("OVERLOADED", "writes 3 tables, its max_tables", "'t3'", "--max-tables",
                 "DELTAFLOW_MAX_TABLES", "node node-1"):  # fmt: skip
        assert said in reason, reason
    assert isinstance(refused.cause, OverloadedError) and not refused.cause.retriable
    assert not (warehouse / "t3").exists()
    # The tables the node writes are written as before.
    done = await _stream(node.address, [{"id": 1, "v": 10}, {"id": 2, "v": 20}], table="t0")
    assert not isinstance(done, Exception), done
    table = await asyncio.to_thread(read_delta, warehouse / "t0")
    assert {k: r["v"] for k, r in table.items()} == {1: 10, 2: 20}


def test_max_tables_is_a_setting_of_the_file_the_environment_and_the_command_line(
    tmp_path: Path,
) -> None:
    config = tmp_path / "node.toml"
    config.write_text('node_id = "n1"\nwarehouse = "/srv/w"\nmax_tables = 9\n')
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DELTAFLOW_")}
    shown = []
    for env, flags in (({}, []), ({"DELTAFLOW_MAX_TABLES": "7"}, []), ({}, ["--max-tables", "5"])):
        done = subprocess.run(
            [sys.executable, "-m", "deltaflow.cli", "config", "show", "--json",
             "--config", str(config), *flags],
            capture_output=True, text=True, timeout=60, check=True, env={**clean, **env},
        )  # fmt: skip
        shown.append(json.loads(done.stdout)["settings"]["max_tables"])
    assert shown == [
        {"value": 9, "source": "file"},
        {"value": 7, "source": "env"},
        {"value": 5, "source": "flag"},
    ]


async def test_a_peer_s_poll_answer_keeps_its_size_whatever_the_node_writes(
    warehouse: Path, start_cluster: StartCluster
) -> None:
    """Peers read none of a node's tables: its poll answer does not grow with them (at
    ~180 bytes a table, ~47,000 tables passed the 8 MiB a peer reads, and peers stopped
    hearing the node), while ``/v1/cluster`` still lists them for operators."""
    first, second = await start_cluster(
        warehouse, engine="delta-rs", partitions=1, token=TOKEN, peer_token=PEER_TOKEN
    )

    async def poll() -> dict[str, Any]:
        async with PeerClient(
            node_id=second.node_id, address=second.address, secret=PEER_TOKEN, tls=None,
            signer=second.key,
            timeout=10,
        ) as peer:  # fmt: skip
            reply = await peer.call(first.address, "poll")
        assert reply.status == 200 and reply.proven, reply
        return reply.body

    before = len(json.dumps(await poll()))
    names = [f"table_with_a_long_name_{i:03d}" for i in range(8)]
    async with deltaflow.connect([first.address], token=TOKEN) as client:
        for name in names:
            await client.stream_data([{"id": 1}], table=name, key="id")
    answer = await poll()
    assert "tables" not in answer
    assert len(json.dumps(answer)) - before < 100  # 8 tables added ~1.4 KB before
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"http://{first.address}/v1/cluster", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp,
    ):
        listed = (await resp.json())["tables"]
    assert set(names) <= set(listed)


async def test_a_badly_typed_batch_fails_alone_in_the_group_that_creates_its_table(
    warehouse: Path, start_cluster: StartCluster, within: Within[Any], monkeypatch: Any
) -> None:
    """Two clients write a new table at once, one with ``v`` a number, one with ``v`` text:
    their batches form the group that creates the table. The first staged creates it and is
    committed; the other fails alone, naming its column, never as an internal error."""
    [node] = await start_cluster(warehouse, count=1, engine="delta-rs", partitions=1)
    # The committer woken by the good batch waits for the bad one, still being converted,
    # to join its group (as a burst's batches do), however slow the machine.
    monkeypatch.setattr(staging, "GATHER_SECONDS", 60.0)
    good_arrived, bad_arrived, good_staged = threading.Event(), threading.Event(), threading.Event()
    calls: list[int] = []

    def converting() -> None:  # on a worker thread: both batches are converted at once
        calls.append(1)
        if len(calls) == 1:  # the good batch waits until the bad one is being converted
            good_arrived.set()
            assert bad_arrived.wait(30)
        elif len(calls) == 2:  # the bad one is converted once the good one is staged
            bad_arrived.set()
            assert good_staged.wait(30)

    good = [{"id": i, "v": i * 10} for i in range(3)]
    bad = [{"id": 10 + i, "v": f"text {i}"} for i in range(3)]
    with at_fault_point("converting", converting), at_fault_point("staged", good_staged.set):
        good_run = asyncio.create_task(_stream(node.address, good))
        await within(asyncio.to_thread(good_arrived.wait, 30), 35, "the good batch converted")
        bad_run = asyncio.create_task(_stream(node.address, bad))
        good_result, bad_result = await within(
            asyncio.gather(good_run, bad_run), 60, "both streams ended"
        )
    assert not isinstance(good_result, Exception), good_result
    assert good_result.items_failed == 0
    assert isinstance(bad_result, DataStreamerError)
    assert "INTERNAL" not in str(bad_result) and "TableCreated" not in str(bad_result)
    assert sorted(r["id"] for r in bad_result.failed_items) == [10, 11, 12]
    reason = bad_result.failures[0].reason
    assert "SCHEMA_MISMATCH" in reason and "'v'" in reason, reason
    # The table holds the good rows, with the type they were sent with.
    table = await asyncio.to_thread(read_delta, warehouse / "t")
    assert {k: r["v"] for k, r in table.items()} == {0: 0, 1: 10, 2: 20}
    schema = await asyncio.to_thread(
        lambda: pa.schema(open_table(warehouse / "t").schema().to_arrow())
    )
    assert schema.field("v").type == pa.int64()
