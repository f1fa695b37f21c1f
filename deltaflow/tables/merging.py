"""Merge modes: how a change merges with the row the table holds for its key (a table's
``deltaflow.merge`` property).

- ``last`` (the default): the change replaces the row.
- ``partial``: the change's columns replace the row's; columns absent from the change, and
  nulls, keep the stored values.
- ``first``: the first change of a key wins; later ones are dropped while the row exists (a
  delete ends it, and the next change is first again). On a ``sequence_by`` table, first in
  sequence order.
- ``aggregate``: per column, as ``deltaflow.aggregates`` says: ``sum``, ``min``, ``max`` of the
  stored value and the change's, or ``last_non_null`` (the default for a column not named).

Within a group the changes of one key fold in order (sequence order on a ``sequence_by``
table, else arrival order) into one row (:func:`fold`). A delete followed by changes in one
group ends the stored row: the changes after it fold into a row that *replaces* the stored one
(:data:`REPLACE_COLUMN`; on a ``sequence_by`` table only if the delete is newer than the stored
row, so the delete's sequence travels along). Against the table the folded row meets the
stored row where deltaflow's writers read it (:func:`combine`), or in a MERGE's update
(:func:`update_clauses`). On a ``sequence_by`` table whose columns carry their own sequence,
they merge column by column (:mod:`.column_sequences`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..columnar import DELETE_COLUMN, NULLS_COLUMN
from .column_sequences import (
    by_key,
    contains,
    gains_sequences,
    key_runs,
    last_setting,
    merged_columns,
    merged_sql,
    sequenced_columns,
    setting,
    stamp,
    stamped_columns,
    wiped,
)

__all__ = [
    "LAST",
    "REPLACE_COLUMN",
    "MergeRule",
    "combine",
    "fold",
    "internal",
    "merge_stored",
    "merges_older",
    "replaced_sequence",
    "update_clauses",
]

#: Set on a folded row that replaces the stored row of its key (a delete came before the
#: changes it folds).
REPLACE_COLUMN: Final = "__deltaflow_replace"
_REPLACED: Final = "__deltaflow_replaced_"


def replaced_sequence(column: str) -> str:
    """The column carrying, on a replacing row, the sequence column ``column`` of the delete
    before it."""
    return _REPLACED + column


def internal(name: str) -> bool:
    """Whether a group column is deltaflow's own (never written to the table)."""
    return name.startswith("__deltaflow_")


@dataclass(frozen=True, slots=True)
class MergeRule:
    """A table's merge mode (see the module docstring).

    Attributes:
        mode: ``last``, ``partial``, ``first`` or ``aggregate``.
        aggregates: per column, its aggregate (``aggregate`` tables).
        history: the table keeps every version of a key (``history="scd2"``, :mod:`.history`):
            the changes rebuild its versions instead of merging with one row.
        tracked: with ``history``, the columns whose change opens a version (empty: all).
        sequenced: the columns that carry their own sequence (:mod:`.column_sequences`).
        stamps: columns it gains get their own sequence too (:func:`.gains_sequences`).
    """

    mode: str = "last"
    aggregates: Mapping[str, str] = field(default_factory=dict)
    history: bool = False
    tracked: tuple[str, ...] = ()
    sequenced: tuple[str, ...] = ()
    stamps: bool = False

    @property
    def folds(self) -> bool:
        """Whether a key's changes fold together (every mode but ``last``)."""
        return self.mode != "last"

    @classmethod
    def of(cls, settings: Any, names: Sequence[str] = ()) -> MergeRule:
        """The rule of a table with ``settings`` (:class:`.TableSettings`) and columns
        ``names``."""
        if settings is None or (settings.merge == "last" and settings.history == "none"):
            return LAST
        rule = cls(
            settings.merge,
            dict(settings.aggregates),
            settings.history == "scd2",
            tuple(settings.track_history_on),
        )
        sequenced = sequenced_columns(names, settings.key, settings.sequence_by, rule)
        stamps = gains_sequences(names, settings.key, settings.sequence_by, rule, sequenced)
        return cls(rule.mode, rule.aggregates, rule.history, rule.tracked, sequenced, stamps)

    def function(self, column: str) -> str:
        """What a column does when a change meets the stored row (``partial``: keep the
        stored value where the change has none)."""
        if self.mode == "aggregate":
            return self.aggregates.get(column, "last_non_null")
        return "last" if self.mode == "last" else "last_non_null"


