"""A stranger cannot exhaust a node (issue #47, findings 1, 3 and 4).

A stranger's WebSocket (no token in the upgrade request) is refused before its upgrade past
the handshake caps, and may send a few KiB until its hello passes; a client holding the token
proves it in the upgrade and never waits behind strangers; every listener closes half-sent
requests and caps its open connections, per node and per address, below the open-file limit.
Memory and the open-file limit are measured on node processes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

import deltaflow
from deltaflow.protocol import WS_PATH, encode_frame
from deltaflow.server import Node
from deltaflow.server.connection import (
    FIRST_MESSAGE_BYTES,
    HELLO_TIMEOUT,
    MAX_UNAUTHENTICATED,
    MAX_UNAUTHENTICATED_PER_ADDRESS,
)
from deltaflow.server.listening import connection_caps
from deltaflow.testing import NodeProcess

from .support import (
    Eventually,
    HealthWatch,
    StartCluster,
    Within,
    echo_node_process,
    memory_mib,
    reset_peak,
)

TOKEN = "stranger-test-token"
HELLO = {"t": "hello", "v": [1], "caps": [], "client": "raw-client", "token": TOKEN}
MiB = 1024 * 1024
_ZEROS = memoryview(bytes(MiB))


class Raw:
    """One connection to a node written by hand, from a local address of the test's choosing
    (127.0.0.x are all loopback on Linux)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, address: str, source: str = "127.0.0.1") -> Raw:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
        return cls(reader, writer)

    async def upgrade(self, address: str, headers: dict[str, str] | None = None) -> int:
        """Ask for the WebSocket upgrade of ``/v1/stream``: the answer's status."""
        key = base64.b64encode(os.urandom(16)).decode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.writer.write(
            f"GET {WS_PATH} HTTP/1.1\r\nHost: {address}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n"
            f"{extra}\r\n".encode()
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        self.head = head.decode()
        return int(head.split(b" ", 2)[1])

    async def send_message(self, size: int, timeout: float) -> None:
        """One binary WebSocket message of ``size`` zero bytes (zero mask: no copy is made),
        for as much as the node takes within ``timeout`` seconds."""
        self.writer.write(b"\x82\xff" + size.to_bytes(8, "big") + b"\0\0\0\0")
        sent = 0
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(timeout):
                while sent < size:
                    chunk = _ZEROS[: min(MiB, size - sent)]
                    self.writer.write(chunk)
                    await self.writer.drain()
                    sent += len(chunk)

    async def closed_within(self, seconds: float) -> bytes | None:
        """What the node sent until it closed the connection, or None if it is still open
        after ``seconds``."""
        received = b""
        try:
            async with asyncio.timeout(seconds):
                while data := await self.reader.read(65536):
                    received += data
        except TimeoutError:
            return None
        except OSError:
            pass  # reset: closed too
        return received

    async def response(self) -> tuple[int, bytes]:
        """The next HTTP response on the connection: its status and body."""
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode()
        length = next(
            int(line.split(":", 1)[1])
            for line in head.splitlines()
            if line.lower().startswith("content-length:")
        )
        return int(head.split(" ", 2)[1]), await self.reader.readexactly(length)

    def abort(self) -> None:
        self.writer.transport.abort()


async def statuses(*conns: Raw, address: str) -> list[int]:
    return list(await asyncio.gather(*(c.upgrade(address) for c in conns)))


async def streams(address: str, rows: int = 200) -> deltaflow.StreamSummary:
    """A real client (it sends the token in the upgrade) streams ``rows`` rows."""
    async with deltaflow.connect([address], token=TOKEN) as client:
        summary = await client.stream_data(
            [{"i": i} for i in range(rows)], key="i", receiver="deltaflow.testing.Echo"
        )
    assert summary.items_acked == rows, summary
    return summary


async def node_process(tmp_path: Path, *extra: str, prefix: tuple[str, ...] = ()) -> NodeProcess:
    return await echo_node_process(tmp_path, TOKEN, *extra, prefix=prefix)


@pytest.fixture
async def node(warehouse: Path, start_cluster: StartCluster) -> AsyncIterator[Node]:
    (node,) = await start_cluster(warehouse, count=1, engine="delta-rs", token=TOKEN)
    yield node


# -- 1. first messages ---------------------------------------------------------------------


@pytest.mark.slow
async def test_strangers_first_messages_are_refused_unread_and_clients_stream_meanwhile(
    tmp_path: Path, within: Within[Any]
) -> None:
    # Finding 1: 64 silent connections from one address, each sending a first message of
    # 16 MiB, took RSS 69 MB -> 1.11 GB (held ~40 s): the caps refused them after the upgrade,
    # once aiohttp had read the message. From 4 addresses, all 16 handshake slots take one.
    node = await node_process(tmp_path)
    conns: list[Raw] = []
    try:
        assert node.proc is not None
        pid = node.proc.pid
        conns = [await Raw.connect(node.address, f"127.0.0.{2 + i // 16}") for i in range(64)]
        before = memory_mib(pid, "VmRSS")
        reset_peak(pid)
        async with HealthWatch(node.address) as health:
            answers = await within(statuses(*conns, address=node.address), 10, "the upgrades")
            upgraded = [c for c, status in zip(conns, answers, strict=True) if status == 101]
            # Just under the node's 16 MiB frame limit: aiohttp alone would read it whole.
            sending = [
                asyncio.create_task(c.send_message(16 * MiB - 64, timeout=5)) for c in upgraded
            ]
            summary = await within(streams(node.address), 20, "a client's stream meanwhile")
            refusals = await within(
                asyncio.gather(*(c.closed_within(10) for c in upgraded)), 15, "the refusals"
            )
            await asyncio.gather(*sending)
        grown = memory_mib(pid, "VmHWM") - before
    finally:
        for conn in conns:
            conn.abort()
        await node.stop()
    print(f"\n64 first messages of 16 MiB: RSS +{grown:.0f} MiB, /healthz at most "  # noqa: T201
          f"{max(health.seconds):.2f} s")  # fmt: skip
    assert sorted(answers) == [101] * MAX_UNAUTHENTICATED + [503] * (64 - MAX_UNAUTHENTICATED)
    refused = conns[answers.index(503)]
    assert "Retry-After: 1" in refused.head, refused.head
    assert summary.batches_retried == 0
    # Each upgraded stranger is told why, in a frame of its own, and closed (1009).
    for received in refusals:
        assert received is not None, "a stranger's connection was not closed"
        assert b"\x03\xf1FRAME_TOO_LARGE" in received, received  # close 1009 and the code
    # What the node read of them: a few KiB each (measured +5 MiB; before, over 1 GB).
    assert grown < 64, f"node RSS grew by {grown:.0f} MiB"
    assert max(health.seconds) < 0.5, health.seconds


async def test_a_stranger_past_the_handshake_caps_is_refused_before_the_upgrade(
    node: Node, within: Within[Any]
) -> None:
    conns = [await Raw.connect(node.address, "127.0.0.2") for _ in range(6)]
    try:
        answers = await within(statuses(*conns, address=node.address), 5, "the upgrades")
        assert answers == [101] * MAX_UNAUTHENTICATED_PER_ADDRESS + [503, 503], answers
        body = await conns[-1].closed_within(5)  # the 503 closes the connection
        assert body is not None and b'"code": "OVERLOADED"' in body, body
        assert b"in their handshake without a token" in body
        # Another address still has its share, and the token skips the queue.
        other = await Raw.connect(node.address, "127.0.0.3")
        assert await other.upgrade(node.address) == 101
        proven = await Raw.connect(node.address, "127.0.0.2")
        assert await proven.upgrade(node.address, {"Authorization": f"Bearer {TOKEN}"}) == 101
        # A wrong token is refused before the upgrade.
        wrong = await Raw.connect(node.address, "127.0.0.4")
        assert await wrong.upgrade(node.address, {"Authorization": "Bearer nope"}) == 401
        body = await wrong.closed_within(5)
        assert body is not None and b"UNAUTHORIZED" in body, body
        conns += [other, proven, wrong]
    finally:
        for conn in conns:
            conn.abort()


async def test_a_stranger_may_send_a_few_kib_before_its_hello_passes(
    warehouse: Path, start_cluster: StartCluster, within: Within[Any]
) -> None:
    # Also on a node without a token (loopback, dev mode): the caps and the limit hold.
    (node,) = await start_cluster(warehouse, count=1, engine="delta-rs")
    async with aiohttp.ClientSession() as session:
        ws = await session.ws_connect(f"http://{node.address}{WS_PATH}")
        hello = encode_frame({**HELLO, "client": "x" * 8000})  # valid, but past the limit
        assert len(hello) > FIRST_MESSAGE_BYTES
        await ws.send_bytes(hello)
        error = msgpack.unpackb((await within(ws.receive(), 5, "the refusal")).data)
        assert error["code"] == "FRAME_TOO_LARGE", error
        assert f"more than {FIRST_MESSAGE_BYTES} bytes before the hello passed" in error["msg"]
        assert (await within(ws.receive(), 5, "the close")).type == aiohttp.WSMsgType.CLOSE
        assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
        # Once the hello passed, a message up to the frame limit is read.
        ws = await session.ws_connect(f"http://{node.address}{WS_PATH}")
        await ws.send_bytes(encode_frame({**HELLO, "token": None}))
        assert msgpack.unpackb((await ws.receive()).data)["t"] == "welcome"
        await ws.send_bytes(encode_frame({"t": "open", "sid": "s" * 100, "receiver": "x" * 60000,
                                          "key": b"k" * 32}))  # fmt: skip
        answer = msgpack.unpackb((await within(ws.receive(), 5, "the open's answer")).data)
        assert answer.get("code") == "UNKNOWN_RECEIVER", answer
        await ws.close()
    conns = [await Raw.connect(node.address, "127.0.0.5") for _ in range(5)]
    try:
        answers = await statuses(*conns, address=node.address)
        assert answers == [101] * MAX_UNAUTHENTICATED_PER_ADDRESS + [503], answers
    finally:
        for conn in conns:
            conn.abort()


# -- 3. slots ------------------------------------------------------------------------------


async def test_strangers_reopening_every_slot_never_lock_out_a_client_with_the_token(
    node: Node, within: Within[Any], eventually: Eventually
) -> None:
    # Finding 3: 16 idle WebSockets from 4 addresses, reopened after each hello timeout,
    # kept every handshake slot full; a client with the token failed OVERLOADED after 23.9 s.
    stop = asyncio.Event()
    held: list[Raw] = []
    reopened = 0

    async def squat(source: str) -> None:
        nonlocal reopened
        while not stop.is_set():
            conn = await Raw.connect(node.address, source)
            held.append(conn)
            if await conn.upgrade(node.address) == 101:
                reopened += 1
                with contextlib.suppress(TimeoutError):  # the refusal at the hello timeout
                    await asyncio.wait_for(conn.reader.read(1), HELLO_TIMEOUT + 5)
            else:
                await asyncio.sleep(0.05)  # taken again before this one got in
            conn.abort()

    squatters = [asyncio.create_task(squat(f"127.0.0.{10 + i // 4}")) for i in range(16)]
    try:
        await eventually(lambda: reopened >= MAX_UNAUTHENTICATED, "the strangers in every slot")
        started = time.monotonic()
        # Past one hello timeout, while the slots are freed and taken again.
        while time.monotonic() - started < HELLO_TIMEOUT + 1.5:
            summary = await within(streams(node.address, 20), 5, "a client's stream")
            assert summary.batches_retried == 0, summary
        late = await Raw.connect(node.address, "127.0.0.20")
        held.append(late)
        assert await late.upgrade(node.address) == 503  # every stranger's slot was taken
        assert reopened > MAX_UNAUTHENTICATED, "the strangers never reopened their slots"
    finally:
        stop.set()
        for task in squatters:
            task.cancel()
        await asyncio.gather(*squatters, return_exceptions=True)
        for conn in held:
            conn.abort()


# -- 4. half-sent requests and open connections --------------------------------------------

HALF_SENT = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "


async def test_a_half_sent_request_is_closed_within_the_header_timeout(
    warehouse: Path, start_cluster: StartCluster, within: Within[Any]
) -> None:
    # Finding 4: 2,000 half-sent requests stayed open past 90 s.
    (node,) = await start_cluster(
        warehouse, count=1, engine="delta-rs", token=TOKEN, header_timeout=1.0, idle_timeout=3.0
    )
    silent = [await Raw.connect(node.address) for _ in range(10)]
    half = [await Raw.connect(node.address) for _ in range(10)]
    kept = await Raw.connect(node.address)
    try:
        for conn in half:
            conn.writer.write(HALF_SENT)
        # A kept-alive connection: one request whole, then half of the next one.
        kept.writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await kept.response())[0] == 200
        await asyncio.sleep(0.5)  # under the header timeout: its clock starts with a byte
        started = time.monotonic()
        kept.writer.write(HALF_SENT)
        closed = await within(
            asyncio.gather(*(c.closed_within(3) for c in [*silent, *half, kept])), 5, "closes"
        )
        waited = time.monotonic() - started
    finally:
        for conn in [*silent, *half, kept]:
            conn.abort()
    assert all(c is not None and c.startswith(b"HTTP/1.1 408 Request Timeout") for c in closed)
    assert 1.0 <= waited < 2.0, waited
    # A kept-alive connection serves request after request (each head on its own clock),
    # and is closed once idle for the idle timeout.
    busy = await Raw.connect(node.address)
    try:
        for _ in range(4):  # 1.5 s of requests 0.5 s apart, past the header timeout
            await asyncio.sleep(0.5)
            busy.writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await within(busy.response(), 2, "an answer"))[0] == 200
        started = time.monotonic()
        assert await within(busy.closed_within(5), 6, "the idle close") is not None
        assert 2.5 < time.monotonic() - started < 4.5
    finally:
        busy.abort()


