"""One side input as a node manages it: its class, schedule and directory, the value it serves,
its part in the leadership, and its counters."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...errors import UsageError
from ...receivers.side_input import SideInput
from .directory import Directory
from .schedule import Schedule
from .version import Version

__all__ = ["Managed"]


class Managed:
    """One side input on this node: its class, schedule, files, current value and counters."""

    def __init__(self, cls: type[SideInput], directory: Directory) -> None:
        self.cls = cls
        self.name = cls.side_input_name()
        self.schedule = Schedule.of(cls)
        self.dir = directory
        try:
            self.instance = cls()
        except Exception as exc:
            raise UsageError(
                f"side input {self.name!r}: {cls.__qualname__}() raised {exc!r}"
            ) from exc
        self.current: Version | None = None
        self.ready = asyncio.Event()
        self.wake = asyncio.Event()
        # Counts this node's leadership changes: retries of a retrieval end with their term.
        self.term = 0
        self.is_leader = False
        self.epoch = 0  # the lease epoch this node leads under (a new epoch: a new leadership)
        self.leader: str | None = None
        self.last_run: float | None = None
        # Its own thread for a synchronous retrieve(): one call at a time, even after a call
        # timed out (its thread cannot be stopped), and never starving the node's other work.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"deltaflow-side-{self.name}")
        self.running: concurrent.futures.Future[Any] | None = None
        # The SHA-256 CURRENT holds, as this node last wrote or checked it under its lease.
        self.stored_sha256: str | None = None
        self.next_run = 0.0  # wall-clock time of the next scheduled retrieval, while leading
        self.retrievals = 0
        self.published = 0
        self.declined = 0
        self.unchanged = 0
        self.failures = 0
        self.last_error: str | None = None

    def leadership_changed(self) -> None:
        """This node took, lost or re-took the lease: wake whoever waits for that."""
        self.term += 1
        self.wake.set()

    async def woken(self, timeout: float | None) -> None:
        """Wait for a leadership change, or ``timeout`` seconds (None: no limit)."""
        self.wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.wake.wait()
