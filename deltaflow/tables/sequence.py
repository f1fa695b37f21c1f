"""Sequence order for change feeds: a change applies to its key only if its sequence is
greater than the one the table holds for the key.

A table created with ``sequence_by`` (its ``deltaflow.sequenceBy`` property: one column or
several, compared in order) orders the changes to each key by the source's own order (a log
sequence number, a timestamp) instead of by arrival. Changes of one key may then come from
several producers, out of order, late or twice: the table ends at the change of the highest
sequence, whatever the order they arrived in. The comparison is made everywhere a key's stored
row is met:

- within a group, the change of the highest sequence per key is kept (:func:`newest_per_key`);
  of equal sequences the first to arrive, as one-by-one application would keep it;
- against the table, where a group's keys are found in its files (:func:`resolve`): the
  copy-on-write rewrite and merge-on-read keep a stored row whose sequence is not lower than
  the group's, and drop the group's row; a MERGE gets the same rule as a predicate
  (:func:`merge_condition`);
- against deleted keys (:class:`Tombstones`): a delete removes the row but its sequence is
  remembered, so an older upsert arriving later does not bring the key back. The deleted keys
  and their sequences are recorded in the deleting commit's ``userMetadata`` (beside the lane
  marks, atomic with the delete, ignored by every Delta reader) and kept for the table's
  tombstone retention (``deltaflow.tombstoneRetention``, 7 days by default).

A stored row without a sequence (written before the table had one, or by another program) is
older than any change.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from ..columnar import DELETE_COLUMN
from ..errors import UsageError

__all__ = [
    "DEFAULT_TOMBSTONE_RETENTION",
    "Tombstones",
    "check_sequence_type",
    "format_interval",
    "merge_condition",
    "newer",
    "newest_per_key",
    "parse_interval",
    "resolve",
]

#: Seconds a deleted key's sequence is kept (AUTO CDC keeps tombstones as long by default).
DEFAULT_TOMBSTONE_RETENTION: Final = 7 * 86400
_UNITS: Final = {
    "second": 1,
    "minute": 60,
    "hour": 3600,
    "day": 86400,
    "week": 7 * 86400,
}
_INTERVAL: Final = re.compile(r"(?:interval\s+)?(\d+)\s*([a-z]+?)s?", re.IGNORECASE)


def parse_interval(text: Any) -> int:
    """Seconds of a retention given as seconds, a ``timedelta``, or Delta's interval text
    (``"interval 7 days"``, ``"36 hours"``).

    Raises:
        UsageError: not one of those.
    """
    import datetime

    if isinstance(text, datetime.timedelta):
        seconds = int(text.total_seconds())
    elif isinstance(text, int) and not isinstance(text, bool):
        seconds = text
    else:
        m = _INTERVAL.fullmatch(str(text).strip())
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if m is None or unit is None:
            raise UsageError(
                f"retention {text!r} is not a duration; give seconds, a timedelta, or text "
                "like '7 days' (units: seconds, minutes, hours, days, weeks)"
            )
        seconds = int(m.group(1)) * unit
    if seconds <= 0:
        raise UsageError(f"retention {text!r} must be longer than zero")
    return seconds


def format_interval(seconds: int) -> str:
    """Delta's interval text of ``seconds``, in the largest unit that divides it."""
    for unit, size in sorted(_UNITS.items(), key=lambda u: -u[1]):
        if seconds % size == 0 and unit != "week":
            n = seconds // size
            return f"interval {n} {unit}{'s' if n != 1 else ''}"
    raise AssertionError("a second divides every count of seconds")


def check_sequence_type(column: str, arrow_type: Any) -> None:
    """Refuse a sequence column of a type without a total order deltaflow records exactly.

    Raises:
        UsageError: naming the column and the types allowed.
    """
    import pyarrow as pa

    t = arrow_type
    if pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t):
        return
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return
    raise UsageError(
        f"sequence column {column!r} is {t}; a sequence is an integer, a string, a date or a "
        "timestamp (a log sequence number, a commit time)"
    )


