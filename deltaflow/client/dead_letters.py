"""The dead-letter policy (``on_failure="fallback"``): a failed batch's items, each with its
error, go to the dead-letter table through a sender of their own, and count as settled once
written there."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..protocol import pack_item
from .accumulator import Batch
from .ledger import Ledger
from .options import StreamerOptions
from .sender import Sender, StreamStoppedError
from .stream_keys import stream_key
from .stream_types import DEAD_LETTER_RECEIVER

if TYPE_CHECKING:
    from .router import Routes

__all__ = ["DeadLetters"]


class DeadLetters:
    """The dead letters of one stream, sent as a stream of their own (id ``<sid>-dl-<random>``)
    to the built-in ``DeadLetter`` receiver. The sender is made on the first dead letter.

    Args:
        routes: how the dead-letter sender reaches partition owners.
        sid: the id of the stream whose items these are.
        options: the stream's options (the dead-letter sender fails rather than falling back).
        ledger: the stream's ledger: items whose dead-letter write failed are recorded there.
        settle: called with each batch once written to the dead-letter table.
        stop: called with the error when a dead-letter write fails: it fails the stream.

    Attributes:
        sid: the dead-letter stream's id.
        count: items written to the dead-letter table.
        unrouted: those of them the client could not route (never sent to their table).
    """

    def __init__(
        self,
        routes: Routes,
        *,
        sid: str,
        options: StreamerOptions,
        ledger: Ledger,
        settle: Callable[[Batch], None],
        stop: Callable[[BaseException], None],
    ) -> None:
        self._routes = routes
        self._stream_sid = sid
        # Unique per run: a replay under the same stream id must not have its dead letters
        # skipped as already applied (their batches differ from the first run's).
        self.sid = f"{sid}-dl-{uuid.uuid4().hex[:12]}"
        self._options = options
        self.ledger = ledger
        self._settle = settle
        self._stop = stop
        self._sender: Sender | None = None
        self._seq: dict[int, int] = {}
        self.count = 0
        self.unrouted = 0

    @property
    def started(self) -> bool:
        """Whether any batch was sent to the dead-letter table."""
        return self._sender is not None

    @property
    def has_room(self) -> bool:
        """Whether the dead-letter sender's window has room (a stream waits for it too, so
        rows it sets aside cannot pile up faster than they are written)."""
        return self._sender is None or self._sender.has_room

    async def wait_for_room(self) -> None:
        if self._sender is not None:
            await self._sender.wait_for_room()

    async def join(self) -> None:
        """Wait until every dead letter is written or failed."""
        if self._sender is not None:
            await self._sender.join()

    async def cancel(self) -> None:
        """Settle every dead letter still under way as cancelled (see :meth:`Sender.cancel`)."""
        if self._sender is not None:
            await self._sender.cancel()

    def send(
        self,
        batch: Batch,
        exc: BaseException,
        reasons: list[str] | None = None,
        *,
        routed: bool = True,
    ) -> None:
        """Send a failed batch's items, with its error, to the dead-letter table; items the
        client could not route (``routed=False``) get ``partition`` and ``seq`` -1."""
        if self._sender is None:
            self._sender = Sender(
                self._routes,
                sid=self.sid,
                key=stream_key(None, None, token=None),  # random, as its id
                receiver=(
                    DEAD_LETTER_RECEIVER,
                    {"table": self._options.dead_letter_table, "stream": self._stream_sid},
                ),
                options=dataclasses.replace(self._options, on_failure="fail"),
                on_acked=self._acked,
                on_failed=self._failed,
                results=None,
                random=True,
            )
        code = getattr(exc, "code", type(exc).__name__)
        rows = [
            {
                "position": pos,
                "partition": batch.partition if routed else -1,
                "seq": batch.seq if routed else -1,
                "error_code": str(code),
                "error": (reasons[i] if reasons is not None else str(exc))[:2000],
                "node": getattr(exc, "node", None),
                "payload": packed,
                "deleted": i in batch.deletes,
            }
            for i, (pos, packed) in enumerate(
                zip(batch.positions, batch.packed_items(), strict=True)
            )
        ]
        seq = self._seq.get(batch.partition, 0)
        self._seq[batch.partition] = seq + 1
        dead = Batch(
            batch.partition,
            seq,
            # An Arrow page's rows as dicts: the dead letters travel packed, never as the page.
            items=list(batch.items),
            positions=batch.positions,
            packed=[pack_item(r) for r in rows],
        )
        dead.nbytes = sum(len(x) for x in dead.packed)
        dead.unrouted = not routed
        self._sender.submit(dead)

    def _acked(self, batch: Batch) -> None:
        self.count += len(batch.items)
        if batch.unrouted:
            self.unrouted += len(batch.items)
        self._settle(batch)

    def _failed(self, batch: Batch, exc: BaseException) -> None:
        stopping = isinstance(exc, (asyncio.CancelledError, StreamStoppedError))
        reason = None if stopping else f"its write to the dead-letter table failed: {exc}"
        self.ledger.fail(batch.positions, batch.items, [reason] * len(batch.items))
        if not stopping:
            self._stop(exc)