async def test_open_connections_are_capped_per_node_and_per_address_at_accept(
    warehouse: Path, start_cluster: StartCluster
) -> None:
    (node,) = await start_cluster(
        warehouse, count=1, engine="delta-rs", token=TOKEN, max_connections=12,
        max_connections_per_address=6,
    )  # fmt: skip
    first = [await Raw.connect(node.address, "127.0.0.2") for _ in range(7)]
    second = [await Raw.connect(node.address, "127.0.0.3") for _ in range(6)]
    third = await Raw.connect(node.address, "127.0.0.4")
    try:
        # Answered as accepted, before any byte of a request was sent.
        over = await first[-1].closed_within(2)
        assert over is not None and over.startswith(b"HTTP/1.1 503"), over
        assert b"Retry-After: 1" in over and b"its cap per address (6)" in over
        over = await third.closed_within(2)
        assert over is not None and b"12 connections open, its cap (12)" in over, over
        still = await asyncio.gather(*(c.closed_within(0.2) for c in [*first[:-1], *second]))
        assert still == [None] * 12, still
        for conn in second:
            conn.abort()
        await asyncio.sleep(0.2)  # the node sees them gone
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{node.address}/healthz") as answer:
                assert answer.status == 200
    finally:
        for conn in [*first, *second, third]:
            conn.abort()


