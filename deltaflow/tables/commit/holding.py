"""What both sides of a commit do around it: hold the table's commit atomicity from the loop
(:func:`hold_table`), see a started commit to its end (:func:`finish`), and write the
checkpoints the commits made due (:class:`CheckpointWriter`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from ..._faults import fault_point

if TYPE_CHECKING:
    from .engine import CommitterEngine

__all__ = ["CheckpointWriter", "finish", "hold_table"]

log = logging.getLogger(__name__)

T = TypeVar("T")


async def hold_table(
    engine: CommitterEngine, table: str, released_at: float | None
) -> contextlib.AbstractContextManager[float]:
    """The table's commit atomicity, entered on a worker thread (the caller leaves it, on the
    loop). Cancelled while waiting for it: released as soon as it is taken.

    Raises:
        Exception: entering failed (the lock's timeout, for instance).
    """
    held = engine.atomicity.hold(table, released_at=released_at)
    entering = asyncio.ensure_future(engine.in_thread(held.__enter__))
    try:
        await asyncio.shield(entering)
    except asyncio.CancelledError:
        entering.add_done_callback(functools.partial(_release_if_taken, held=held))
        raise
    return held


async def finish(work: Awaitable[T]) -> T:
    """``work``'s result, awaited to its end even if the caller is cancelled meanwhile (then
    the cancellation is raised once it ended): a commit that started is never abandoned
    half-way, and the table it holds is released only after it."""
    running = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await running
        raise


class CheckpointWriter:
    """Writes the checkpoints a table's commits made due, on a thread of its own: after the
    commit landed and its batches were acknowledged, and outside the table's atomicity, so
    neither this node's next commits nor another node's wait for it. One at a time: a
    checkpoint due while one is written is skipped (readers replay a few more commits until
    the next)."""

    def __init__(self, engine: CommitterEngine, table: str) -> None:
        self.engine = engine
        self.table = table
        self.path = engine.warehouse / table
        self.running: asyncio.Future[None] | None = None

    def start(self, version: int) -> None:
        if self.running is None or self.running.done():
            self.running = asyncio.ensure_future(self._checkpoint(version))

    async def wait(self) -> None:
        """Until the checkpoint being written (if any) is (it finishes on its thread)."""
        if self.running is not None:
            await asyncio.wait([self.running])

    async def _checkpoint(self, version: int) -> None:
        """The checkpoint at ``version``; a failure is logged (a checkpoint only speeds readers
        up; the next interval tries again)."""
        started = time.monotonic()
        try:
            await asyncio.to_thread(self._write, version)
        except Exception as exc:  # noqa: BLE001
            log.warning("table %s: checkpoint at version %d failed: %s", self.table, version, exc)
            return
        self.engine.stats.checkpoints += 1
        self.engine.stats.checkpoint_seconds += time.monotonic() - started

    def _write(self, version: int) -> None:
        fault_point("checkpointing")
        self.engine.checkpoint(self.table, self.path, version)


def _release_if_taken(entering: asyncio.Future[Any], held: Any) -> None:
    if not entering.cancelled() and entering.exception() is None:
        held.__exit__(None, None, None)
