"""What a stranger or a hostile client sends costs a node little and never reaches its log raw
(issue #36, findings 2, 3 and 8).

The hello is capped at ``MAX_HELLO_BYTES`` before it is decoded and its token is checked
before anything else in it; client ids are plain; connections still in their handshake are
capped and have a deadline; values from the wire reach errors and logs cut short; a batch
decodes to a bounded number of maps and arrays. Memory is measured on node processes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

import deltaflow
from deltaflow.protocol import BYTES_PER_CONTAINER, MAX_HELLO_BYTES, WS_PATH, encode_frame
from deltaflow.server import Node
from deltaflow.server.connection import (
    HELLO_TIMEOUT,
    MAX_UNAUTHENTICATED,
    MAX_UNAUTHENTICATED_PER_ADDRESS,
)
from deltaflow.testing import NodeProcess

from .support import HealthWatch, StartCluster, Within, echo_node_process, memory_mib, reset_peak

TOKEN = "s3cret-token"
HELLO = {"t": "hello", "v": [1], "caps": [], "client": "raw-client", "token": TOKEN}
#: A client id that, written raw into the log, starts a line of its own.
FORGED = "x\n2026-01-01 00:00:00,000 WARNING deltaflow.server.node: node n1 draining: forged"


@pytest.fixture
async def node(warehouse: Path, start_cluster: StartCluster) -> AsyncIterator[Node]:
    (node,) = await start_cluster(warehouse, count=1, engine="delta-rs", token=TOKEN)
    yield node


async def refusal(ws: aiohttp.ClientWebSocketResponse) -> tuple[dict[str, Any] | None, int, int]:
    """The node's error frame (None if the socket closed first), its size, and the close code."""
    msg = await ws.receive()
    error, size = None, 0
    if msg.type == aiohttp.WSMsgType.BINARY:
        error, size = msgpack.unpackb(msg.data), len(msg.data)
        msg = await ws.receive()
    assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), msg
    assert ws.close_code is not None
    return error, size, ws.close_code


async def answer_to(address: str, first: bytes) -> tuple[dict[str, Any], int]:
    """The frame a node answers ``first`` (a hello) with, and the close code (0: open)."""
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"http://{address}{WS_PATH}") as ws,
    ):
        await ws.send_bytes(first)
        answer = msgpack.unpackb((await ws.receive(timeout=10)).data)
        if answer["t"] == "welcome":
            return answer, 0
        return answer, (await refusal(ws))[2]


async def streams(address: str) -> None:
    """A real client streams rows through the node."""
    async with deltaflow.connect([address], token=TOKEN) as client:
        summary = await client.stream_data(
            [{"i": i} for i in range(200)], key="i", receiver="deltaflow.testing.Echo"
        )
    assert summary.items_acked == 200


async def node_process(tmp_path: Path) -> NodeProcess:
    return await echo_node_process(tmp_path, TOKEN)


@pytest.mark.slow
async def test_a_16_mib_hello_without_a_token_is_refused_unread(
    tmp_path: Path, within: Within[Any]
) -> None:
    # Finding 2: before, the node decoded all 16 million maps (RSS 140 MB -> 1.67 GB), wrote
    # their repr() into a 67 MB log line and a 67 MB answer, and /healthz took 5 s.
    node = await node_process(tmp_path)
    try:
        assert node.proc is not None
        pid = node.proc.pid
        hello = msgpack.packb({"t": "hello", "v": [{}] * 16_000_000, "caps": [], "client": "x"})
        async with aiohttp.ClientSession() as session:
            before = memory_mib(pid, "VmRSS")
            reset_peak(pid)
            async with HealthWatch(node.address) as health:
                ws = await session.ws_connect(f"http://{node.address}{WS_PATH}")
                # Sent alongside: past FIRST_MESSAGE_BYTES the node reads no more of it.
                sending = asyncio.create_task(ws.send_bytes(hello))
                error, size, code = await within(refusal(ws), 30, "the answer to the hello")
                await asyncio.gather(sending, return_exceptions=True)
            grown = memory_mib(pid, "VmHWM") - before
    finally:
        await node.stop()
    print(f"\n16 MiB hello: RSS +{grown:.0f} MiB, /healthz at most {max(health.seconds):.2f} s")  # noqa: T201
    assert error is not None and error["code"] == "FRAME_TOO_LARGE", error
    assert f"exceeds the limit of {MAX_HELLO_BYTES} bytes for a hello" in error["msg"]
    assert size < 512 and code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
    # aiohttp reads the 16 MiB message whole (in pieces, then joined) before the node sees it.
    assert grown < 100, f"node RSS grew by {grown:.0f} MiB"
    assert max(health.seconds) < 1.0, health.seconds
    assert max(len(line) for line in node.output) < 1024


