"""Lanes: the ordering state of one (stream, partition) on a node, and the rules that move it.

A lane applies its batches strictly in sequence order: ``next_seq`` is the batch it runs next,
``pending`` holds batches that arrived early, ``committing`` those applied and not yet durable,
``staged`` their table writes, ``results`` what recent batches produced (replayed to a
resend). A batch that fails for good fails the lane at ``failed_at``: from there on batches are
refused until the client's ``base`` passes it. A lane takes only batches inside its window
(:func:`in_window`), so no more than ``LANE_WINDOW`` wait. The dispatcher runs the lanes;
everything here is synchronous.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from ..errors import LaneFailedError, ServerError
from ..protocol import LANE_WINDOW, Frame

__all__ = ["LANE_WINDOW", "RESULT_REPLAY_BATCHES", "Lane", "Peer", "in_window"]
#: Most batches per lane whose results are kept for replay to a resend. Results are dropped as
#: soon as the client's ``base`` passes their batch, which the window keeps within
#: ``LANE_WINDOW`` of the latest: a second bound, for memory's sake.
RESULT_REPLAY_BATCHES: Final = 1024


def in_window(seq: int, base: int) -> bool:
    """Whether a lane takes batch ``seq`` sent with ``base``: ``base`` is the client's lowest
    batch of the lane not yet settled, so at most ``seq``, and the deltaflow client sends no
    batch ``LANE_WINDOW`` or more past it. A batch outside moves nothing."""
    return 0 <= base <= seq < base + LANE_WINDOW


class Peer(Protocol):
    """A client connection as the dispatcher sees it."""

    async def send(self, frame: Frame) -> None: ...

    def send_nowait(self, frame: Frame) -> bool:
        """Queue ``frame`` without waiting; False if the peer is backed up (then ``send``)."""
        ...


@dataclass(slots=True)
class Lane:
    next_seq: int = 0
    pending: dict[int, tuple[Peer, Frame]] = field(default_factory=dict)
    committing: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    # Table writes each applied batch staged, until they are durable: a failed one makes the
    # writes of later batches of the lane abandoned at once, before any of them commits.
    staged: dict[int, list[asyncio.Future[None]]] = field(default_factory=dict)
    # Results of the latest batches, replayed when a batch is resent after a lost ack.
    # Each: (results produced, items the receiver marked failed by index).
    results: OrderedDict[int, tuple[list[Any], dict[int, str]]] = field(default_factory=OrderedDict)
    failed_at: int | None = None
    failure: ServerError | None = None
    task: asyncio.Task[None] | None = None
    watcher: asyncio.TimerHandle | None = None  # see watch()
    receiver_name: str | None = None  # the stream's receiver, for its counters

    def waits(self) -> bool:
        """Batches wait here for ``next_seq``, which has not arrived: nothing runs."""
        return (
            self.task is None
            and self.failure is None
            and bool(self.pending)
            and self.next_seq not in self.pending
        )

    def watch(self, after: float, report: Callable[[Lane, float], None]) -> None:
        """Call ``report(lane, seconds)`` if the lane still waits for the same batch ``after``
        seconds from now: one timer per wait, not per batch, and one report per wait."""
        if self.watcher is None and self.waits():
            loop = asyncio.get_running_loop()
            self.watcher = loop.call_later(
                after, self._watched, after, report, self.next_seq, loop.time()
            )

    def _watched(
        self, after: float, report: Callable[[Lane, float], None], awaited: int, since: float
    ) -> None:
        self.watcher = None
        if self.waits():
            if self.next_seq == awaited:
                report(self, asyncio.get_running_loop().time() - since)
            else:  # it went on, and now waits for a later batch
                self.watch(after, report)

    def reopen_past(self, base: int) -> None:
        """The client settled the failed batch another way (dead-letter table, or dropped):
        nothing before ``base`` is pending any more, so the lane may go on from there."""
        if self.failed_at is not None and base > self.failed_at:
            self.failed_at = self.failure = None

    def refusal(self, seq: int, node: str, p: int) -> ServerError | None:
        """What a failed lane answers batch ``seq`` (the failed batch gets its own error), or
        None if the lane takes it."""
        if self.failed_at is None or seq < self.failed_at:
            return None
        err = self.failure if seq == self.failed_at else None
        return err or self.failed_error(node, p)

    def start_at(self, base: int) -> None:
        """The client has every batch below ``base`` acknowledged (by this node before, or by a
        previous owner): forget their results, and start the lane there instead of waiting."""
        while self.results and next(iter(self.results)) < base:
            self.results.popitem(last=False)
        if base > self.next_seq:
            self.next_seq = base
            for stale in [s for s in self.pending if s < base]:
                del self.pending[stale]

    def is_duplicate(self, seq: int) -> bool:
        """Batch ``seq`` was applied already, or is being committed."""
        return seq < self.next_seq or seq in self.committing

    def keep_results(self, seq: int, produced: list[Any], failed: dict[int, str]) -> None:
        """Keep what batch ``seq`` produces (filled in as it runs) for a resend of it."""
        self.results[seq] = (produced, failed)
        while len(self.results) > RESULT_REPLAY_BATCHES:
            self.results.popitem(last=False)

    def abandons(self, seq: int) -> bool:
        """Whether the writes of batch ``seq`` must not land: a batch before it in the lane
        failed, or a write an earlier batch staged failed to commit."""
        if self.failed_at is not None and seq > self.failed_at:
            return True
        return any(
            earlier < seq and any(f.done() and f.exception() is not None for f in futures)
            for earlier, futures in self.staged.items()
        )

    def fail(self, seq: int, err: ServerError) -> None:
        """Batch ``seq`` failed for good: close the lane there. Resending its batches cannot
        succeed until the client settles the failed one (a later ``base`` past it reopens the
        lane); nothing from ``seq`` on counts as applied."""
        if self.failed_at is None or seq < self.failed_at:
            self.failed_at, self.failure = seq, err
            self.next_seq = min(self.next_seq, seq)
            for later in [s for s in self.results if s >= seq]:
                del self.results[later]

    def take_pending(self) -> list[tuple[int, Peer, Frame]]:
        """Remove the waiting batches, in sequence order, to answer them."""
        return [(seq, *self.pending.pop(seq)) for seq in sorted(self.pending)]

    def failed_error(self, node: str, p: int) -> LaneFailedError:
        return LaneFailedError(
            f"not applied: batch {self.failed_at} of partition {p} failed earlier "
            f"({self.failure}), so later batches of the partition are refused to keep per-key "
            "order",
            node=node,
        )
