"""Seams for fault injection and test receivers, shipped so users can test like we do.

- :class:`ConnectionDropper`: a ``connection_factory`` for :func:`deltaflow.connect` that cuts
  real connections after a number of batch frames, as a network failure would.
- :class:`Echo`, :class:`EchoStream`, :class:`FailOn`, :class:`AppendRows`, :class:`Validate`,
  :class:`Flaky`, :class:`Concurrency`, :class:`Gated`, :class:`RecordOrder`,
  :class:`TwoTables`, :class:`Unconstructible`: receivers to register on a node
  (``--receiver deltaflow.testing.Echo``) for smoke tests of a deployment.
- ``DELTAFLOW_FAULT_KILL_AFTER_COMMIT=N`` in a node's environment: the node SIGKILLs itself
  right after its N-th table commit, before acknowledging it (crash between commit and ack).
- :func:`at_fault_point`: run a function where a node in this process reaches a fault point,
  e.g. another writer's commit between a group's files being written and its commit.
- :class:`KillOnKey`: a ``key=`` function that SIGKILLs the process streaming (a Spark
  executor's Python worker, say) when it meets a given key, once: a client crash mid-stream.
- :class:`FileSideInput` and :class:`FailingSideInput`: side inputs (``--side-input
  deltaflow.testing.FileSideInput``); :class:`SideInputEcho` returns what a side input held for
  each item, and :func:`stamped_value`/:func:`check_stamped` make and check values whose
  tearing would show.
- :class:`NodeProcess`: ``deltaflow serve`` as a child process (start, SIGKILL, stop), and
  :func:`wait_for_members` until such nodes see each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from . import _faults
from .client.connection import Connection
from .errors import ConnectionLostError, OverloadedError
from .receivers.base import Receiver, ReceiverContext
from .receivers.side_input import SideInput

__all__ = [
    "SIDE_INPUT_FILE_ENV",
    "AppendRows",
    "Concurrency",
    "ConnectionDropper",
    "Discard",
    "Echo",
    "EchoStream",
    "FailOn",
    "FailingSideInput",
    "FileSideInput",
    "Flaky",
    "Gated",
    "KillOnKey",
    "NodeProcess",
    "RecordOrder",
    "RequestDropper",
    "SideInputEcho",
    "TwoTables",
    "Unconstructible",
    "Validate",
    "at_fault_point",
    "check_stamped",
    "free_port",
    "stamped_value",
    "wait_for_members",
]


class ConnectionDropper:
    """Opens real connections, and aborts each one's socket after ``after_batches`` batch sends.

    The batch that trips the limit is sent first, so the node may apply it while the client
    never sees the ack: exactly the lost-ack case resends must survive.

    Attributes:
        dropped: connections cut so far.
        limit: how many connections to cut at most (later ones are left alone).
    """

    def __init__(self, after_batches: int, *, limit: int = 1) -> None:
        self.after_batches = after_batches
        self.limit = limit
        self.dropped = 0
        self._cuts: set[asyncio.Task[None]] = set()

    async def __call__(self, address: str, **kwargs: Any) -> Connection:
        conn = await Connection.open(address, **kwargs)
        if self.dropped >= self.limit:
            return conn
        original = conn.start_batch  # every batch send goes through it
        sent = 0

        async def cut() -> None:
            await conn._outbox.drain()  # on the wire, then the connection goes
            conn._abort_transport()

        def start_batch(frame: dict[str, Any], *, timeout: float) -> asyncio.Future[Any]:
            nonlocal sent
            sent += 1
            answer = original(frame, timeout=timeout)
            if sent == self.after_batches and self.dropped < self.limit:
                self.dropped += 1
                task = asyncio.ensure_future(cut())
                self._cuts.add(task)
                task.add_done_callback(self._cuts.discard)
            return answer

        conn.start_batch = start_batch  # type: ignore[method-assign]
        return conn


class RequestDropper:
    """Opens real connections and loses every ``every``-th batch request on the way: the frame
    is never sent, so no ack comes and the client's ``ack_timeout`` expires, as on a lossy
    network. (Use a short ``StreamerOptions.ack_timeout`` with it.)

    Attributes:
        dropped: requests lost so far (counted across all connections it opened).
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.sent = 0
        self.dropped = 0

    async def __call__(self, address: str, **kwargs: Any) -> Connection:
        conn = await Connection.open(address, **kwargs)
        original = conn.start_batch  # every batch send goes through it

        def lost(answer: asyncio.Future[Any], timeout: float) -> None:
            if not answer.done():
                answer.set_exception(
                    ConnectionLostError(
                        f"no ack from {address} within {timeout}s (request lost by "
                        "deltaflow.testing)"
                    )
                )

        def start_batch(frame: dict[str, Any], *, timeout: float) -> asyncio.Future[Any]:
            self.sent += 1
            if self.sent % self.every == 0:
                self.dropped += 1
                answer = asyncio.get_running_loop().create_future()
                asyncio.get_running_loop().call_later(timeout, lost, answer, timeout)
                return answer  # the ack that never comes
            return original(frame, timeout=timeout)

        conn.start_batch = start_batch  # type: ignore[method-assign]
        return conn