async def test_the_token_is_checked_before_anything_else_in_the_hello(node: Node) -> None:
    # Before, a stranger learned the node's versions (UNSUPPORTED_VERSION) and made the node
    # look at whatever ``v`` held, then log it with the client id it chose.
    for token in (None, "wrong"):
        hello = {**HELLO, "token": token, "v": [99], "caps": [{}], "client": FORGED}
        answer, code = await answer_to(node.address, encode_frame(hello))
        assert answer.get("code") == "UNAUTHORIZED", answer
        assert code == aiohttp.WSCloseCode.POLICY_VIOLATION


async def test_a_client_id_that_could_forge_a_log_line_is_refused(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    # Finding 3: a client id with a newline wrote a forged "WARNING ... draining" line.
    caplog.set_level(logging.INFO, logger="deltaflow")
    for client in (FORGED, "", "x" * 65, "a b", "id\n", "\x1b[2Jclear"):
        answer, code = await answer_to(node.address, encode_frame({**HELLO, "client": client}))
        assert answer.get("code") == "BAD_FRAME", (client, answer)
        assert "client id" in answer["msg"] and "\n" not in answer["msg"]
        assert code == aiohttp.WSCloseCode.PROTOCOL_ERROR
    assert not [r for r in caplog.records if "\n" in r.getMessage() or "\x1b" in r.getMessage()]
    await streams(node.address)  # the real client's ids pass


@pytest.mark.parametrize(
    "hello",
    [
        {"t": "x" * 3500},
        {**HELLO, "v": ["y" * 3500]},
        {**HELLO, "z" * 3500: 1},
        {**HELLO, "client": "c" * 3500},
    ],
    ids=["frame-type", "versions", "field-name", "client-id"],
)
async def test_values_from_the_wire_reach_errors_and_logs_cut_short(
    node: Node, caplog: pytest.LogCaptureFixture, hello: dict[str, Any]
) -> None:
    caplog.set_level(logging.INFO, logger="deltaflow")
    answer, _ = await answer_to(node.address, encode_frame(hello))
    assert answer["t"] == "error" and len(answer["msg"]) < 300, str(answer)[:400]
    assert max(len(r.getMessage()) for r in caplog.records) < 500


async def test_connections_still_in_their_handshake_are_capped_and_have_a_deadline(
    node: Node, within: Within[Any]
) -> None:
    # Finding 8: any number of connections could sit after the upgrade without a hello.
    # Strangers at several loopback addresses; at most 4 from one, 16 in all.
    url = f"http://{node.address}{WS_PATH}"
    sessions = [
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(f"127.0.0.{i}", 0)))
        for i in range(2, 7)
    ]
    try:
        first, *others, last = sessions
        silent = [await first.ws_connect(url) for _ in range(MAX_UNAUTHENTICATED_PER_ADDRESS)]
        opened = time.monotonic()
        # Refused before the upgrade (issue #47): nothing of the connection is read.
        with pytest.raises(aiohttp.WSServerHandshakeError) as over:
            await within(first.ws_connect(url), 1.0, "the refusal beyond one address's share")
        assert over.value.status == 503 and over.value.headers, over.value
        assert over.value.headers["Retry-After"] == "1"
        await streams(node.address)  # one stranger does not lock clients out
        for session in others:
            silent += [
                await session.ws_connect(url) for _ in range(MAX_UNAUTHENTICATED_PER_ADDRESS)
            ]
        assert len(silent) == MAX_UNAUTHENTICATED
        with pytest.raises(aiohttp.WSServerHandshakeError) as over:
            await within(last.ws_connect(url), 1.0, "the refusal beyond the node's cap")
        assert over.value.status == 503, over.value
        async with first.get(f"http://{node.address}/healthz") as answer:
            assert answer.status == 200
        # Each silent one is refused at the hello deadline, which frees its place.
        closed = await within(
            asyncio.gather(*(refusal(ws) for ws in silent)),
            HELLO_TIMEOUT + 5,
            "the hello deadline",
        )
        waited = time.monotonic() - opened
    finally:
        for session in sessions:
            await session.close()
    assert {(error or {}).get("code") for error, _, _ in closed} == {"BAD_FRAME"}
    assert waited < HELLO_TIMEOUT + 4
    await streams(node.address)