#: Every change replaces the stored row (the default).
LAST: Final = MergeRule()


def check_aggregate_type(column: str, function: str, arrow_type: Any) -> None:
    """Refuse an aggregate a column's type cannot take (``sum`` of text, say).

    Raises:
        UsageError: naming the column, its type and the aggregate.
    """
    import pyarrow as pa

    from ..errors import UsageError

    numeric = pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)
    numeric = numeric or pa.types.is_decimal(arrow_type)
    ordered = numeric or pa.types.is_string(arrow_type) or pa.types.is_temporal(arrow_type)
    if (function == "sum" and not numeric) or (function in ("min", "max") and not ordered):
        raise UsageError(f"column {column!r} is {arrow_type}: it has no {function}")


def fold(data: Any, key: Sequence[str], sequence: Sequence[str], rule: MergeRule) -> Any:
    """The group ``data`` (its rows in arrival order, ``DELETE_COLUMN`` included) as one row
    per key under ``rule`` (a mode that folds): the changes after a key's last delete folded
    in order (sequence order on a ``sequence_by`` table, else arrival), with
    :data:`REPLACE_COLUMN` set when there was such a delete (and, on a ``sequence_by`` table,
    its sequence in :func:`replaced_sequence` columns); or that delete, when nothing follows
    it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if data.num_rows == 0:
        return data
    if sequence:  # a change delivered twice (one sequence, one key) counts once
        data = _first_of_each(data, [*key, *sequence])
    n = data.num_rows
    arrival, rank, deleted = "__deltaflow_arrival", "__deltaflow_rank", "__deltaflow_deleted"
    ordered = data.append_column(arrival, pa.array(np.arange(n), type=pa.int64())).sort_by(
        [(k, "ascending") for k in key]
        + [(c, "ascending") for c in sequence]
        + [(arrival, "ascending")]
    )
    ranks = pa.array(np.arange(n), type=pa.int64())
    ordered = ordered.append_column(rank, ranks).append_column(
        deleted, pc.if_else(ordered.column(DELETE_COLUMN), ranks, -1)
    )
    # A key's rows are contiguous in that order: its first and last rank, its last delete.
    # (Arrow's groups do not always come in order of first appearance: sorted again.)
    per_key = (
        ordered.group_by(list(key), use_threads=False)
        .aggregate([(rank, "min"), (rank, "max"), (deleted, "max")])
        .sort_by(by_key(key))
    )
    low = per_key.column(f"{rank}_min").to_numpy()
    high = per_key.column(f"{rank}_max").to_numpy()
    last_delete = per_key.column(f"{deleted}_max").to_numpy()
    ends_deleted = last_delete == high
    parts = []
    if ends_deleted.any():
        parts.append(ordered.take(pa.array(last_delete[ends_deleted])).select(data.column_names))
    folding = ~ends_deleted
    if folding.any():
        after = np.repeat(last_delete, high - low + 1)  # per row: its key's last delete
        tail = ordered.filter(pa.array(np.arange(n) > after))
        folded = _fold_tail(tail, data, key, sequence, rule)
        replaced = last_delete[folding]
        replacing = replaced >= 0
        floors: dict[str, Any] = {}  # the sequence a replacing row starts its columns at
        if replacing.any():
            folded = folded.append_column(REPLACE_COLUMN, pa.array(replacing))
            if sequence:
                deletes = ordered.take(pa.array(np.where(replacing, replaced, 0)))
                for c in sequence:
                    floors[c] = pc.if_else(pa.array(replacing), deletes.column(c), None)
                    folded = folded.append_column(replaced_sequence(c), floors[c])
        own = stamped_columns(data.column_names, key, sequence, rule)
        if own:
            folded = stamp(folded, tail, key, sequence, own, floors)
        parts.append(folded)
    if len(parts) == 2:
        parts[0] = _padded(parts[0], parts[1].schema)
    return pa.concat_tables(parts)


def _first_of_each(data: Any, columns: list[str]) -> Any:
    """``data`` with only the first row of each value of ``columns``, in order."""
    import numpy as np
    import pyarrow as pa

    index = "__deltaflow_first"
    first = (
        data.select(columns)
        .append_column(index, pa.array(np.arange(data.num_rows), type=pa.int64()))
        .group_by(columns, use_threads=False)
        .aggregate([(index, "min")])
        .column(f"{index}_min")
    )
    if len(first) == data.num_rows:
        return data
    return data.take(pa.array(np.sort(first.to_numpy())))


def _fold_tail(
    tail: Any, data: Any, key: Sequence[str], sequence: Sequence[str], rule: MergeRule
) -> Any:
    """One row per key of ``tail`` (upserts, in fold order), with ``data``'s columns."""
    import pyarrow as pa
    import pyarrow.compute as pc

    keep_nulls = pc.ScalarAggregateOptions(skip_nulls=False)
    skip_nulls = pc.ScalarAggregateOptions(skip_nulls=True)
    aggregations: list[tuple[str, str, Any]] = []
    for name in data.column_names:
        if name in key or name in (DELETE_COLUMN, NULLS_COLUMN):
            continue
        function = "first" if rule.mode == "first" else rule.function(name)
        if name in sequence or function == "last":
            aggregations.append((name, "last", keep_nulls))
        elif function == "first":
            aggregations.append((name, "first", keep_nulls))
        elif function == "last_non_null":
            aggregations.append((name, "last", skip_nulls))
        else:  # sum, min, max: null only when every change is
            options = pc.ScalarAggregateOptions(skip_nulls=True, min_count=1)
            aggregations.append((name, function, options))
    grouped = (
        tail.group_by(list(key), use_threads=False).aggregate(aggregations).sort_by(by_key(key))
    )
    columns = {
        name: grouped.column(f"{name}_{how}").cast(data.schema.field(name).type)
        for name, how, _ in aggregations
    }
    columns.update({k: grouped.column(k) for k in key})
    columns[DELETE_COLUMN] = pa.array([False] * grouped.num_rows)
    if NULLS_COLUMN in data.column_names:
        last_set = [n for n, how, opts in aggregations if how == "last" and opts is skip_nulls]
        columns.update(_explicit_nulls(tail, key, last_set, grouped.num_rows))
    return pa.table([columns[c] for c in data.column_names], schema=data.schema)


