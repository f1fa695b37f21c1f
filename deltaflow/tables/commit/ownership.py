"""Which groups of other nodes a table's committer takes: those whose writer owns, in a map
the committer held of late (:class:`Ownership`), the partition of every lane the group marks
and a partition placed in the bucket of every file it adds or removes (:func:`foreign`).
What cannot be checked (a file outside the bucket layout, a lane without a partition) is
refused too."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from ..settings import BUCKET_COLUMN, TableSettings
from .prepared import Outcome

if TYPE_CHECKING:
    from ...partitioning import PartitionMap
    from .prepared import PreparedCommit

__all__ = ["NotOwned", "Ownership", "foreign"]

#: A data file's bucket directory, as the writers name it.
_BUCKET_DIR: Final = re.compile(rf"{BUCKET_COLUMN}=(0|[1-9][0-9]*)/")
#: A lane's partition: the number after its last ``/`` (``stream/[owner/]partition``).
_LANE_PARTITION: Final = re.compile(r".*/(0|[1-9][0-9]{0,5})")


@dataclass(frozen=True, slots=True)
class NotOwned(Outcome):
    """A ``retry``: the group names a lane or a file outside its writer's partitions in the
    maps the committer holds (of version ``map_version`` when checked)."""

    map_version: int = 0


class Ownership:
    """Which partitions each node owns, by the maps this committer held in the last ``grace``
    seconds: a writer's group prepared just before its partition moved is still its own.

    Args:
        current: the committer's map now.
        grace: seconds a replaced map still counts.
        wait: seconds a refused group waits for the committer's map to change before it is
            answered (the writer's map may be newer).
    """

    def __init__(
        self,
        current: Callable[[], PartitionMap],
        *,
        grace: float,
        wait: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._current = current
        self.grace = grace
        self.wait = wait
        self._clock = clock
        self._last = current()
        self._replaced: deque[tuple[float, PartitionMap]] = deque(maxlen=64)
        self._changed = asyncio.Event()

    def moved(self, new: PartitionMap) -> None:
        """The committer's map changed to ``new`` (call it on every change)."""
        if new.version == self._last.version:
            return
        self._replaced.append((self._clock(), self._last))
        self._last = new
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def maps(self) -> tuple[PartitionMap, ...]:
        """The current map, then the ones replaced within ``grace`` seconds."""
        self.moved(self._current())  # a change not told (yet) counts as well
        now = self._clock()
        return (self._last, *(m for at, m in reversed(self._replaced) if now - at <= self.grace))

    async def changed_since(self, version: int, timeout: float) -> bool:
        """Whether the map is not of ``version`` any more, waiting up to ``timeout`` s."""
        self.moved(self._current())
        if self._last.version != version:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(timeout, 0.0)):
                await self._changed.wait()
                return True
        return False


def _owned(writer: str, maps: Sequence[PartitionMap]) -> set[int]:
    return {p for m in maps for p, owner in enumerate(m.owners) if owner == writer}


def owned_lanes(lanes: Iterable[str], writer: str, maps: Sequence[PartitionMap]) -> list[str]:
    """Those of ``lanes`` in a partition ``writer`` owns in one of ``maps``."""
    owned = _owned(writer, maps)
    found = (_LANE_PARTITION.fullmatch(lane) for lane in lanes)
    return [f[0] for f in found if f is not None and int(f[1]) in owned]


def foreign(
    prepared: PreparedCommit, maps: Sequence[PartitionMap], layout: TableSettings | None
) -> str | None:
    """Why ``prepared`` names a lane or a file outside the partitions its writer owns in
    ``maps`` (or one this cannot tell of); None when it does not. ``layout``: the table's."""
    writer = prepared.writer
    owned = _owned(writer, maps)
    partitions = maps[0].partitions
    for lane in prepared.lanes:
        found = _LANE_PARTITION.fullmatch(lane)
        if found is None or int(found[1]) >= partitions:
            return f"lane {lane!r} names no partition of this cluster's {partitions}"
        if int(found[1]) not in owned:
            return f"node {writer} does not own partition {found[1]} (lane {lane!r})"
    if layout is None:
        return "the committer cannot read the table's layout"
    buckets = _buckets(layout, owned, partitions) if layout.buckets else None
    for action in prepared.actions:
        [(kind, body)] = action.items()
        path = body["path"]
        found = _BUCKET_DIR.match(path)
        if buckets is None:
            # Without buckets every file may hold keys of every partition: the table is one
            # bucket that holds them all, any owner's to write.
            if found is not None:
                return f"{kind} {path!r}: a bucket directory in a table without buckets"
            if not owned:
                return f"{kind} {path!r}: node {writer} owns no partition"
            continue
        if found is None:
            return f"{kind} {path!r}: a file outside the table's bucket directories"
        if int(found[1]) not in buckets:
            return f"{kind} {path!r}: bucket {found[1]} holds no partition of node {writer}"
        values = body.get("partitionValues")
        if kind == "add" and values != {BUCKET_COLUMN: found[1]}:
            return f"add {path!r}: its partition values are not its directory's bucket"
    return None


def _buckets(layout: TableSettings, owned: Iterable[int], partitions: int) -> frozenset[int]:
    """The bucket values (every level) that hold keys of a partition in ``owned``."""
    count = layout.buckets
    # Key k is in partition crc(k) % partitions and bucket crc(k) % count: a partition and
    # a bucket share keys when they agree modulo the greatest common divisor.
    common = math.gcd(count, partitions)
    residues = {p % common for p in owned}
    tops = [b for b in range(count) if b % common in residues]
    levels = layout.levels
    if levels is None:
        return frozenset(tops)
    return frozenset(
        (1 << (size - 1).bit_length()) + b % size for size in levels.sizes for b in tops
    )
