"""The stream's account of every item that did not land, and how far the source may commit.

A stream hands each source item to exactly one batch. A batch ends acknowledged, or failed,
or (when the stream is cancelled) in doubt; items never put in a batch end as leftovers. The
:class:`Ledger` records the failed and in-doubt ones with their source positions and reasons,
and builds the error a failed stream raises: ``failed_items`` is exactly what it recorded,
in source order. The :class:`Watermark` tracks the contiguous prefix of settled positions.

Everything here is synchronous and knows nothing of the network.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from ..errors import (
    DataStreamerError,
    FailedItem,
    ServerError,
    StreamUsageError,
    TableSettingsError,
)

__all__ = ["CommitPosition", "Ledger", "Watermark", "locate"]

#: How a node names an item of a batch in an error; the client names its source position.
_ITEM_OF_BATCH: Final = re.compile(r"item #\d+ of the batch")


@dataclass(frozen=True, slots=True)
class CommitPosition:
    """How far an upstream source may be committed: every source item before ``count`` is
    settled (applied, dead-lettered or dropped), and ``last`` is the item at ``count - 1``.

    Items are acknowledged out of order (partitions progress independently); this position only
    moves over a contiguous prefix, so committing it (a Kafka offset taken from ``last``) can
    never skip an item that is not applied yet.
    """

    count: int
    last: Any


class Watermark:
    """Tracks the contiguous prefix of settled source positions."""

    def __init__(self) -> None:
        self.count = 0
        self._settled: dict[int, Any] = {}

    def settle(self, positions: Sequence[int], items: Sequence[Any]) -> CommitPosition | None:
        """Settle items; the new position if the prefix grew (None if it did not)."""
        self._settled.update(zip(positions, items, strict=True))
        before, last = self.count, None
        while self.count in self._settled:
            last = self._settled.pop(self.count)
            self.count += 1
        return CommitPosition(self.count, last) if self.count > before else None


class Ledger:
    """The items of one stream that were not applied (failed) or may not have been (in
    doubt), each with its source position; failed ones with a reason."""

    def __init__(self) -> None:
        # A None reason is filled in by raise_outcome(): the item was never sent, or was in a
        # batch that could not be, when the stream stopped.
        self._failed: list[tuple[int, Any, str | None]] = []
        self._in_doubt: list[tuple[int, Any]] = []

    def __len__(self) -> int:
        """Items recorded as failed so far."""
        return len(self._failed)

    def fail(
        self,
        positions: Sequence[int],
        items: Sequence[Any],
        reasons: Sequence[str | None] | None = None,
    ) -> None:
        """Record items as not applied (``reasons``: one per item, or None for "never sent")."""
        if reasons is None:
            self._failed.extend((p, item, None) for p, item in zip(positions, items, strict=True))
        else:
            self._failed.extend(zip(positions, items, reasons, strict=True))

    def doubt(self, positions: Sequence[int], items: Sequence[Any]) -> None:
        """Record items whose batch was sent but whose ack did not come (a cancelled stream)."""
        self._in_doubt.extend(zip(positions, items, strict=True))

    def raise_outcome(self, cause: BaseException, *, sid: str, applied: int) -> NoReturn:
        """Raise what a stream stopped by ``cause`` ends with.

        A cancellation stays the ``CancelledError``, carrying ``applied``, ``not_applied`` and
        ``in_doubt``; anything else becomes a :class:`DataStreamerError` whose
        ``failed_items`` (and ``failures``) are exactly the recorded items, in source order.
        """
        self._failed.sort(key=lambda entry: entry[0])
        self._in_doubt.sort(key=lambda pair: pair[0])
        if isinstance(cause, asyncio.CancelledError):
            cause.not_applied = [item for _, item, _ in self._failed]  # type: ignore[attr-defined]
            cause.in_doubt = [item for _, item in self._in_doubt]  # type: ignore[attr-defined]
            cause.applied = applied  # type: ignore[attr-defined]
            raise cause
        stopped = f"not applied: the stream stopped before it was sent ({cause})"
        failures = [FailedItem(p, item, why or stopped) for p, item, why in self._failed]
        # A table stream whose arguments do not match the table: the caller's mistake.
        kind = StreamUsageError if isinstance(cause, TableSettingsError) else DataStreamerError
        raise kind(
            f"stream {sid} failed: {cause}; {len(failures)} item(s) not applied "
            f"({applied} applied)",
            [f.item for f in failures],
            cause,
            failures,
        ) from cause


def locate(
    exc: BaseException,
    items: Sequence[Any],
    positions: Sequence[int],
    *,
    partition: int,
    key_of: Callable[[Any], Any],
) -> tuple[BaseException, list[str]]:
    """A failed batch's error with the item a node named by its index in the batch ("item #3
    of the batch") named by its source position and key instead, and each item's reason: its
    own error for that item, the batch's refusal for the others."""
    item = exc.details.get("item") if isinstance(exc, ServerError) else None
    if not (isinstance(item, int) and not isinstance(item, bool) and 0 <= item < len(items)):
        return exc, [str(exc)] * len(items)
    assert isinstance(exc, ServerError)
    position = positions[item]
    where = f"source item #{position} (key {key_of(items[item])!r})"
    text, n = _ITEM_OF_BATCH.subn(where, str(exc.args[0]), count=1)
    located = type(exc)(
        text if n else f"{where}: {text}",
        node=exc.node,
        details={**exc.details, "position": position},
        retriable=exc.retriable,
    )
    others = f"not applied: its batch (partition {partition}) was refused: {located}"
    reasons = [others] * len(items)
    reasons[item] = str(located)
    return located, reasons
