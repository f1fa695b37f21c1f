"""Per-column sequences: on a ``sequence_by`` table whose merge keeps the last value set of a
column (``partial``, and the ``last_non_null`` columns of ``aggregate``), each such column
carries the sequence of the change that set it, in a column of its own
(:func:`sequence_columns`: ``_deltaflow_seq_<column>``, of the sequence's type). A change sets
a column only if it is newer than the change that set it last, so the table ends the same
whatever order the changes arrive in: ``{lsn 10: email}`` and ``{lsn 5: phone}`` keep both,
in one group or in two streams (Paimon's sequence groups, AUTO CDC's column-level
semantics).

The rest of a row follows its one sequence, the highest of its changes: a delete removes the
row only if newer than it; ``sum``, ``min`` and ``max`` columns take a change newer than it
(a change arriving after a newer one is not counted again). A row that replaces a deleted one
(a delete then changes in one group) starts its columns at the delete's sequence, so an older
change does not bring back a value the delete removed.

A table has these columns if it was created with them (``create_table`` with ``sequence_by``
and ``merge="partial"`` or ``"aggregate"``), and columns it gains get theirs
(:func:`gains_sequences`); a value stored without its own sequence (null there: written by
another program) is older than any change. Tables created before keep the row's one sequence
for every column. Changes of one key with equal sequences are not ordered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from ..columnar import INTERNAL_PREFIXES, NULLS_COLUMN

__all__ = [
    "PREFIX",
    "by_key",
    "contains",
    "floored",
    "gains_sequences",
    "key_runs",
    "last_setting",
    "merged_columns",
    "merged_sql",
    "own_sequence_fields",
    "sequence_columns",
    "sequenced_columns",
    "setting",
    "stamp",
    "stamped_columns",
    "wiped",
]

#: The prefix of the columns holding a column's own sequence.
PREFIX: Final = "_deltaflow_seq"


def sequence_columns(column: str, sequence: Sequence[str]) -> list[str]:
    """The columns holding, for ``column``, the sequence of the change that set it last: one
    per sequence column."""
    if len(sequence) == 1:
        return [f"{PREFIX}_{column}"]
    return [f"{PREFIX}{i}_{column}" for i in range(len(sequence))]


def _eligible(column: str, key: Iterable[str], sequence: Sequence[str], rule: Any) -> bool:
    """Whether ``column`` keeps the last value set under ``rule`` (so its order matters)."""
    if column in key or column in sequence or column.startswith(INTERNAL_PREFIXES):
        return False
    return bool(rule.function(column) == "last_non_null")


def _applies(sequence: Sequence[str], rule: Any) -> bool:
    """Whether columns of a table with ``sequence`` and merge ``rule`` may carry their own
    sequence: a ``sequence_by`` table whose merge keeps values set (not a history)."""
    return bool(sequence) and rule.mode in ("partial", "aggregate") and not rule.history


def own_sequence_fields(
    fields: Iterable[Any], key: Sequence[str], sequence: Sequence[str], rule: Any, types: Any
) -> list[Any]:
    """The columns holding the own sequences of ``fields`` (pyarrow fields of a table with
    ``key``, ``sequence`` and merge ``rule``); ``types``: the sequence columns' pyarrow types
    by name. None for a table without a sequence, or whose merge keeps no last value set."""
    import pyarrow as pa

    if not _applies(sequence, rule):
        return []
    return [
        pa.field(name, types[s])
        for f in fields
        if _eligible(f.name, key, sequence, rule)
        for name, s in zip(sequence_columns(f.name, sequence), sequence, strict=True)
    ]


def sequenced_columns(
    names: Sequence[str], key: Sequence[str], sequence: Sequence[str], rule: Any
) -> tuple[str, ...]:
    """The columns of a table (of columns ``names``) that carry their own sequence."""
    if not sequence:
        return ()
    present = set(names)
    return tuple(
        c
        for c in names
        if _eligible(c, key, sequence, rule)
        and all(h in present for h in sequence_columns(c, sequence))
    )


def gains_sequences(
    names: Sequence[str],
    key: Sequence[str],
    sequence: Sequence[str],
    rule: Any,
    sequenced: Sequence[str],
) -> bool:
    """Whether a table of columns ``names`` gives its columns their own sequences: some carry
    one, or none would (a ``partial`` table of its key and sequence alone, an ``aggregate``
    one of sums), so the columns it gains get theirs. A table made before per-column
    sequences, whose columns keep their last value without one, keeps the row's sequence."""
    if sequenced:
        return True
    return _applies(sequence, rule) and not any(_eligible(c, key, sequence, rule) for c in names)