def _explicit_nulls(tail: Any, key: Sequence[str], names: list[str], keys: int) -> dict[str, Any]:
    """For the columns ``names`` (the last non-null value wins), the last value a key's
    changes set, counting a null set on purpose (:data:`NULLS_COLUMN`), and the folded rows'
    own :data:`NULLS_COLUMN`. ``tail`` is sorted by key, ``keys`` of them."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    run = key_runs(tail, key, keys)
    explicit_out: list[list[str]] = [[] for _ in range(keys)]
    out: dict[str, Any] = {}
    for name in names:
        named = contains(tail.column(NULLS_COLUMN), name)
        if not named.any():
            continue
        last = last_setting(run, setting(tail, name), keys)
        value = tail.column(name).take(pa.array(np.maximum(last, 0)))
        value = pc.if_else(pa.array(last >= 0), value, pa.nulls(keys, value.type))
        out[name] = value
        for k in np.flatnonzero((last >= 0) & named[np.maximum(last, 0)]):
            explicit_out[k].append(name)
    out[NULLS_COLUMN] = pa.array([n or None for n in explicit_out], pa.list_(pa.string()))
    return out


def _padded(rows: Any, schema: Any) -> Any:
    """``rows`` with ``schema``'s further columns, null (not replacing)."""
    import pyarrow as pa

    for f in schema:
        if f.name not in rows.column_names:
            value = pa.array([False] * rows.num_rows) if f.name == REPLACE_COLUMN else None
            rows = rows.append_column(
                f, value if value is not None else pa.nulls(rows.num_rows, f.type)
            )
    return rows