@pytest.mark.slow
async def test_open_connections_stay_below_the_open_file_limit(
    tmp_path: Path, within: Within[Any]
) -> None:
    # Finding 4: under a 400 open-file limit, 420 idle connections made /healthz fail (EMFILE,
    # and 53,000 lines of "Too many open files" in the log).
    caps = connection_caps(1024, 1024, open_files=400)
    assert (caps.total, caps.per_address) == (272, 136)
    node = await node_process(
        tmp_path, "--max-connections-per-address", "1024", prefix=("prlimit", "--nofile=400:400")
    )
    conns: list[Raw] = []
    try:
        for _ in range(420):  # from one address: over the open-file limit on their own
            conns.append(conn := await Raw.connect(node.address, "127.0.0.2"))
            conn.writer.write(HALF_SENT)
        refused = await within(
            asyncio.gather(*(c.closed_within(0.5) for c in conns)), 10, "the refusals"
        )
        answered = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            for _ in range(10):
                started = time.monotonic()
                async with session.get(f"http://{node.address}/healthz") as answer:
                    answered.append((answer.status, time.monotonic() - started))
    finally:
        for conn in conns:
            conn.abort()
        await node.stop()
    held = sum(r is None for r in refused)
    assert held == caps.per_address, held
    # Closed as accepted: a 503, or a reset where the node closed on the unread request.
    assert all(r == b"" or r.startswith(b"HTTP/1.1 503") for r in refused if r is not None)
    assert all(status == 200 and seconds < 0.5 for status, seconds in answered), answered
    assert not [line for line in node.output if "Too many open files" in line]