class Discard(Receiver):
    """Accepts every item and does nothing (a no-op receiver, for load tests)."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> None:
        return None


class Echo(Receiver):
    """Returns each item as its result."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        return list(items)


class EchoStream(Receiver):
    """Yields each item as its result as it goes (an async-generator receiver)."""

    async def receive(  # type: ignore[override]
        self, items: Sequence[Any], ctx: ReceiverContext
    ) -> AsyncIterator[Any]:
        for item in items:
            yield item


class FailOn(Receiver):
    """Returns items like :class:`Echo`, but raises on an item equal to ``args["fail_on"]``.

    ``args["retriable"]`` true raises a retriable error instead (the client resends), but only
    the first ``args.get("times", 1)`` times on this node.
    """

    raised = 0

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        args = ctx.args or {}
        if args.get("fail_on") in items:
            if args.get("retriable"):
                if FailOn.raised < args.get("times", 1):
                    FailOn.raised += 1
                    raise OverloadedError("injected retriable failure")
            else:
                raise ValueError(f"injected failure on item {args['fail_on']!r}")
        return list(items)


class AppendRows(Receiver):
    """Appends every item (a row) to the table ``args["table"]``: not idempotent by itself,
    so it shows that resent batches are not applied twice."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> None:
        await ctx.table(ctx.args["table"]).append(items)


class RecordOrder(Receiver):
    """Echoes items and records each item it applies in ``RecordOrder.applied``, in the order
    this process's nodes applied them: what per-key order is checked against."""

    applied: list[Any] = []  # noqa: RUF012 - one record per process, on purpose

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        RecordOrder.applied.extend(items)
        return list(items)