def stamped_columns(
    names: Sequence[str], key: Sequence[str], sequence: Sequence[str], rule: Any
) -> list[str]:
    """The columns a fold stamps with their own sequence on a table whose columns carry one
    (``rule.stamps``): those, and the group's columns the table will add (schema evolution)
    that keep the last value set."""
    if not rule.stamps:
        return []
    known = set(rule.sequenced)
    return [
        *rule.sequenced,
        *(c for c in names if c not in known and _eligible(c, key, sequence, rule)),
    ]


def contains(lists: Any, value: str) -> Any:
    """Per row of a list column, whether its list holds ``value`` (numpy bools)."""
    import numpy as np
    import pyarrow.compute as pc

    lists = lists.combine_chunks() if hasattr(lists, "combine_chunks") else lists
    out = np.zeros(len(lists), dtype=bool)
    flat = pc.list_flatten(lists)
    if len(flat):
        parents = pc.list_parent_indices(lists).to_numpy()
        out[parents[np.asarray(pc.equal(flat, value).to_numpy(zero_copy_only=False), bool)]] = True
    return out


def by_key(key: Sequence[str]) -> list[tuple[str, str]]:
    """The sort order of a group's rows by key (what a fold's steps align on)."""
    return [(k, "ascending") for k in key]


def key_runs(rows: Any, key: Sequence[str], keys: int) -> Any:
    """Per row of ``rows`` (sorted by key, ``keys`` of them), the number of its key in order."""
    import numpy as np

    # Arrow's groups do not always come in order of first appearance: sorted by key again.
    counts = (
        rows.group_by(list(key), use_threads=False)
        .aggregate([([], "count_all")])
        .sort_by(by_key(key))
    )
    return np.repeat(np.arange(keys), counts.column("count_all").to_numpy())


