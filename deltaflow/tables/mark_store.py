"""A node's lane marks of one table (:class:`MarkStore`), shared by its readers of the log,
and how long a lane's mark is kept (:class:`MarkRetention`). See :mod:`.marks`."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from ..protocol import RANDOM_LANE_PREFIX
from ..storage.paths import Location

__all__ = [
    "DEFAULT_LANE_RETENTION",
    "DEFAULT_RANDOM_RETENTION",
    "FORGET_PER_COMMIT",
    "MINUTES",
    "MarkRetention",
    "MarkStore",
    "MarkStores",
    "minute_of",
]

#: A lane's kept mark packs its ``txn`` version above the minute it was last marked in.
MINUTE_BITS: Final = 32
MINUTES: Final = (1 << MINUTE_BITS) - 1
#: Seconds a lane forgotten for good (a closed stream of a random id) is not kept again when
#: a reader of the node reads one of its commits late.
FORGOTTEN_SECONDS: Final = 120.0
#: Most lanes one commit forgets in the table's log.
FORGET_PER_COMMIT: Final = 2_000
#: Seconds a table's lanes are kept by default (``delta.setTransactionRetentionDuration``).
DEFAULT_LANE_RETENTION: Final = 7 * 86_400
#: Seconds the lanes of a stream with a random id are kept (``random_marks_seconds``).
DEFAULT_RANDOM_RETENTION: Final = 3600


@dataclass(frozen=True, slots=True)
class MarkRetention:
    """How long a node keeps a lane's mark after the lane's last commit, in seconds: a
    stream's (``durable``, the table's txn retention) and a random id's (``random``)."""

    durable: float = DEFAULT_LANE_RETENTION
    random: float = DEFAULT_RANDOM_RETENTION

    def of(self, lane: str) -> float:
        return self.random if lane.startswith(RANDOM_LANE_PREFIX) else self.durable

    @classmethod
    def of_table(cls, properties: Mapping[str, str], random: float) -> MarkRetention:
        """A table's: its ``delta.setTransactionRetentionDuration`` (none: no end) and
        ``random``."""
        from .sequence import parse_interval

        configured = properties.get("delta.setTransactionRetentionDuration")
        try:
            durable = float(parse_interval(configured)) if configured else float("inf")
        except ValueError:
            durable = DEFAULT_LANE_RETENTION
        return cls(durable, random)