def merge_stored(
    data: Any,
    stored: Any,
    group_of: Any,
    rule: MergeRule,
    key: Sequence[str],
    sequence: Sequence[str],
) -> tuple[Any, Any, Any]:
    """Where the group ``data`` (one row per key) meets the stored rows it replaces
    (``stored``, each replaced by the group row ``group_of`` names), the rows ``rule`` makes
    of them.

    Returns the group with its rows merged in place, per stored row whether it is still
    replaced, and per group row whether it is dropped (a ``first`` table keeps the stored row).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from .sequence import newer

    rows = np.asarray(group_of, dtype=np.int64)
    if rule.sequenced:  # a delete older than the row nulls what was set before it
        data = wiped(data, rows, stored, sequence, rule.sequenced)
    upserts = ~np.asarray(data.column(DELETE_COLUMN).to_numpy(zero_copy_only=False), bool)[rows]
    keep = np.ones(len(rows), dtype=bool)
    dropped = np.zeros(data.num_rows, dtype=bool)
    if not upserts.any():
        return data, keep, dropped
    replace = np.zeros(len(rows), dtype=bool)
    if REPLACE_COLUMN in data.column_names:
        flags = pc.fill_null(data.column(REPLACE_COLUMN).take(pa.array(rows)), False)
        replace = np.asarray(flags.to_numpy(zero_copy_only=False), dtype=bool)
        if sequence and replace.any():  # only a delete newer than the stored row ends it
            replace &= newer(
                [data.column(replaced_sequence(c)).take(pa.array(rows)) for c in sequence],
                [stored.column(c) for c in sequence],
            )
    if rule.mode == "first":
        lose = upserts & ~replace
        dropped[rows[lose]] = True
        return data, ~lose, dropped
    order = np.argsort(rows[upserts])  # the merged rows in the group's row order
    at = rows[upserts][order]
    met = stored.filter(pa.array(upserts)).take(pa.array(order))
    ahead = None
    if rule.sequenced:  # rows older than their stored row merge too (:func:`merges_older`)
        ahead = newer(
            [data.column(c).take(pa.array(at)) for c in sequence], [met.column(c) for c in sequence]
        )
    merged = combine(
        data.take(pa.array(at)), met, replace[upserts][order], rule, key, ahead, sequence
    )
    # Each row from the group, or from the merged rows where it met a stored one.
    source = np.arange(data.num_rows, dtype=np.int64)
    source[at] = data.num_rows + np.arange(len(at))
    picked = pa.array(source)
    columns = [
        pa.concat_arrays([data.column(i).combine_chunks(), merged.column(i).combine_chunks()]).take(
            picked
        )
        for i in range(data.num_columns)
    ]
    return pa.table(columns, schema=data.schema), keep, dropped


def combine(
    group: Any,
    stored: Any,
    replace: Any,
    rule: MergeRule,
    key: Sequence[str],
    ahead: Any = None,
    sequence: Sequence[str] = (),
) -> Any:
    """The rows of ``group`` (upserts that meet a stored row of their key, aligned with
    ``stored``) as ``rule`` merges them with it; ``replace`` (numpy bools) marks the rows that
    replace the stored row instead (a delete came before them). On a table whose columns carry
    their own sequence, ``ahead`` (numpy bools) marks the rows newer than their stored row:
    those columns merge by their own sequences, the others only where the row is ahead."""
    import pyarrow as pa
    import pyarrow.compute as pc

    replacing = pa.array(replace, type=pa.bool_())
    explicit = NULLS_COLUMN in group.column_names
    own = merged_columns(group, stored, sequence, rule.sequenced) if rule.sequenced else {}
    columns = []
    for f in group.schema:
        mine = group.column(f.name)
        if f.name in key or internal(f.name) or f.name not in stored.column_names:
            columns.append(mine)
            continue
        if f.name in own:
            columns.append(pc.if_else(replacing, mine, own[f.name]))
            continue
        theirs = stored.column(f.name)
        if theirs.type != mine.type:
            theirs = theirs.cast(mine.type)
        function = rule.function(f.name)
        if function == "last":
            merged = mine
        elif function == "last_non_null":
            merged = pc.coalesce(mine, theirs)
            if explicit:  # set to null on purpose: null
                named = pa.array(contains(group.column(NULLS_COLUMN), f.name))
                merged = pc.if_else(named, pa.nulls(len(mine), mine.type), merged)
        elif function == "sum":
            merged = pc.coalesce(pc.add(theirs, mine), mine, theirs)
        elif function == "min":
            merged = pc.min_element_wise(mine, theirs)
        else:  # max
            merged = pc.max_element_wise(mine, theirs)
        if ahead is not None:  # (a sequence column: the higher one)
            merged = pc.if_else(pa.array(ahead, type=pa.bool_()), merged, theirs)
        columns.append(pc.if_else(replacing, mine, merged))
    return pa.table(columns, schema=group.schema)


def matched_clauses(
    columns: Sequence[str],
    rule: MergeRule,
    sequence: Sequence[str],
    quote: Any,
    *,
    replacing: bool,
    nulls: bool = False,
    moved: bool = False,
) -> list[tuple[str | None, dict[str, str] | None]]:
    """A MERGE's ``WHEN MATCHED`` clauses, in order: (condition or None, the ``UPDATE SET``
    assignments, or None to ``DELETE``). ``columns``: the ones an update sets (no key, no
    layout column); ``replacing``, ``nulls``: the source has :data:`REPLACE_COLUMN`,
    :data:`NULLS_COLUMN`; ``moved``: an updated row takes the source's bucket (a table whose
    bucket levels grow: the row moves to the group's level, :mod:`.layout`)."""
    from .sequence import merge_condition
    from .settings import BUCKET_COLUMN

    flag = f"s.{quote(DELETE_COLUMN)}"
    newer = merge_condition(sequence, quote) if sequence else None
    plain = {c: f"s.{quote(c)}" for c in columns}
    clauses: list[tuple[str | None, dict[str, str] | None]] = [
        (flag if newer is None else f"{flag} AND {newer}", None)
    ]
    if rule.folds and replacing:
        replace = f"s.{quote(REPLACE_COLUMN)}"
        if sequence:
            deleted = {c: replaced_sequence(c) for c in sequence}
            replace += (
                f" AND {newer} AND {merge_condition(sequence, quote, source_columns=deleted)}"
            )
        clauses.append((replace, plain))
    if rule.mode != "first" and rule.sequenced and newer is not None:
        # Every change merges, older ones too: its columns by their own sequences, the rest
        # (and the row's sequence) only where it is newer; an older delete nulls the values
        # set before it (:mod:`.column_sequences`).
        sets = update_clauses(columns, rule, quote, nulls=nulls)
        sets = {c: f"CASE WHEN {newer} THEN {v} ELSE t.{quote(c)} END" for c, v in sets.items()}
        sets |= merged_sql(rule.sequenced, sequence, quote)
        clauses.append((flag, merged_sql(rule.sequenced, sequence, quote, wipe=True)))
        clauses.append((f"NOT {flag}", sets))
    elif rule.mode != "first":
        clauses.append((newer, update_clauses(columns, rule, quote, nulls=nulls)))
    if moved:
        bucket = {BUCKET_COLUMN: f"s.{quote(BUCKET_COLUMN)}"}
        clauses = [(when, None if sets is None else sets | bucket) for when, sets in clauses]
    return clauses


