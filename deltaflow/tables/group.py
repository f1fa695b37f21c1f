"""A group of staged writes on its way to a commit: prepared before the table is held, and
handed to the engine as one typed write."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..storage.paths import Location
from .data_files import DataFile
from .footprint import Footprint
from .merging import LAST, MergeRule
from .settings import TableSettings

__all__ = ["GroupWrite", "PreparedGroup"]


@dataclass(frozen=True, slots=True)
class GroupWrite:
    """A group ready to be applied to an existing table in one commit
    (:meth:`.TableEngine.write`).

    Attributes:
        table: the table's name (for errors and logs).
        path: where the table is.
        key: merge key columns, or empty to append.
        data: a pyarrow Table with exactly the table's columns (the bucket column included),
            plus the ``DELETE_COLUMN`` flag; at most one row per key.
        metadata: the commit's ``userMetadata`` (lane marks): it must land in the same commit
            as the data.
        footprint: for a merge, where ``data``'s keys can be in the table; the MERGE names it
            (:meth:`.Footprint.merge_condition`) so it reads and rewrites no other files. Its
            ``files`` lists the live files that may hold one of the keys (when the key has
            ranges). None to append the rows that are not deletes instead: the table has no
            key, or holds none of the group's keys.
        written: the group's rows that are not deletes, already written as data files
            (:func:`.write_group`), when the engine said the table is applied by merge-on-read:
            the commit adds them instead of writing the rows again. An engine that applies the
            group another way leaves them unreferenced (``deltaflow table vacuum`` deletes
            them).
        read_version: when set (commits without a lock, on an object store), the table
            version whose lane marks the group was checked against: the engine commits at
            exactly the next version, or raises ``CommitConflictError`` so the committer
            checks again (a commit rebased over another writer's could apply a batch twice).
        sequence: the table's sequence columns (``sequence_by``; :mod:`.sequence`): a row of
            ``data`` replaces or deletes a stored row only if its sequence is greater. Empty:
            every row does.
        rule: the table's merge mode (:mod:`.merging`): how a row of ``data`` merges with the
            stored row of its key.
        transactions: the commit's Delta ``txn`` actions (``{"txn": {...}}``): the lane marks
            where a checkpoint keeps them (:meth:`.LaneMarks.carrying`); they must land in the
            same commit as the data, or in the next one (an engine that cannot add them).
    """

    table: str
    path: Location
    key: list[str]
    data: Any
    metadata: str
    footprint: Footprint | None = None
    written: list[tuple[DataFile, Any]] | None = None
    read_version: int | None = None
    sequence: tuple[str, ...] = ()
    rule: MergeRule = LAST
    transactions: list[dict[str, Any]] = field(default_factory=list)

    def app_transactions(self) -> list[Any]:
        """:attr:`transactions` as delta-rs takes them (``CommitProperties``)."""
        from deltalake import Transaction

        return [
            Transaction(t["appId"], t["version"], t["lastUpdated"])
            for t in (a["txn"] for a in self.transactions)
        ]


@dataclass(frozen=True, slots=True)
class PreparedGroup:
    """A group made ready for its commit before the commit atomicity is held.

    Attributes:
        batches: how many writes the group had (a commit of fewer, some dropped as abandoned
            or already applied, prepares again).
        data: the group's rows as the commit applies them: one row per key (the last),
            conformed to the table's schema as read into ``settings`` and ``schema``.
        settings: the table's settings the rows were conformed to (the same object, or the
            table changed meanwhile and the group is prepared again while held).
        schema: the data columns the rows were conformed to (the same object, likewise).
        written: for merge-on-read, the group's new rows already written as data files, one
            per bucket (file, rows); None when the engine writes them in the commit.
        seconds: how long the preparation took (part of the commit time).
        footprint: where the group's keys can be (:meth:`.Footprint.of`, ranges cut from
            ``data``), checked against the live files while held.
    """

    batches: int
    data: Any
    settings: TableSettings
    schema: Any
    written: list[tuple[DataFile, Any]] | None
    seconds: float
    footprint: Footprint