def nested_empty_maps(count: int, per_item: int) -> bytes:
    """``count`` items, each an array of ``per_item`` empty maps (1 byte each)."""
    return (b"\xdd" + per_item.to_bytes(4, "big") + b"\x80" * per_item) * count


@pytest.mark.slow
async def test_a_batch_of_16_mib_of_empty_maps_is_refused_within_a_bound(
    tmp_path: Path, within: Within[Any]
) -> None:
    # Before, a client with the token made the node decode 16 million empty maps (1.1 GB).
    node = await node_process(tmp_path)
    limit = 16 * 1024 * 1024 // BYTES_PER_CONTAINER
    batches = [
        (16_000_000, b"\x80" * 16_000_000),  # as items: a count over the limit, read no further
        (15, nested_empty_maps(15, limit)),  # nested: counted as they are built
    ]
    try:
        assert node.proc is not None
        pid = node.proc.pid
        async with aiohttp.ClientSession() as session:
            ws = await session.ws_connect(f"http://{node.address}{WS_PATH}")
            await ws.send_bytes(encode_frame(HELLO))
            assert msgpack.unpackb((await ws.receive()).data)["t"] == "welcome"
            await ws.send_bytes(
                encode_frame(
                    {
                        "t": "open",
                        "sid": "hostile",
                        "receiver": "deltaflow.testing.Echo",
                        "key": b"k" * 32,
                    }
                )
            )
            assert msgpack.unpackb((await ws.receive()).data)["t"] == "opened"
            before = memory_mib(pid, "VmRSS")
            reset_peak(pid)
            answers = []
            async with HealthWatch(node.address) as health:
                for seq, (n, items) in enumerate(batches):
                    # A lane of its own each: a failed batch fails the ones after it.
                    frame = {"t": "batch", "sid": "hostile", "p": seq, "seq": 0, "n": n}
                    await ws.send_bytes(encode_frame({**frame, "items": items, "base": 0}))
                    msg = await within(ws.receive(), 60, f"the answer to batch {seq}")
                    answers.append(msgpack.unpackb(msg.data))
            grown = memory_mib(pid, "VmHWM") - before
            await ws.close()
        await streams(node.address)
    finally:
        await node.stop()
    print(f"\n16 MiB of maps: RSS +{grown:.0f} MiB, /healthz at most {max(health.seconds):.2f} s")  # noqa: T201
    assert [(a["t"], a["code"], a["p"]) for a in answers] == [
        ("error", "BAD_FRAME", 0),
        ("error", "BAD_FRAME", 1),
    ], answers
    assert f"a batch holds at most {limit}" in answers[0]["msg"]
    assert f"more than {limit} maps, arrays" in answers[1]["msg"]
    # 1 Mi empty maps (~75 MiB) before the count stops them, and four copies of the 16 MiB
    # (the message, its items, their array, the heap they leave): 163 MiB measured.
    assert grown < 256, f"node RSS grew by {grown:.0f} MiB"
    assert max(health.seconds) < 1.0, health.seconds
