"""A table's staging queue: the writes waiting for the next group commit, and the pace at
which groups are taken from it.

While one commit runs, newly staged writes queue up, and the next commit takes all of them (up
to the group bounds). Under load groups grow and amortise a commit's fixed cost; under light
load a lone write commits at once. A group never waits to fill: it is taken the moment the
previous commit ends (an idle committer woken by a burst waits, briefly, for the writes of the
burst still being converted). Only ``min_commit_interval`` holds a group back, to cap the
commit rate: until that long after the previous group was taken, or until a whole group is
queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from ..._faults import fault_point
from ..engine_settings import EngineSettings
from ..marks import Mark

__all__ = ["GATHER_SECONDS", "Staged", "StagingQueue", "settle"]

#: How long a committer woken from idle waits at most for writes being converted to join its
#: group (see :meth:`StagingQueue.gather`).
GATHER_SECONDS: Final = 0.02


@dataclass(slots=True)
class Staged:
    """One write waiting for its commit."""

    table: Any  # pyarrow.Table incl. DELETE_COLUMN (and BUCKET_COLUMN when buckets > 0)
    future: asyncio.Future[None]
    abandoned: Callable[[], bool] | None
    mark: tuple[str, Mark] | None = None  # (lane, mark) for exactly-once; None: always apply
    buckets: int = 0  # the bucket count the bucket column was computed with
    # True while the receiver that staged the write still runs: the write is not committed
    # until it returned (a receiver that raises after staging must leave no trace).
    held: Callable[[], bool] | None = None
    rows: int = dataclasses.field(init=False)
    nbytes: int = dataclasses.field(init=False)  # measured once: it walks every buffer
    staged_at: float = dataclasses.field(init=False)  # time.monotonic()
    taken_at: float = 0.0  # when its group was taken off the queue (0.0: not yet)

    def __post_init__(self) -> None:
        self.rows = int(self.table.num_rows)
        self.nbytes = int(self.table.nbytes)
        self.staged_at = time.monotonic()

    def takeable(self) -> bool:
        return self.held is None or not self.held()


def settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    """Resolve a write's future (once: a settled future is left as it is)."""
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
        # Marked as seen: the writes of a failed or stopped batch have nobody awaiting them
        # (those who await still get the error).
        fut.exception()


class StagingQueue:
    """The writes staged for one table, in staging order, and the events its committer and
    its writers wait on."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.items: deque[Staged] = deque()
        self.rows = 0
        self.nbytes = 0
        self.ready = asyncio.Event()  # set while writes are queued
        self.full = asyncio.Event()  # set once the queue holds a whole group (see pace)
        self.room = asyncio.Event()  # set while staging need not wait
        self.room.set()
        self.last_taken_at: float | None = None  # when the last group was taken
        self.converting = 0  # writes being checked and converted, about to be queued
        self.converted = asyncio.Event()  # set when the last of them is queued (or failed)

    def __bool__(self) -> bool:
        return bool(self.items)

    def put(self, staged: Staged) -> None:
        self.items.append(staged)
        self.rows += staged.rows
        self.nbytes += staged.nbytes
        self.ready.set()
        self.wake_if_whole()
        fault_point("staged")

    async def wait_for_room(self) -> None:
        """Wait while the queue is full, unless everything queued is held by running
        receivers: then nothing could make room until they return (the caller among them,
        perhaps)."""
        while self.rows >= self.settings.max_queued_rows and self.any_takeable():
            self.room.clear()
            await self.room.wait()

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Count a write being converted for the queue (see :meth:`gather`)."""
        self.converting += 1
        try:
            yield
        finally:
            self.converting -= 1
            if not self.converting:
                self.converted.set()

    async def gather(self) -> None:
        """Wait, up to ``GATHER_SECONDS``, for the writes being converted right now: a burst
        of batches (one per partition, as a client flushes them) wakes an idle committer with
        its first write, and would otherwise commit as a fragment of a group while the rest
        waits a whole commit for the next one. A lone batch waits for nothing."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(GATHER_SECONDS):
                while self.converting:
                    self.converted.clear()
                    await self.converted.wait()

    async def pace(self) -> None:
        """With ``min_commit_interval``: wait until that long after the last group was taken,
        unless a whole group is queued by then."""
        interval = self.settings.min_commit_interval
        if not interval or self.last_taken_at is None:
            return
        delay = self.last_taken_at + interval - time.monotonic()
        if delay <= 0 or self.holds_a_group():
            return
        self.full.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self.full.wait()

    def wake_if_whole(self) -> None:
        """Wake a committer waiting out ``min_commit_interval`` once the queue holds a whole
        group (a write was queued, or a receiver returned and its writes can be taken)."""
        if self.settings.min_commit_interval and self.holds_a_group():
            self.full.set()

    def holds_a_group(self) -> bool:
        """Whether the queue holds a whole group, or all it may hold (staging then waits), in
        writes that can be taken (not those of receivers still running)."""
        max_rows, max_bytes = self.settings.group_rows, self.settings.max_group_bytes
        if self.rows < max_rows and self.nbytes < max_bytes:
            return False
        takeable = [staged for staged in self.items if staged.takeable()]
        return (
            sum(staged.rows for staged in takeable) >= max_rows
            or sum(staged.nbytes for staged in takeable) >= max_bytes
        )

    def any_takeable(self) -> bool:
        return any(staged.takeable() for staged in self.items)

    def take(self) -> list[Staged]:
        """The next group: queued writes in staging order, up to the bounds, passing over the
        writes of receivers still running (they stay queued, in order)."""
        group: list[Staged] = []
        held: deque[Staged] = deque()
        rows = nbytes = 0
        max_rows, max_bytes = self.settings.max_group_rows, self.settings.max_group_bytes
        while self.items:
            staged = self.items[0]
            if not staged.takeable():
                held.append(self.items.popleft())
                continue
            if group and (rows + staged.rows > max_rows or nbytes + staged.nbytes > max_bytes):
                break
            group.append(self.items.popleft())
            rows += staged.rows
            nbytes += staged.nbytes
        held.extend(self.items)
        self.items = held
        self.rows -= rows
        self.nbytes -= nbytes
        self.last_taken_at = time.monotonic()
        for staged in group:
            staged.taken_at = self.last_taken_at
        if not self.items:
            self.ready.clear()
        if self.rows < self.settings.max_queued_rows or not self.any_takeable():
            self.room.set()
        return group
