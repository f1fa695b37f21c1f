"""Nodes as real subprocesses (``deltaflow serve``), for cross-process and failover tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NodeProcess:
    """``deltaflow serve`` in a child process; ``start`` returns once it prints 'ready'."""

    def __init__(
        self,
        node_id: str,
        warehouse: Path,
        *,
        peers: list[str] = (),
        port: int = 0,
        extra: list[str] = (),
        env: dict[str, str] | None = None,
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
            "local[1]",
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