def merges_older(data: Any, rule: MergeRule) -> Any:
    """Per row of the group ``data``, whether it merges with a stored row of its key even
    when that one is newer (every row, on a table whose columns carry their own sequence: an
    upsert by those sequences, a delete as :func:`.column_sequences.wiped` says); None where
    none does."""
    if not rule.sequenced:
        return None
    import numpy as np

    return np.ones(data.num_rows, dtype=bool)


def update_clauses(
    columns: Sequence[str],
    rule: MergeRule,
    quote: Any,
    s: str = "s",
    t: str = "t",
    *,
    nulls: bool = False,
) -> dict[str, str]:
    """A MERGE's ``UPDATE SET`` expressions (target column -> SQL) that merge the source row
    into the target one under ``rule`` (the mode's; a replacing row's clause is the caller's:
    plain assignments)."""
    out = {}
    for column in columns:
        mine, theirs = f"{s}.{quote(column)}", f"{t}.{quote(column)}"
        function = rule.function(column)
        if function == "last":
            out[column] = mine
        elif function == "last_non_null":
            out[column] = f"COALESCE({mine}, {theirs})"
            if nulls:  # set to null on purpose (deltaflow.set_null)
                name = "'" + column.replace("'", "''") + "'"
                listed = f"{s}.{quote(NULLS_COLUMN)}"
                out[column] = (
                    f"CASE WHEN array_contains({listed}, {name}) THEN NULL ELSE {out[column]} END"
                )
        elif function == "sum":
            out[column] = (
                f"CASE WHEN {mine} IS NULL THEN {theirs} WHEN {theirs} IS NULL THEN {mine} "
                f"ELSE {theirs} + {mine} END"
            )
        else:
            op = "<" if function == "min" else ">"
            out[column] = (
                f"CASE WHEN {mine} IS NULL THEN {theirs} WHEN {theirs} IS NULL OR "
                f"{mine} {op} {theirs} THEN {mine} ELSE {theirs} END"
            )
    return out
