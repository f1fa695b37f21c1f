"""A source database's change feed, to test and measure ``sequence_by`` tables: its history of
changes in commit order, the rows it ends with, and the same changes as several producers
deliver them (each one's share out of order, some late) or as Debezium events.

    feed = change_feed(keys=300, changes=3_000, deletes=0.05, seed=1)
    parts = feed.arrivals(producers=3, late=0.1, seed=2)   # three shuffled shares
    feed.final()                                           # {id: row} the table must hold
    feed.partial(seed=3).final_partial()                   # ... with partial updates

A change is a row ``{"id", "lsn", "name", "amount"}`` and its operation ``c`` (insert, also
after a delete), ``u`` (update) or ``d`` (delete); ``lsn`` is the commit order, 1, 2, ...
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..client.stream_types import Delete

__all__ = ["Change", "ChangeFeed", "change_feed"]


@dataclass(frozen=True, slots=True)
class Change:
    """One committed change: ``op`` (``c``, ``u`` or ``d``), the row after it (for ``d``, the
    row it deleted) and the row before it (None for ``c``)."""

    op: str
    row: dict[str, Any]
    before: dict[str, Any] | None

    @property
    def lsn(self) -> int:
        return int(self.row["lsn"])

    def as_item(self) -> Any:
        """What a stream of rows sends for it: the row, or a :class:`Delete` of its key (with
        its sequence)."""
        return Delete({"id": self.row["id"], "lsn": self.lsn}) if self.op == "d" else self.row

    def as_flat(self) -> dict[str, Any]:
        """The row with an ``op`` column (for :class:`deltaflow.Changelog`)."""
        return {**self.row, "op": self.op}

    def as_debezium(self) -> dict[str, Any]:
        """The Debezium event of it (Postgres: the ``lsn`` in the ``source`` block, not in the
        row)."""
        row = {k: v for k, v in self.row.items() if k != "lsn"}
        before = self.before and {k: v for k, v in self.before.items() if k != "lsn"}
        source = {"connector": "postgresql", "db": "shop", "table": "customers"}
        return {
            "before": before if self.op != "d" else row,
            "after": None if self.op == "d" else row,
            "op": self.op,
            "source": {**source, "lsn": self.lsn, "ts_ms": 1_700_000_000_000 + self.lsn},
            "ts_ms": 1_700_000_000_500 + self.lsn,
        }


@dataclass(frozen=True, slots=True)
class ChangeFeed:
    """A history of changes in commit (``lsn``) order."""

    changes: list[Change]

    def final(self) -> dict[int, dict[str, Any]]:
        """The rows the source database ends with, by id."""
        rows: dict[int, dict[str, Any]] = {}
        for change in self.changes:
            if change.op == "d":
                rows.pop(change.row["id"], None)
            else:
                rows[change.row["id"]] = change.row
        return rows

    def partial(self, keep: float = 0.5, seed: int = 0) -> ChangeFeed:
        """The same history with each update carrying only some of its columns, the key and
        ``lsn`` always, each other with probability ``keep``: partial updates, for tables
        created with ``merge="partial"``."""
        rng = random.Random(seed)
        return ChangeFeed(
            [
                change
                if change.op != "u"
                else Change(
                    "u",
                    {
                        k: v
                        for k, v in change.row.items()
                        if k in ("id", "lsn") or rng.random() < keep
                    },
                    change.before,
                )
                for change in self.changes
            ]
        )

    def final_partial(self) -> dict[int, dict[str, Any]]:
        """The rows a ``merge="partial"`` table ends with, in ``lsn`` order whatever the
        changes' order here: each change's non-null columns over the stored ones; a delete
        ends the row."""
        rows: dict[int, dict[str, Any]] = {}
        for change in sorted(self.changes, key=lambda c: c.lsn):
            key = change.row["id"]
            if change.op == "d":
                rows.pop(key, None)
                continue
            stored = rows.get(key, {})
            rows[key] = {**stored, **{c: v for c, v in change.row.items() if v is not None}}
        return rows

    def arrivals(
        self, producers: int = 3, late: float = 0.1, seed: int = 0, *, repeat: float = 0.0
    ) -> list[list[Change]]:
        """The changes split among ``producers``, each share in commit order except that a
        ``late`` share of the changes arrives later than the ones after it (up to a tenth of the
        share later), and a ``repeat`` share is delivered twice (a replay)."""
        rng = random.Random(seed)
        shares: list[list[tuple[float, Change]]] = [[] for _ in range(producers)]
        window = max(1, len(self.changes) // (10 * producers))
        for change in self.changes:
            for _ in range(2 if rng.random() < repeat else 1):
                share = shares[rng.randrange(producers)]
                delay = rng.randint(1, window) if rng.random() < late else 0
                share.append((len(share) + delay + rng.random() / 2, change))
        return [[c for _, c in sorted(share, key=lambda p: p[0])] for share in shares]


def change_feed(keys: int, changes: int, *, deletes: float = 0.01, seed: int = 0) -> ChangeFeed:
    """A random history of ``changes`` changes to ``keys`` rows: each picks a key, inserts it
    if absent, else deletes it (with probability ``deletes``) or updates it."""
    rng = random.Random(seed)
    live: dict[int, dict[str, Any]] = {}
    out: list[Change] = []
    for lsn in range(1, changes + 1):
        key = rng.randrange(keys)
        before = live.get(key)
        if before is not None and rng.random() < deletes:
            out.append(Change("d", {**before, "lsn": lsn}, before))
            del live[key]
            continue
        row = {"id": key, "lsn": lsn, "name": f"k{key}-v{lsn}", "amount": rng.randrange(10_000)}
        out.append(Change("c" if before is None else "u", row, before))
        live[key] = row
    return ChangeFeed(out)


def items(changes: list[Change]) -> Iterator[Any]:
    """The stream items of ``changes`` (rows and deletes)."""
    return (c.as_item() for c in changes)
