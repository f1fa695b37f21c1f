"""Nodes in processes of their own: ``deltaflow serve`` as a child process (start, SIGKILL,
stop), a free port for it, and a wait until such nodes see each other."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import ssl
import sys
from collections.abc import Sequence

from ..storage.paths import Location

__all__ = ["NodeProcess", "free_port", "wait_for_members"]


#: Ports this process handed out (never twice).
_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the kernel's ephemeral range: a node binds it only
    once its engine started, and the JVMs starting meanwhile take their own ports (Spark's
    driver, block manager, py4j) from the ephemeral range, so one of them could take a port
    the OS had just handed out here."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, max(20001, low))
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # every try taken: the OS's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NodeProcess:
    """``deltaflow serve`` in a child process, on 127.0.0.1 (or ``host``); ``start`` returns once
    it prints 'ready'. For failover tests (``kill`` is a SIGKILL) and benchmarks that want nodes in
    processes of their own, as deployed.

    Args:
        extra: further ``deltaflow serve`` arguments (``--engine``, ``--receiver``...).
        spark_master: ``--spark-master`` (one core by default: tests run several nodes).
        python: the interpreter to run it with (another environment's, say one with only
            ``deltaflow[connect]``); this one's by default.
        host: ``--host``, and the host of :attr:`address`.
        prefix: a command the node's runs under, such as ``ip netns exec NAME`` (a host of
            :mod:`.netns`).
    """

    def __init__(
        self,
        node_id: str,
        warehouse: Location,
        *,
        peers: Sequence[str] = (),
        port: int = 0,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        spark_master: str = "local[1]",
        python: str = sys.executable,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
    ) -> None:
        self.node_id = node_id
        self.port = port or free_port()
        self.address = f"{host}:{self.port}"
        self.args = [
            *prefix,
            python,
            "-m",
            "deltaflow.cli",
            "serve",
            "--node-id",
            node_id,
            "--host",
            host,
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


async def wait_for_members(
    addresses: Sequence[str],
    *,
    timeout: float = 60.0,
    token: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> None:
    """Return once every node at ``addresses`` counts all of them as live members in its
    ``/v1/cluster`` (nodes started as :class:`NodeProcess`, say, before timing anything)."""
    from ..client.router import fetch_cluster

    async with asyncio.timeout(timeout):
        for address in addresses:
            while True:
                body = await fetch_cluster(address, token, 5.0, tls)
                if sum(m["live"] for m in body["members"]) >= len(addresses):
                    break
                await asyncio.sleep(0.1)
