"""Where a group of rows can be in its table: what lets a commit read and rewrite little.

A MERGE reads, and rewrites, every target file that may hold one of its keys. Delta skips
files by partition values and by the min/max statistics it keeps per file, but only with
literal predicates on target columns, never through the join itself. So the engine describes
each group by its :class:`Footprint` and every MERGE names it:

- the buckets its rows fall in (partition pruning): the group a node commits touches only the
  files of the partitions it owns; on a table whose buckets grow with it (:mod:`.layout`),
  the buckets of its keys at every level;
- the ranges its keys fall in (statistics pruning), for a one-column integer or string key.
  Keys that arrive roughly in order (auto-increment or time-ordered ids, recent records
  updated again) then fall in few files, and the MERGE reads and rewrites only those, however
  large the table. Integer keys are cut into at most :data:`MAX_KEY_RANGES` ranges at their
  widest gaps, so a group of new keys and a few old ones does not span the table. Keys spread
  uniformly over the table gain nothing, and lose nothing.

The same statistics answer a second question before any MERGE: can the table hold any of the
group's keys at all? When no live file's key range (in the group's buckets) meets the group's,
every key is new, and the group is *appended* (its deletes dropped: they delete nothing), which
costs Spark about half a MERGE and delta-rs less still (see docs/tables.md). The answer comes
from the Delta log, read under the table's commit lock, so no other deltaflow commit can add
one of those keys before the append lands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from .layout import Levels
from .settings import BUCKET_COLUMN

__all__ = ["MAX_KEY_RANGES", "Footprint"]

#: The most key ranges one MERGE names.
MAX_KEY_RANGES: Final = 8


@dataclass(frozen=True, slots=True)
class Footprint:
    """Where a group's rows can be in the target table (see the module docstring).

    Attributes:
        buckets: the buckets the group's keys may be in, ascending (with ``levels``, their
            buckets at every level); None for a table without the bucket layout.
        column: the key column ``ranges`` bound; None when no range applies.
        ranges: inclusive ``(low, high)`` bounds, ascending and disjoint, covering every key.
        fresh: the table holds none of the group's keys (checked against the Delta log under
            the table's lock): the group is appended, not merged.
        files: after :meth:`checked_against`, the live files that may hold one of the group's
            keys (the rows of the file list it was given), else None.
        vectors: the deletion vector descriptor of every live file that has one (path as in
            the log), for a merge-on-read commit that replaces them; None when they could not
            be read at the files' version.
        version: the table version ``files`` and ``vectors`` are of (-1: unknown).
        levels: the table's bucket levels, when its layout grows with it: a stored row of a
            key may then be in another bucket than the group's row.
    """

    buckets: tuple[int, ...] | None
    column: str | None = None
    ranges: tuple[tuple[Any, Any], ...] = ()
    fresh: bool = False
    files: Any = dataclasses.field(default=None, compare=False, repr=False)
    vectors: Mapping[str, Mapping[str, Any]] | None = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )
    version: int = dataclasses.field(default=-1, compare=False)
    levels: Levels | None = None

    @classmethod
    def of(
        cls,
        data: Any,
        key: Sequence[str],
        *,
        bucketed: bool,
        levels: Levels | None = None,
        max_ranges: int = MAX_KEY_RANGES,
    ) -> Footprint:
        """The footprint of the group ``data`` (an Arrow table, the bucket column included when
        ``bucketed``) merged on ``key``, on a table with bucket ``levels`` or a fixed
        layout (None)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        buckets = None
        if bucketed and levels is not None:
            buckets = levels.candidates(levels.partitions(data, key, BUCKET_COLUMN))
        elif bucketed:
            buckets = tuple(sorted(pc.unique(data.column(BUCKET_COLUMN)).to_pylist()))
        if len(key) != 1 or data.num_rows == 0:
            return cls(buckets, levels=levels)
        column = data.column(key[0])
        if pa.types.is_integer(column.type):
            ranges = _integer_ranges(column, max_ranges)
        elif pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            bounds = pc.min_max(column)
            ranges = ((bounds["min"].as_py(), bounds["max"].as_py()),)
        else:
            return cls(buckets, levels=levels)
        return cls(buckets, key[0], ranges, levels=levels)

    def checked_against(
        self,
        files: Any,
        vectors: Mapping[str, Mapping[str, Any]] | None = None,
        version: int = -1,
    ) -> Footprint:
        """This footprint with the ``files`` that may hold one of its keys, and ``fresh`` if
        none may.

        Args:
            files: the table's live files, as delta-rs lists them
                (``DeltaTable.get_add_actions(flatten=True)``): ``min.<column>`` and
                ``max.<column>`` statistics, ``partition.<bucket column>`` for the layout. A
                file without statistics for the key may hold any key.
            vectors: the live files' deletion vectors (see :attr:`vectors`).
            version: the table version of ``files`` and ``vectors``.
        """
        import pyarrow as pa
        import pyarrow.compute as pc

        if self.column is None or not self.ranges:
            return self
        files = pa.table(files)
        low, high = f"min.{self.column}", f"max.{self.column}"
        if files.num_rows and (low not in files.column_names or high not in files.column_names):
            return dataclasses.replace(self, files=files, vectors=vectors, version=version)
        may = pa.repeat(pa.scalar(False), files.num_rows)
        if files.num_rows:
            lows, highs = files.column(low), files.column(high)
            for lo, hi in self.ranges:
                meets = pc.and_kleene(pc.less_equal(lows, hi), pc.greater_equal(highs, lo))
                may = pc.or_(may, pc.fill_null(meets, True))  # no statistics: may hold it
            # Only files of the group's buckets can hold its keys.
            bucket = f"partition.{BUCKET_COLUMN}"
            if self.buckets is not None and bucket in files.column_names:
                mine = pc.is_in(files.column(bucket), value_set=pa.array(self.buckets, pa.int32()))
                may = pc.and_(may, pc.fill_null(mine, False))
        candidates = files.filter(may)
        fresh = candidates.num_rows == 0
        return dataclasses.replace(
            self, files=candidates, fresh=fresh, vectors=vectors, version=version
        )

    def merge_condition(
        self, key: Sequence[str], quote: Callable[[str], str], literal: Callable[[Any], str]
    ) -> str:
        """The MERGE's ON clause, target ``t`` and source ``s``, in an engine's SQL dialect
        (``quote`` quotes a column name, ``literal`` renders a key value): the key equalities,
        the bucket equality (so the join can use the partition column), and the footprint's
        literal predicates on the target, which are what prune its files. With bucket levels
        a stored row may be at another level than the group's, so the buckets are named but
        not joined. A footprint of no bucket (a group of no rows) matches nothing: ``FALSE``,
        though the writer commits such a group without a MERGE."""
        on = [f"t.{quote(k)} = s.{quote(k)}" for k in key]
        if self.buckets is not None:
            b = quote(BUCKET_COLUMN)
            listed = ", ".join(str(int(x)) for x in self.buckets)
            if self.levels is None:
                on.append(f"t.{b} = s.{b}")
            # No bucket (a group of no rows) matches nothing; SQL has no empty IN list.
            on.append(f"t.{b} IN ({listed})" if listed else "FALSE")
        if self.column is not None and self.ranges:
            c = f"t.{quote(self.column)}"
            # Comparisons, not BETWEEN: delta-rs keeps only comparisons for file pruning.
            terms = [
                f"{c} = {literal(lo)}"
                if lo == hi
                else f"({c} >= {literal(lo)} AND {c} <= {literal(hi)})"
                for lo, hi in self.ranges
            ]
            on.append(terms[0] if len(terms) == 1 else f"({' OR '.join(terms)})")
        return " AND ".join(on)


def _integer_ranges(column: Any, limit: int) -> tuple[tuple[int, int], ...]:
    """At most ``limit`` inclusive ranges covering the integers of ``column``, cut at the
    widest gaps between them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = pc.unique(column)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    values = values.take(pc.array_sort_indices(values))
    if len(values) == 1 or limit == 1:
        return ((values[0].as_py(), values[-1].as_py()),)
    # Float gaps: exact enough to rank them, and no overflow at the ends of int64.
    wide = values.cast(pa.float64())
    gaps = pc.subtract(wide.slice(1), wide.slice(0, len(wide) - 1))
    widest = pc.array_sort_indices(gaps, order="descending")[: limit - 1].to_pylist()
    cuts = sorted(i for i in widest if gaps[i].as_py() > 1)
    ranges = []
    start = 0
    for cut in cuts:  # a cut between values[cut] and values[cut + 1]
        ranges.append((values[start].as_py(), values[cut].as_py()))
        start = cut + 1
    ranges.append((values[start].as_py(), values[-1].as_py()))
    return tuple(ranges)
