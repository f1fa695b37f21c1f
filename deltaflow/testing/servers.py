"""Real servers in child processes for tests and benchmarks, started on 127.0.0.1 and
stopped by pid: the base of :mod:`.spark_servers` and :mod:`.object_store`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ServerProcesses", "listening"]


def listening(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


class ServerProcesses:
    """Server processes started in their own process groups (stopped by pid, SIGTERM then
    SIGKILL), their output in ``directory``; a subclass's ``start`` starts them."""

    #: Seconds a server has to become ready.
    start_timeout = 120.0

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _start(self, name: str, command: Sequence[str], env: dict[str, str]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(
                list(command), stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip

    def _until(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while not ready():
            exited = [n for n, p in self.procs.items() if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                why = f"{', '.join(exited)} exited" if exited else f"{self.start_timeout:g} s"
                raise RuntimeError(f"no {what} ({why}): {self.logs()}")
            time.sleep(0.2)

    def logs(self, tail: int = 2000) -> dict[str, str]:
        """The end of each server's output."""
        return {
            name: (self.directory / f"{name}.log").read_text(errors="replace")[-tail:]
            for name in self.procs
        }

    def stop(self) -> None:
        """SIGTERM each process group, SIGKILL what is left after 20 s."""
        for proc in reversed(self.procs.values()):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
