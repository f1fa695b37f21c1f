"""Bucket levels: a keyed table's bucket count grows with the table.

A fixed layout gives every keyed table ``buckets`` Delta partitions from its first row, so a
table of a few hundred rows is a hundred small files. A table created with
``deltaflow.bucketRows`` (:class:`Levels`) writes each group at the *level* its size calls
for: one bucket while it holds fewer than ``rows_per_bucket`` rows, then 2, 4, ... up to
``buckets`` as it grows. Levels are numbered as a binary heap, so files of several levels live
side by side and a bucket value names its level:

- level ``size`` (1, 2, 4 ... below ``buckets``, then ``buckets``) holds the values
  ``start(size) + p % size``, where ``start(size)`` is the power of two at or above ``size``
  and ``p`` the key's partition among ``buckets`` (``partition_of(key, buckets)``, the value
  a fixed layout stores);
- a key may be at any level, so the files that may hold it are those of its value at every
  level: at most 11 values (:meth:`Levels.candidates`), which the footprint and the MERGE
  predicates name;
- rows a commit copies out of the files it rewrites take the group's level
  (:meth:`Levels.place`), so a table's small buckets empty as their keys are written again,
  with no commit that moves them all.

Which level a writer chooses does not matter for correctness (every level is searched);
writers of one table agree on it up to the few rows their views of the table differ by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from ..partitioning import partition_table

__all__ = ["DEFAULT_BUCKET_ROWS", "Levels", "live_rows"]

#: Rows per bucket a table grows its levels by, unless created with another figure: a table
#: of 64 buckets has all of them from about 262,000 rows (docs/tables.md).
DEFAULT_BUCKET_ROWS: Final = 4096


def _start(size: int) -> int:
    """The first bucket value of level ``size``: the power of two at or above it."""
    return 1 << (size - 1).bit_length()


@dataclass(frozen=True, slots=True)
class Levels:
    """The bucket levels of a table of ``buckets`` buckets, grown by ``rows_per_bucket``."""

    buckets: int
    rows_per_bucket: int

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every level's bucket count, ascending: the powers of two below ``buckets``, then
        ``buckets``."""
        return _sizes(self.buckets)

    def size_for(self, rows: int) -> int:
        """The level of a table holding ``rows`` rows: the fewest buckets (a power of two, or
        ``buckets``) of at most ``rows_per_bucket`` rows each."""
        need = -(-max(rows, 1) // self.rows_per_bucket)
        size = _start(need)
        return self.buckets if size >= self.buckets else size

    def size_of(self, value: int) -> int:
        """The level a bucket value belongs to."""
        start = 1 << (int(value).bit_length() - 1)
        return self.buckets if start == _start(self.buckets) else start

    def place(self, partitions: Any, size: int) -> Any:
        """The bucket values (int32) at level ``size`` of keys in ``partitions`` (an Arrow or
        numpy array of ``partition_of(key, buckets)``)."""
        import numpy as np
        import pyarrow as pa

        p = np.asarray(partitions, dtype=np.int64)
        return pa.array((_start(size) + p % size).astype(np.int32), type=pa.int32())

    def partitions(self, data: Any, key: Sequence[str], column: str) -> Any:
        """``partition_of(key, buckets)`` of every row of ``data`` (numpy), from its bucket
        ``column`` when every row is at the top level, else from its key."""
        import numpy as np
        import pyarrow.compute as pc

        values = data.column(column).to_numpy().astype(np.int64)
        top = _start(self.buckets)
        if data.num_rows and int(pc.min(data.column(column)).as_py()) >= top:
            return values - top
        return partition_table(data, key, self.buckets).to_numpy().astype(np.int64)

    def candidates(self, partitions: Any) -> tuple[int, ...]:
        """The bucket values, at every level, of keys in ``partitions``: the buckets whose
        files may hold them."""
        import numpy as np

        p = np.unique(np.asarray(partitions, dtype=np.int64))
        found = {_start(size) + int(r) for size in self.sizes for r in np.unique(p % size)}
        return tuple(sorted(found))


def _sizes(buckets: int) -> tuple[int, ...]:
    sizes = []
    size = 1
    while size < buckets:
        sizes.append(size)
        size *= 2
    return (*sizes, buckets)


def live_rows(files: Any) -> int:
    """The rows of a table's live files (delta-rs's flattened listing, ``num_records``); the
    rows deletion vectors mark are counted too, which only makes a level come sooner."""
    import pyarrow.compute as pc

    if files is None or "num_records" not in files.column_names or not files.num_rows:
        return 0
    total = pc.sum(files.column("num_records")).as_py()
    return int(total or 0)