def newer(a: Sequence[Any], b: Sequence[Any]) -> Any:
    """Whether each row of the columns ``a`` is strictly greater than the same row of ``b``,
    compared in column order (a numpy bool array). A null in ``b`` is older than anything;
    ``a`` has no nulls (rows are checked when staged)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    result: Any = None
    for x, y in zip(reversed(a), reversed(b), strict=True):
        y = y.cast(x.type) if y.type != x.type else y
        gt = pc.fill_null(pc.or_kleene(pc.greater(x, y), pc.is_null(y)), False)
        greater = np.asarray(gt.to_numpy(zero_copy_only=False), dtype=bool)
        if result is None:
            result = greater
            continue
        eq = pc.fill_null(pc.equal(x, y), False)
        result = greater | (np.asarray(eq.to_numpy(zero_copy_only=False), dtype=bool) & result)
    if result is None:
        raise AssertionError("a sequence has at least one column")
    if isinstance(result, pa.ChunkedArray):  # pragma: no cover - to_numpy returns ndarrays
        result = result.to_numpy()
    return result


def newest_per_key(table: Any, key: Sequence[str], sequence: Sequence[str]) -> Any:
    """Rows of ``table`` keeping, per key, the row of the highest sequence (of equal ones, the
    first in ``table``'s order); the kept rows stay in that order."""
    import numpy as np
    import pyarrow as pa

    if table.num_rows < 2:
        return table
    index = "__deltaflow_row"
    numbered = table.select([*key, *sequence]).append_column(
        index, pa.array(range(table.num_rows), type=pa.int64())
    )
    order = [(k, "ascending") for k in key]
    order += [(s, "descending") for s in sequence] + [(index, "ascending")]
    ordered = numbered.sort_by(order)
    # The first row of each key in that order (an ordered aggregation keeps the sort).
    first = (
        ordered.group_by(list(key), use_threads=False)
        .aggregate([(index, "first")])
        .column(f"{index}_first")
    )
    if len(first) == table.num_rows:
        return table
    return table.take(np.sort(first.to_numpy()))


def resolve(
    group_keys: Any,
    group_sequence: Sequence[Any] | None,
    stored_keys: Any,
    stored_sequence: Sequence[Any] | None,
    live: Any = None,
    merging: Any = None,
) -> tuple[Any, Any, Any]:
    """Which stored rows a group replaces, and which of the group's rows lose to a stored row.

    Args:
        group_keys: the group's key column (one row per key).
        group_sequence: its sequence columns; None for a table without ``sequence_by`` (every
            change wins).
        stored_keys: the key column of the stored rows met (the files read).
        stored_sequence: their sequence columns (None with ``group_sequence`` None).
        live: numpy bool per stored row, False for rows a deletion vector removed already
            (None: all live).
        merging: numpy bool per group row, True for those that merge with a stored row of a
            higher sequence instead of losing to it (:func:`.merging.merges_older`).

    Returns ``(replaced, losers, group_of)``: numpy bool arrays over the stored rows (the group
    replaces or deletes them) and over the group's rows (a stored row of a sequence not lower
    holds their key: they are dropped), and per stored row the group row that replaces it (-1
    for none).
    """
    import numpy as np
    import pyarrow.compute as pc

    position = pc.index_in(stored_keys, value_set=group_keys)
    hit = np.asarray(position.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    losers = np.zeros(len(group_keys), dtype=bool)
    if live is not None:
        hit &= live
    group_of = np.full(len(hit), -1, dtype=np.int64)
    if not hit.any():
        return hit, losers, group_of
    at = np.asarray(pc.fill_null(position, 0).to_numpy(zero_copy_only=False)).astype(np.int64)
    group_of[hit] = at[hit]
    if group_sequence is None:
        return hit, losers, group_of
    assert stored_sequence is not None
    mask = _bool_array(hit)
    wins = newer(
        [c.take(at[hit]) for c in group_sequence], [c.filter(mask) for c in stored_sequence]
    )
    if merging is not None:
        wins |= merging[at[hit]]
    replaced = hit.copy()
    replaced[hit] = wins
    losers[at[hit][~wins]] = True
    group_of[~replaced] = -1
    return replaced, losers, group_of


def _bool_array(values: Any) -> Any:
    import pyarrow as pa

    return pa.array(values, type=pa.bool_())


def merge_condition(
    sequence: Sequence[str],
    quote: Any,
    source: str = "s",
    target: str = "t",
    source_columns: Mapping[str, str] | None = None,
    target_columns: Mapping[str, str] | None = None,
) -> str:
    """A MERGE's ``WHEN MATCHED`` condition that the source row's sequence is greater than the
    target's (columns compared in order; a target without one is older). ``source_columns``,
    ``target_columns``: the columns to compare instead of the sequence's own names."""
    cond = ""
    for column in reversed(sequence):
        mine = (source_columns or {}).get(column, column)
        theirs = (target_columns or {}).get(column, column)
        s, t = f"{source}.{quote(mine)}", f"{target}.{quote(theirs)}"
        here = f"{s} > {t} OR {t} IS NULL"
        cond = f"({here})" if not cond else f"({here} OR ({s} = {t} AND {cond}))"
    return cond


def encode(column: Any) -> list[Any]:
    """A column's values as JSON values that compare (and equal) as the column's do: dates and
    timestamps as their integer counts, decimals as text, bytes as hex."""
    import pyarrow as pa

    t = column.type
    if (width := _counts(t)) is not None:
        return column.cast(width).to_pylist()  # type: ignore[no-any-return]
    if pa.types.is_decimal(t):
        return [None if v is None else str(v) for v in column.to_pylist()]
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return [None if v is None else v.hex() for v in column.to_pylist()]
    return column.to_pylist()  # type: ignore[no-any-return]


def _counts(kind: Any) -> Any:
    """The integer type a date or timestamp type's values are counted in; None for others."""
    import pyarrow as pa

    if pa.types.is_timestamp(kind) or pa.types.is_date64(kind):
        return pa.int64()
    return pa.int32() if pa.types.is_date32(kind) else None


def decode(values: list[Any], kind: Any) -> Any:
    """Values :func:`encode` wrote, back as an Arrow array of type ``kind``."""
    import decimal

    import pyarrow as pa

    if (width := _counts(kind)) is not None:
        return pa.array(values, type=width).cast(kind)  # (Arrow casts dates from int32 only)
    if pa.types.is_decimal(kind):
        return pa.array([None if v is None else decimal.Decimal(v) for v in values], type=kind)
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return pa.array([None if v is None else bytes.fromhex(v) for v in values], type=kind)
    return pa.array(values).cast(kind)


def _comparable(column: Any) -> Any:
    """A column as :func:`encode` writes it, kept in Arrow (integers as int64, dates and
    timestamps as their counts, text as text); None for another type."""
    import pyarrow as pa

    t = column.type
    if (width := _counts(t)) is not None:
        return column.cast(width).cast(pa.int64())
    if pa.types.is_integer(t):
        try:
            return column.cast(pa.int64())
        except pa.ArrowInvalid:  # an unsigned value past int64
            return None
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return column.cast(pa.string())
    return None


def _rows(columns: Sequence[list[Any]]) -> list[Any]:
    """One value per row: the value for one column, a tuple for several."""
    if len(columns) == 1:
        return columns[0]
    return list(zip(*columns, strict=True))


class Tombstones:
    """The deleted keys of a ``sequence_by`` table and the sequence of their delete, read from
    the table's commits (see the module docstring); on one node, per table.

    A key's entry is dropped once older than the retention: an upsert of the key with an
    older sequence arriving after that brings the key back (as AUTO CDC's tombstone GC does).
    """

    def __init__(self) -> None:
        self._held: dict[Any, tuple[tuple[Any, ...], int]] = {}
        # Every delete of a key, not only the newest (a history's deletes, :meth:`events`).
        self._every: dict[Any, dict[tuple[Any, ...], int]] = {}
        self._columns: tuple[Any, Any] | None = None  # the held keys and sequences, as Arrow
        self._expired_at = 0.0

    def __len__(self) -> int:
        return len(self._held)

    def absorb(self, deleted: Mapping[str, Any], at_ms: int) -> None:
        """The deletes one commit (made at ``at_ms``) recorded: ``{"keys": [...],
        "seqs": [...]}`` as :func:`recorded` writes them."""
        keys, seqs = deleted.get("keys"), deleted.get("seqs")
        if not isinstance(keys, list) or not isinstance(seqs, list) or len(keys) != len(seqs):
            return
        for k, s in zip(keys, seqs, strict=True):
            k = tuple(k) if isinstance(k, list) else k
            s = tuple(s) if isinstance(s, list) else (s,)
            held = self._held.get(k)
            if held is None or s > held[0]:
                self._held[k] = (s, at_ms)
            self._every.setdefault(k, {})[s] = at_ms
        self._columns = None

    def by_time(self) -> dict[int, tuple[list[Any], list[Any]]]:
        """Every delete held, grouped by the time of its commit: ``{at_ms: (keys, seqs)}``, as
        :meth:`absorb` takes them back (a snapshot, :mod:`.tombstone_snapshots`)."""
        out: dict[int, tuple[list[Any], list[Any]]] = {}
        for key, deletes in self._every.items():
            for seq, at in deletes.items():
                keys, seqs = out.setdefault(at, ([], []))
                keys.append(list(key) if isinstance(key, tuple) else key)
                seqs.append(list(seq))
        return out

    def expire(self, retention_seconds: int, now: float | None = None) -> None:
        """Forget the deletes older than the retention (at most once a minute)."""
        now = time.time() if now is None else now
        if now - self._expired_at < 60:
            return
        self._expired_at = now
        oldest = int((now - retention_seconds) * 1000)
        self._held = {k: v for k, v in self._held.items() if v[1] >= oldest}
        self._columns = None
        every = {k: {s: t for s, t in v.items() if t >= oldest} for k, v in self._every.items()}
        self._every = {k: v for k, v in every.items() if v}

    def _keep_columnar(self, keys: Any, sequence: Any) -> Any:
        """:meth:`bury`'s verdict per row (numpy bools) without a Python pass over the group's
        rows, for a key and a sequence of one column each whose values encode as integers or
        text; None for other types."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        mine = _comparable(keys)
        if mine is None or _comparable(sequence) is None:
            return None
        if self._columns is None:  # (made again after each absorb)
            held = list(self._held.items())
            try:
                self._columns = (
                    pa.array([k for k, _ in held]),
                    pa.array([s[0] for _, (s, _) in held]),
                )
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # keys of several columns
                return None
        held_keys, held_seqs = self._columns
        if held_keys.type != mine.type:
            try:
                held_keys = held_keys.cast(mine.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                return None
        at = pc.index_in(mine, value_set=held_keys)
        hit = np.asarray(at.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        keep = np.ones(len(hit), dtype=bool)
        if hit.any():
            theirs = held_seqs.take(at.filter(pa.array(hit)))
            ours = _comparable(sequence.filter(pa.array(hit)))
            keep[hit] = newer([ours], [theirs])
        return keep

    def events(self, data: Any, key: Sequence[str], sequence: Sequence[str]) -> Any:
        """``data`` (a group of changes) with the recorded deletes of its keys added as rows
        (the key, the sequence, the delete flag): a history rebuilt from stored versions alone
        would not know a delete of a key that had no version then."""
        if not self._every or not data.num_rows:
            return data
        import pyarrow as pa

        keys = _rows([encode(data.column(k)) for k in key])
        first: dict[Any, int] = {}
        for i, k in enumerate(keys):
            if k in self._every:
                first.setdefault(k, i)
        if not first:
            return data
        at = [i for k, i in first.items() for _ in self._every[k]]
        seqs = [s for k in first for s in self._every[k]]
        deletes = data.take(pa.array(at, type=pa.int64()))
        for n, column in enumerate(sequence):
            where = deletes.schema.get_field_index(column)
            field = deletes.schema.field(where)
            decoded = decode([s[n] for s in seqs], field.type)
            deletes = deletes.set_column(where, field, decoded)
        where = deletes.schema.get_field_index(DELETE_COLUMN)
        deletes = deletes.set_column(where, deletes.schema.field(where), pa.array([True] * len(at)))
        return pa.concat_tables([data, deletes])

    def bury(self, data: Any, key: Sequence[str], sequence: Sequence[str]) -> tuple[Any, int]:
        """``data`` (a group, one row per key) without the changes a recorded delete of their
        key makes old (its sequence is not lower); and how many were dropped."""
        if not self._held or not data.num_rows:
            return data, 0
        import pyarrow as pa

        if len(key) == 1 and len(sequence) == 1:
            keep = self._keep_columnar(data.column(key[0]), data.column(sequence[0]))
            if keep is not None:
                dropped = int(len(keep) - keep.sum())
                return (data.filter(pa.array(keep)), dropped) if dropped else (data, 0)

        keys = _rows([encode(data.column(k)) for k in key])
        seqs = list(zip(*(encode(data.column(s)) for s in sequence), strict=True))
        held = self._held
        keep = [k not in held or s > held[k][0] for k, s in zip(keys, seqs, strict=True)]
        dropped = keep.count(False)
        if not dropped:
            return data, 0
        return data.filter(pa.array(keep, type=pa.bool_())), dropped

    def held(self, data: Any, key: Sequence[str], sequence: Sequence[str]) -> list[Any] | None:
        """Per sequence column, the sequence of the recorded delete of each row's key in
        ``data`` (null where none); None where no key of ``data`` has one."""
        if not (self._held and data.num_rows):
            return None
        keys = _rows([encode(data.column(k)) for k in key])
        found = [self._held.get(k) for k in keys]
        if not any(found):
            return None
        return [
            decode([None if f is None else f[0][n] for f in found], data.schema.field(column).type)
            for n, column in enumerate(sequence)
        ]


def recorded(data: Any, key: Sequence[str], sequence: Sequence[str]) -> dict[str, list[Any]] | None:
    """The deletes of the group ``data`` as a commit records them for :class:`Tombstones`
    (``{"keys": [...], "seqs": [...]}``, one value per column or a list for several); None
    without deletes."""
    if DELETE_COLUMN not in data.column_names:
        return None
    deletes = data.filter(data.column(DELETE_COLUMN))
    if not deletes.num_rows:
        return None
    keys = _rows([encode(deletes.column(k)) for k in key])
    seqs = _rows([encode(deletes.column(s)) for s in sequence])
    return {
        "keys": [list(k) if isinstance(k, tuple) else k for k in keys],
        "seqs": [list(s) if isinstance(s, tuple) else s for s in seqs],
    }


def merged_deletes(parts: Iterable[Mapping[str, list[Any]] | None]) -> dict[str, list[Any]] | None:
    """The deletes of several groups committed in one version, as one record."""
    keys: list[Any] = []
    seqs: list[Any] = []
    for part in parts:
        if part:
            keys.extend(part["keys"])
            seqs.extend(part["seqs"])
    return {"keys": keys, "seqs": seqs} if keys else None