def minute_of(ms: float) -> int:
    """The minute of the epoch at ``ms`` milliseconds (capped to what a mark packs)."""
    return min(int(ms // 60_000), MINUTES)


class MarkStore:
    """One table's lane marks on a node: the highest ``txn`` version per lane, packed above the
    minute it was last marked in. Shared by the node's readers of the table's log (the owner's
    side and the committer), so a lane costs one entry per node, and a checkpoint's ``txn``
    actions are read once. Safe across threads: a mark only rises (every reader adds the marks
    of commits that landed), under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._marks: dict[str, int] = {}
        #: Lanes forgotten for good (see :meth:`forget`) and when, the oldest first.
        self._forgotten: dict[str, float] = {}
        #: Those of them whose ``txn`` the table's log still keeps (see :meth:`forget`).
        self._unlogged: dict[str, None] = {}
        #: The version of the checkpoint whose ``txn`` actions, carrying every lane's mark,
        #: were read in (-1: none).
        self.checkpoint = -1
        #: The version through which a reader of the table (its marks all carried) has read
        #: every commit into this store: a newer checkpoint up to it adds no mark (-1: none).
        self.through = -1

    def __len__(self) -> int:
        return len(self._marks)

    def lanes(self) -> list[str]:
        """The lanes whose marks are held."""
        return list(self._marks)

    def forgotten(self) -> int:
        """Lanes forgotten for good in the last :data:`FORGOTTEN_SECONDS`."""
        return len(self._forgotten)

    def __contains__(self, lane: object) -> bool:
        return lane in self._marks

    def applied(self, lane: str, version: int) -> bool:
        """Whether the mark of ``txn`` version ``version`` of ``lane`` is held."""
        held = self._marks.get(lane)
        return held is not None and version <= held >> MINUTE_BITS

    def keep(self, marks: Iterable[tuple[str, int, int]]) -> None:
        """Hold each (lane, ``txn`` version, minute) unless a higher mark is held; the lane's
        minute moves to the latest."""
        with self._lock:
            self._keep(marks)

    def _keep(self, marks: Iterable[tuple[str, int, int]]) -> None:
        held_marks, forgotten = self._marks, self._forgotten
        for lane, version, minute in marks:
            if forgotten and lane in forgotten:
                continue
            held = held_marks.get(lane)
            if held is None or version >= held >> MINUTE_BITS:
                held_marks[lane] = version << MINUTE_BITS | minute
            elif minute > held & MINUTES:
                held_marks[lane] = held & ~MINUTES | minute

    def load(self, lanes: list[str], versions: list[int], minutes: list[int]) -> None:
        """:meth:`keep` of a checkpoint's marks (one per lane): into an empty store at once."""
        with self._lock:
            if self._marks or self._forgotten:
                self._keep(zip(lanes, versions, minutes, strict=True))
            else:
                packed = [v << MINUTE_BITS | m for v, m in zip(versions, minutes, strict=True)]
                self._marks = dict(zip(lanes, packed, strict=True))

    def forget(
        self, lanes: Iterable[str], now: float | None = None, *, logged: bool = False
    ) -> None:
        """Drop the marks of ``lanes``, for good: a reader that reads one of their commits
        within :data:`FORGOTTEN_SECONDS` does not keep its mark again (the commit that
        answered a stream's last batch may be read by this node's other reader of the table
        after the stream closed). Until a commit forgets them in the log too (``logged``: one
        was read), :meth:`unlogged` lists them for the next commits, for as long: a table
        with no commit meanwhile keeps their ``txn`` for its retention."""
        now = time.monotonic() if now is None else now
        with self._lock:
            unlogged = self._unlogged
            for lane in lanes:
                self._marks.pop(lane, None)
                self._forgotten.pop(lane, None)
                self._forgotten[lane] = now  # in the order forgotten
                if logged:
                    unlogged.pop(lane, None)
                else:
                    unlogged[lane] = None
            self._prune(now)

    def unlogged(self) -> list[str]:
        """The first :data:`FORGET_PER_COMMIT` lanes forgotten here that the table's log still
        keeps: the next commit's to forget there as well."""
        with self._lock:
            self._prune(time.monotonic())
            return list(itertools.islice(self._unlogged, FORGET_PER_COMMIT))

    def _prune(self, now: float) -> None:
        forgotten = self._forgotten
        while forgotten:
            lane, at = next(iter(forgotten.items()))
            if now - at <= FORGOTTEN_SECONDS:
                break
            del forgotten[lane]
            self._unlogged.pop(lane, None)

    def expire(self, now: int, retention: MarkRetention) -> None:
        """Forget the lanes idle for longer than their retention at minute ``now``."""
        random, durable = retention.random / 60, retention.durable / 60
        prefix = RANDOM_LANE_PREFIX
        with self._lock:
            self._prune(time.monotonic())
            kept = {
                lane: held
                for lane, held in self._marks.items()
                if now - (held & MINUTES) <= (random if lane.startswith(prefix) else durable)
            }
            if len(kept) < len(self._marks):
                self._marks = kept  # a new dict: a smaller table, not one with holes


class MarkStores:
    """The node's :class:`MarkStore` per table path."""

    def __init__(self) -> None:
        self._stores: dict[Location, MarkStore] = {}
        self._lock = threading.Lock()

    def get(self, path: Location) -> MarkStore | None:
        """The table's store, if one was made."""
        return self._stores.get(path)

    def of(self, path: Location) -> MarkStore:
        with self._lock:
            store = self._stores.get(path)
            if store is None:
                store = self._stores[path] = MarkStore()
            return store