def setting(rows: Any, column: str) -> Any:
    """Per row, whether it sets ``column``: a value, or a null set on purpose (numpy bools)."""
    import numpy as np

    values = rows.column(column)
    out = np.asarray(values.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if NULLS_COLUMN in rows.column_names:
        out |= contains(rows.column(NULLS_COLUMN), column)
    return out


def last_setting(run: Any, sets: Any, keys: int) -> Any:
    """Per key, the index of its last row that ``sets`` (numpy bools per row), or -1."""
    import numpy as np

    last = np.full(keys, -1, dtype=np.int64)
    np.maximum.at(last, run[sets], np.flatnonzero(sets))
    return last


def stamp(
    folded: Any,
    tail: Any,
    key: Sequence[str],
    sequence: Sequence[str],
    columns: Sequence[str],
    floors: Mapping[str, Any],
) -> Any:
    """``folded`` (one row per key of ``tail``, in its order; ``tail`` sorted by key, then in
    fold order) with the own sequences of ``columns``: per key the sequence of its last change
    that set the column, else its floor (``floors``: per sequence column, the sequence of the
    delete a row replaces, null where none)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    keys = folded.num_rows
    run = key_runs(tail, key, keys) if tail.num_rows else np.zeros(0, dtype=np.int64)
    for column in columns:
        last = np.full(keys, -1, dtype=np.int64)
        if column in tail.column_names:
            last = last_setting(run, setting(tail, column), keys)
        found = pa.array(last >= 0)
        for name, s in zip(sequence_columns(column, sequence), sequence, strict=True):
            kind = tail.schema.field(s).type
            value = tail.column(s).take(pa.array(np.maximum(last, 0))) if tail.num_rows else None
            floor = floors[s].cast(kind) if s in floors else pa.nulls(keys, kind)
            merged = floor if value is None else pc.if_else(found, value, floor)
            at = folded.schema.get_field_index(name)  # (staged rows carry the table's)
            if at >= 0:
                folded = folded.set_column(at, pa.field(name, kind), merged)
            else:
                folded = folded.append_column(pa.field(name, kind), merged)
    return folded


def merged_columns(
    group: Any, stored: Any, sequence: Sequence[str], columns: Sequence[str]
) -> dict[str, Any]:
    """Where the rows of ``group`` meet their key's stored rows (``stored``, aligned): each of
    ``columns`` and its own sequence, the change's where that is newer than the stored one (a
    value without one, written by another program, is older than any change)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from .sequence import newer

    out: dict[str, Any] = {}
    for column in columns:
        names = sequence_columns(column, sequence)
        if column not in group.column_names or names[0] not in group.column_names:
            continue
        mine = [group.column(h) for h in names]
        theirs = [stored.column(h).cast(m.type) for h, m in zip(names, mine, strict=True)]
        valid = np.asarray(mine[0].is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        wins = pa.array(valid & newer(mine, theirs))
        value = group.column(column)
        out[column] = pc.if_else(wins, value, stored.column(column).cast(value.type))
        for h, m, t in zip(names, mine, theirs, strict=True):
            out[h] = pc.if_else(wins, m, t)
    return out


def merged_sql(
    columns: Sequence[str],
    sequence: Sequence[str],
    quote: Any,
    *,
    wipe: bool = False,
    s: str = "s",
    t: str = "t",
) -> dict[str, str]:
    """A MERGE's ``UPDATE SET`` expressions for ``columns`` (which carry their own sequence)
    and their own sequences: the source's where its own sequence is newer than the target's.
    ``wipe``: the source is a delete older than the target row, which sets to null the
    columns set before it (:func:`wiped`)."""
    from .sequence import merge_condition

    out: dict[str, str] = {}
    for column in columns:
        names = sequence_columns(column, sequence)
        ours = dict(zip(sequence, names, strict=True))
        source = None if wipe else ours
        newer = merge_condition(sequence, quote, s, t, source_columns=source, target_columns=ours)
        wins = newer if wipe else f"{s}.{quote(names[0])} IS NOT NULL AND {newer}"
        mine = {n: f"{s}.{quote(q)}" for n, q in zip(names, sequence, strict=True)}
        mine[column] = "NULL" if wipe else f"{s}.{quote(column)}"
        for name in (column, *names):
            value = mine[name] if wipe else f"{s}.{quote(name)}"
            out[name] = f"CASE WHEN {wins} THEN {value} ELSE {t}.{quote(name)} END"
    return out


def wiped(
    data: Any, rows: Any, stored: Any, sequence: Sequence[str], columns: Sequence[str]
) -> Any:
    """The group ``data`` (one row per key) with each delete older than the stored row it
    meets made a change that nulls ``columns`` at the delete's sequence: merged with the stored
    row, it removes the values set before the delete and keeps those set after it (the row
    stays). ``rows``: per stored row met (``stored``), its row of ``data``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from ..columnar import DELETE_COLUMN
    from .sequence import newer

    rows = np.asarray(rows, dtype=np.int64)
    deletes = np.asarray(data.column(DELETE_COLUMN).to_numpy(zero_copy_only=False), bool)
    met = deletes[rows]
    if not met.any():
        return data
    at = rows[met]
    older = ~newer(
        [data.column(c).take(pa.array(at)) for c in sequence],
        [stored.column(c).filter(pa.array(met)) for c in sequence],
    )
    if not older.any():
        return data
    mask = np.zeros(data.num_rows, dtype=bool)
    mask[at[older]] = True
    wipe = pa.array(mask)
    values = {DELETE_COLUMN: pc.and_(data.column(DELETE_COLUMN), pc.invert(wipe))}
    for column in columns:
        if column in data.column_names:
            kind = data.schema.field(column).type
            values[column] = pc.if_else(wipe, pa.nulls(data.num_rows, kind), data.column(column))
        for name, s in zip(sequence_columns(column, sequence), sequence, strict=True):
            if name in data.column_names:
                kind = data.schema.field(name).type
                values[name] = pc.if_else(wipe, data.column(s).cast(kind), data.column(name))
    for name, value in values.items():
        i = data.schema.get_field_index(name)
        data = data.set_column(i, data.schema.field(i), value)
    return data


def floored(
    data: Any, floors: Sequence[Any], sequence: Sequence[str], columns: Sequence[str]
) -> Any:
    """The group ``data`` with the values its changes set before the recorded delete of their
    key removed (``floors``: per sequence column, that delete's sequence per row, null where
    none): each such column null, with the delete's sequence as its own. (A group may fold
    changes from before and after a delete the table recorded earlier.)"""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from ..columnar import DELETE_COLUMN
    from .sequence import newer

    upserts = ~np.asarray(data.column(DELETE_COLUMN).to_numpy(zero_copy_only=False), bool)
    held = upserts & np.asarray(floors[0].is_valid().to_numpy(zero_copy_only=False), bool)
    if not held.any():
        return data
    for column in columns:
        names = sequence_columns(column, sequence)
        if column not in data.column_names or names[0] not in data.column_names:
            continue
        before = pa.array(held & ~newer([data.column(h) for h in names], floors))
        values = {column: pa.nulls(data.num_rows, data.schema.field(column).type)}
        values |= {h: f.cast(data.schema.field(h).type) for h, f in zip(names, floors, strict=True)}
        for name, value in values.items():
            i = data.schema.get_field_index(name)
            merged = pc.if_else(before, value, data.column(name))
            data = data.set_column(i, data.schema.field(i), merged)
    return data
