"""Slowly changing dimensions, type 2: a table that keeps every version of a key.

A table created with ``history="scd2"`` (``deltaflow.history``; it needs a one-column
``sequence_by``) holds one row per version of a key: the columns as a change left them, and
:data:`START` and :data:`END` (``__start_at``, ``__end_at``, of the sequence's type): the
sequence of the change that opened the version and of the one that closed it (null on the
current row). Every change of a key closes its current row and opens a new one; a delete
closes it and opens none. With ``track_history_on`` (``deltaflow.trackHistoryOn``) only a
change of those columns opens a new version: a change of the others updates the current
row in place.

Changes that arrive late are slotted into the history in sequence order: a group's changes
and the stored versions of its keys are read back as events (each version's start an upsert;
an end no version starts at, a delete), merged, and the key's history is rebuilt
(:func:`rebuild`); the stored versions are replaced by the rebuilt ones in the group's commit.
A change of a sequence the history holds already (a replay) changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from ..columnar import DELETE_COLUMN

__all__ = ["END", "HISTORY_MODES", "START", "as_group_rows", "rebuild", "with_history_columns"]

START: Final = "__start_at"
END: Final = "__end_at"
HISTORY_MODES: Final = ("none", "scd2")


def with_history_columns(schema: Any, sequence: str) -> Any:
    """``schema`` with :data:`START` and :data:`END` of the type of column ``sequence``."""
    import pyarrow as pa

    kind = schema.field(sequence).type
    return schema.append(pa.field(START, kind)).append(pa.field(END, kind))


def rebuild(
    events: Any,
    stored: Any,
    key: str,
    sequence: str,
    tracked: Sequence[str] | None,
) -> Any:
    """The versions of the keys of ``events`` (a group's changes: rows with the table's
    columns and ``DELETE_COLUMN``, any number per key) given their ``stored`` versions (rows
    of the table's columns with :data:`START` and :data:`END`; every version of those keys),
    as rows with ``stored``'s columns.

    Args:
        tracked: the columns whose change opens a version (None: every change does).
    """
    import pyarrow as pa

    columns = [c for c in stored.schema.names if c not in (START, END)]
    histories: dict[Any, list[tuple[Any, int, dict[str, Any] | None]]] = {}
    # The stored versions as events: a start is an upsert; an end that no version of the
    # key starts at is a delete.
    starts: dict[Any, set[Any]] = {}
    for row in stored.to_pylist():
        starts.setdefault(row[key], set()).add(row[START])
    for row in stored.to_pylist():
        k = row[key]
        version: dict[str, Any] | None = {c: row[c] for c in columns}
        histories.setdefault(k, []).append((row[START], 0, version))
        if row[END] is not None and row[END] not in starts[k]:
            histories[k].append((row[END], 0, None))
    # The group's changes, after the stored ones of the same sequence (which win: a replay).
    for n, row in enumerate(events.to_pylist()):
        values = None if row[DELETE_COLUMN] else {c: row.get(c) for c in columns}
        histories.setdefault(row[key], []).append((row[sequence], 1 + n, values))
    out: list[dict[str, Any]] = []
    for history in histories.values():
        out.extend(_versions(history, tracked))
    schema = stored.schema
    if not out:
        return schema.empty_table()
    return pa.Table.from_pylist(out, schema=schema)


def as_group_rows(versions: Any, data: Any, key: str) -> Any:
    """Rebuilt ``versions`` as rows of the group ``data``: each in its key's bucket (when the
    table has the layout), none a delete."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from .settings import BUCKET_COLUMN

    if BUCKET_COLUMN in data.column_names:
        at = pc.index_in(versions.column(key), value_set=data.column(key))
        versions = versions.append_column(BUCKET_COLUMN, data.column(BUCKET_COLUMN).take(at))
    return versions.append_column(DELETE_COLUMN, pa.array([False] * versions.num_rows))


def _versions(
    history: list[tuple[Any, int, dict[str, Any] | None]], tracked: Sequence[str] | None
) -> list[dict[str, Any]]:
    """One key's versions from its events (sequence, arrival, values or None for a delete)."""
    seen: set[tuple[Any, bool]] = set()
    versions: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for at, _, values in sorted(history, key=lambda e: (e[0], e[1])):
        kind = (at, values is None)
        if kind in seen:
            continue  # the same change again (a replay), or a later one of the same sequence
        seen.add(kind)
        if values is None:  # a delete closes the current version
            if current is not None:
                current[END] = at
                current = None
            continue
        if current is not None and tracked is not None and _same(current, values, tracked):
            current.update(values)  # an untracked change: in place
            continue
        if current is not None:
            current[END] = at
        current = {**values, START: at, END: None}
        versions.append(current)
    return versions


def _same(current: Mapping[str, Any], values: Mapping[str, Any], tracked: Sequence[str]) -> bool:
    return all(current.get(c) == values.get(c) for c in tracked)