class TwoTables(Receiver):
    """Upserts every row (keyed by ``id``) into both tables named in ``args["tables"]``: one
    batch, two table commits, one ack."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> None:
        for table in ctx.args["tables"]:
            await ctx.table(table, key=["id"]).upsert(items)


class Unconstructible(Receiver):
    """A receiver whose constructor raises: a stream naming it fails to open with
    ``RECEIVER_FAILED``, and other streams go on (a deployment's broken receiver)."""

    def __init__(self) -> None:
        raise RuntimeError("this receiver cannot be constructed (deltaflow.testing)")

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> None:
        raise AssertionError("never constructed")


class Validate(Receiver):
    """Echoes dict items, but marks failed (``ctx.fail``) every item whose ``"ok"`` is false:
    the rest of the batch is applied."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        out = []
        for i, item in enumerate(items):
            if item.get("ok", True):
                out.append(item)
            else:
                ctx.fail(i, f"item {item.get('id')!r} is not ok")
        return out


class Flaky(Receiver):
    """An idempotent receiver that raises a retriable error on its first ``args["times"]`` calls
    (counted per node in ``Flaky.calls``), then returns ``{"item": x, "attempt": n}`` results."""

    idempotent = True
    calls = 0

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        Flaky.calls += 1
        if Flaky.calls <= (ctx.args or {}).get("times", 1):
            raise OverloadedError(f"injected retriable failure {Flaky.calls}")
        return [{"item": x, "attempt": ctx.attempt} for x in items]


class Concurrency(Receiver):
    """Echoes items after a short await, recording how many calls ran at once (``peak``); at
    most ``max_concurrency`` = 2 unless the node overrides it."""

    max_concurrency = 2
    running = 0
    peak = 0

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        Concurrency.running += 1
        Concurrency.peak = max(Concurrency.peak, Concurrency.running)
        try:
            await asyncio.sleep(0.01)  # stands for work; lets other lanes start meanwhile
        finally:
            Concurrency.running -= 1
        return list(items)


class Gated(Receiver):
    """Yields its first item's result, then waits for ``Gated.gate`` (an asyncio.Event the test
    sets) before yielding the rest: shows results stream back before the batch completes."""

    gate: asyncio.Event | None = None

    async def receive(  # type: ignore[override]
        self, items: Sequence[Any], ctx: ReceiverContext
    ) -> AsyncIterator[Any]:
        for i, item in enumerate(items):
            yield item
            if i == 0 and Gated.gate is not None:
                await Gated.gate.wait()


@contextlib.contextmanager
def at_fault_point(name: str, action: Callable[[], None]) -> Iterator[None]:
    """While in the block, run ``action`` (on the reaching thread, blocking it) whenever a
    node of this process reaches fault point ``name``. Points: ``before_listing`` (a group
    is about to list the table's live files it may touch; the lane marks are read),
    ``before_commit`` (a group's data files are written, its commit not yet made; the Spark
    engine's direct writer and the delta-rs engine's copy-on-write and merge-on-read),
    ``after_commit`` (the commit landed, its batches not yet acknowledged), ``taken`` (a
    group was taken off the table's queue, not yet prepared), ``prepared``
    (a group was prepared outside the table's lock and is about to wait for it),
    ``converting`` (a write's rows are about to be checked and converted for the queue) and
    ``checkpointing`` (a checkpoint a commit made due is about to be written, on its own
    thread, the table's lock released)."""
    _faults.set_action(name, action)
    try:
        yield
    finally:
        _faults.set_action(name, None)


class KillOnKey:
    """A ``key=`` function that SIGKILLs its own process when it meets ``value`` in ``column``.

    It kills only once: it first creates ``marker`` (a file path), and never kills while the
    marker exists. Pass it as ``key=`` to :func:`deltaflow.stream_data` or to the Spark helpers
    (it pickles, so it travels to Spark executors) to crash a client in the middle of a
    stream, after the items before ``value`` were pulled and some of their batches acked, as an
    executor lost mid-task would. Otherwise it returns ``item[column]``.
    """

    def __init__(self, column: str, value: Any, marker: str | os.PathLike[str]) -> None:
        self.column = column
        self.value = value
        self.marker = str(marker)

    def __repr__(self) -> str:
        return f"<KillOnKey {self.column}={self.value!r} marker={self.marker}>"

    def __call__(self, item: Any) -> Any:
        key = item[self.column]
        if key == self.value:
            try:
                Path(self.marker).touch(exist_ok=False)
            except FileExistsError:
                return key
            os.kill(os.getpid(), signal.SIGKILL)
        return key


#: The environment variable :class:`FileSideInput` reads its file's path from.
SIDE_INPUT_FILE_ENV = "DELTAFLOW_SIDE_INPUT_FILE"


class FileSideInput(SideInput):
    """Side input ``"file"``: the bytes of the file named by ``$DELTAFLOW_SIDE_INPUT_FILE``,
    read every 0.1 s; it declines (returns None, no new version) while the file is missing.

    Replace the file atomically (write a temporary file, then ``os.replace``) so it is never
    read half-written.
    """

    name = "file"
    interval = 0.1

    def retrieve(self) -> bytes | None:
        path = os.environ.get(SIDE_INPUT_FILE_ENV)
        if not path:
            raise RuntimeError(f"set ${SIDE_INPUT_FILE_ENV} to the file holding side input 'file'")
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None


class FailingSideInput(SideInput):
    """Side input ``"failing"``: every retrieval raises, like a source that is down."""

    name = "failing"
    interval = 0.2

    def retrieve(self) -> bytes | None:
        raise ConnectionError("injected: the side input's source is down")


def _stamp_blob(stamp: int, size: int) -> str:
    unit = f"{stamp}-"
    return (unit * (size // len(unit) + 1))[:size]


def stamped_value(stamp: int, size: int = 100_000) -> bytes:
    """A JSON side-input value of about ``size`` bytes, every part of which depends on
    ``stamp``, with its own checksum: :func:`check_stamped` tells whether it is whole."""
    blob = _stamp_blob(stamp, size)
    digest = hashlib.sha256(blob.encode()).hexdigest()
    return json.dumps({"stamp": stamp, "blob": blob, "sha256": digest}).encode()


def check_stamped(raw: bytes) -> dict[str, Any]:
    """``{"stamp": int | None, "ok": bool}``: whether ``raw`` is one whole
    :func:`stamped_value` (a parse function for ``ctx.side_input``)."""
    try:
        value = json.loads(raw)
        stamp, blob = value["stamp"], value["blob"]
        whole = hashlib.sha256(blob.encode()).hexdigest() == value["sha256"]
        ok = whole and blob == _stamp_blob(stamp, len(blob))
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"stamp": None, "ok": False}
    return {"stamp": stamp, "ok": ok}


class SideInputEcho(Receiver):
    """For every item, what side input ``args["name"]`` (default ``"file"``) held when the
    item was processed: ``{"item", "stamp", "ok", "node"}``, read per item from a worker
    thread through ``ctx.side_input(name, parse=check_stamped)``."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[dict[str, Any]]:
        name = (ctx.args or {}).get("name", "file")

        def read() -> list[dict[str, Any]]:
            out = []
            for item in items:
                seen = ctx.side_input(name, parse=check_stamped)
                out.append(
                    {"item": item, "stamp": seen["stamp"], "ok": seen["ok"], "node": ctx.node_id}
                )
            return out

        return await asyncio.to_thread(read)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NodeProcess:
    """``deltaflow serve`` in a child process, on 127.0.0.1; ``start`` returns once it prints
    'ready'. For failover tests (``kill`` is a SIGKILL) and benchmarks that want nodes in
    processes of their own, as deployed.

    Args:
        extra: further ``deltaflow serve`` arguments (``--engine``, ``--receiver``...).
        spark_master: ``--spark-master`` (one core by default: tests run several nodes).
    """

    def __init__(
        self,
        node_id: str,
        warehouse: Path,
        *,
        peers: Sequence[str] = (),
        port: int = 0,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        spark_master: str = "local[1]",
    ) -> None:
        self.node_id = node_id
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.args = [
            sys.executable,
            "-m",
            "deltaflow.cli",
            "serve",
            "--node-id",
            node_id,
            "--port",
            str(self.port),
            "--warehouse",
            str(warehouse),
            "--spark-master",
            spark_master,
            *extra,
        ]
        if peers:
            self.args += ["--peers", ",".join(peers)]
        self.env = env or {}
        self.proc: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None
        self.output: list[str] = []

    async def start(self, timeout: float = 120.0) -> NodeProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = await asyncio.create_subprocess_exec(
            *self.args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env
        )
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = (await self.proc.stdout.readline()).decode()
                if not line:
                    raise RuntimeError(f"{self.node_id} exited: {''.join(self.output)[-3000:]}")
                self.output.append(line)
                if "ready on" in line:
                    break
        self._drain = asyncio.create_task(self._drain_output())
        return self

    async def _drain_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.output.append(line.decode())

    def kill(self) -> None:
        """SIGKILL: no goodbye, exactly like a crash."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                async with asyncio.timeout(30):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._drain is not None:  # None when start() failed before the node was ready
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain


async def wait_for_members(addresses: Sequence[str], *, timeout: float = 60.0) -> None:
    """Return once every node at ``addresses`` lists all of them as members in its
    ``/v1/cluster`` (nodes started as :class:`NodeProcess`, say, before timing anything)."""
    import aiohttp

    async with aiohttp.ClientSession() as session, asyncio.timeout(timeout):
        for address in addresses:
            while True:
                async with session.get(f"http://{address}/v1/cluster") as response:
                    if len((await response.json())["members"]) >= len(addresses):
                        break
                await asyncio.sleep(0.1)
