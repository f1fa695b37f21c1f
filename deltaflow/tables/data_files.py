"""A table's data files as deltaflow writes and reads them: a group's rows written per bucket,
sorted by key, with Delta statistics; the log actions that add and remove them; the live files
that may hold a group's keys, read back in the table's columns.
"""

from __future__ import annotations

import json
import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from ..storage.paths import Location, open_input, open_output
from .settings import BUCKET_COLUMN

__all__ = [
    "FILE_POOL",
    "DataFile",
    "RewriteUnsupported",
    "add_action",
    "bucket_of",
    "files_holding",
    "read_file",
    "remove_action",
    "write_buckets",
]


class RewriteUnsupported(Exception):
    """This writer cannot apply the group: the table has a feature it does not implement, or
    a data file holds a type it does not convert. The group is merged instead; raised before
    any file is written."""


#: A touched file whose kept rows are fewer than this share of its bucket's new rows is
#: written with them (else it gets a file of its own): each carried row is then copied at
#: most a few times before its file is large enough to stand alone.
SMALL_REMAINDER: Final = 0.25


#: Files of fewer rows are written plain: no dictionary, no compression. Encoding them is
#: several times cheaper (docs/tables.md), and they are short-lived: a group's rows of one
#: bucket, merged with 7 others of their size tier into a file of the next tier (see
#: merge_on_read), which is written compressed once it reaches this size. A bucket keeps at
#: most 7 plain files per tier below it.
PLAIN_FILE_ROWS: Final = 4096


#: Reads and writes of data files (small ones cost more in opening than in bytes; pyarrow
#: releases the GIL for both). More threads than cores: on a store each file waits a round
#: trip, and a group's files (one per bucket it touches) should wait for it together.
FILE_POOL: Final = ThreadPoolExecutor(8, thread_name_prefix="deltaflow-rewrite")


@dataclass(frozen=True, slots=True)
class DataFile:
    """A data file of a group's commit: one written for it, or a live one it replaces.

    Attributes:
        path: relative to the table's root, as the Delta log holds it (the files written here
            have names that need no URI escaping).
        size: bytes.
        bucket: the bucket partition's value, None for a table without the layout.
        stats: the Delta statistics (JSON) of a written file; empty for a replaced one.
    """

    path: str
    size: int
    bucket: str | None
    stats: str = ""

    @property
    def partition_values(self) -> dict[str, str | None]:
        return {} if self.bucket is None else {BUCKET_COLUMN: self.bucket}


def add_action(
    f: DataFile, timestamp: int, stats: str, dv: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The log's ``add`` action of ``f`` (with the deletion vector ``dv``, if any)."""
    add: dict[str, Any] = {
        "path": f.path,
        "partitionValues": f.partition_values,
        "size": f.size,
        "modificationTime": timestamp,
        "dataChange": True,
        "stats": stats,
    }
    if dv is not None:
        add["deletionVector"] = dv
    return {"add": add}


def remove_action(f: DataFile, timestamp: int, dv: dict[str, Any] | None = None) -> dict[str, Any]:
    """The log's ``remove`` action of ``f``, whose current deletion vector is ``dv`` (a file
    is named by its path and its vector)."""
    remove: dict[str, Any] = {
        "path": f.path,
        "deletionTimestamp": timestamp,
        "dataChange": True,
        "extendedFileMetadata": True,
        "partitionValues": f.partition_values,
        "size": f.size,
    }
    if dv is not None:
        remove["deletionVector"] = dv
    return {"remove": remove}


def write_buckets(
    path: Location, upserts: Any, kept: dict[str | None, list[Any]], schema: Any, key: str | None
) -> list[tuple[DataFile, Any]]:
    """Write the new files of a group: per bucket, the group's rows ``upserts`` and the rows
    ``kept`` from files it replaces (:func:`_files_per_bucket`); each file with its rows."""
    parts = [
        (bucket, part)
        for bucket, new, alone in _files_per_bucket(upserts, kept, schema, key)
        for part in (new, *alone)
        if part.num_rows
    ]
    adds = FILE_POOL.map(lambda p: write_file(path, p[1], p[0], key), parts)
    return [(added, rows) for added, (_, rows) in zip(adds, parts, strict=True)]


def files_holding(files: Any, keys: Any, key: str) -> list[dict[str, Any]]:
    """The rows of ``files`` (the footprint's candidates) whose key range holds at least one
    of ``keys`` (a file without statistics holds them all, perhaps)."""
    import numpy as np
    import pyarrow.compute as pc

    listed = files.to_pylist()
    low, high = f"min.{key}", f"max.{key}"
    values = keys.take(pc.array_sort_indices(keys)).to_numpy(zero_copy_only=False)
    out = []
    for file in listed:
        lo, hi = file.get(low), file.get(high)
        if lo is None or hi is None:
            out.append(file)
            continue
        # Keys in [lo, hi]: the first key >= lo exists and is <= hi.
        at = int(np.searchsorted(values, lo, side="left"))
        if at < len(values) and values[at] <= hi:
            out.append(file)
    return out


def bucket_of(file: dict[str, Any]) -> str | None:
    value = file.get(f"partition.{BUCKET_COLUMN}")
    return None if value is None else str(value)


def read_file(file: Location, schema: Any) -> Any:
    """A data file's rows with exactly ``schema``'s columns (a column added to the table since
    the file was written is null in it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_input(file) as source:
        rows = pq.ParquetFile(source).read(use_threads=False)
    if rows.schema.equals(schema):
        return rows
    try:
        columns = [
            rows.column(f.name).cast(f.type)
            if f.name in rows.column_names
            else pa.nulls(rows.num_rows, type=f.type)
            for f in schema
        ]
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise RewriteUnsupported(f"{file.name}: {exc}") from exc
    return pa.Table.from_arrays(columns, schema=schema)


def _files_per_bucket(
    upserts: Any, kept: dict[str | None, list[Any]], schema: Any, key: str | None
) -> list[tuple[str | None, Any, list[Any]]]:
    """Per bucket: the rows of its new file (the group's rows and the small kept parts, sorted
    by key when there is one) and the kept parts that get files of their own."""
    import numpy as np
    import pyarrow as pa

    by_bucket: dict[str | None, Any] = {}
    if upserts.num_rows and BUCKET_COLUMN in upserts.column_names:
        order = [(BUCKET_COLUMN, "ascending")] + ([] if key is None else [(key, "ascending")])
        ordered = upserts.sort_by(order)
        buckets = ordered.column(BUCKET_COLUMN).to_numpy()
        data = ordered.select(schema.names).cast(schema)
        edges = np.flatnonzero(np.diff(buckets)) + 1
        for lo, hi in zip([0, *edges], [*edges, len(buckets)], strict=True):
            by_bucket[str(buckets[lo])] = data.slice(lo, hi - lo)
    elif upserts.num_rows:
        ordered = upserts if key is None else upserts.sort_by(key)
        by_bucket[None] = ordered.select(schema.names).cast(schema)
    out = []
    for bucket in by_bucket.keys() | kept.keys():
        new = by_bucket.get(bucket)
        parts: list[Any] = [] if new is None else [new]
        alone: list[Any] = []
        share = SMALL_REMAINDER * (0 if new is None else new.num_rows)
        for rest in kept.get(bucket, []):
            (parts if rest.num_rows < share else alone).append(rest)
        if len(parts) > 1:
            assert key is not None  # kept rows exist only for a group with a key
            parts = [pa.concat_tables(parts).sort_by(key)]
        out.append((bucket, parts[0] if parts else schema.empty_table(), alone))
    return out


def write_file(path: Location, rows: Any, bucket: str | None, key: str | None) -> DataFile:
    """Write ``rows`` as a new data file of the table at ``path``."""
    import pyarrow.parquet as pq

    directory = "" if bucket is None else f"{BUCKET_COLUMN}={bucket}/"
    relative = f"{directory}part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    target = path / relative
    output = open_output(target)
    with output as sink:
        if rows.num_rows < PLAIN_FILE_ROWS:
            pq.write_table(rows, sink, compression="none", use_dictionary=False)
        else:
            pq.write_table(rows, sink, compression="snappy")
    return DataFile(relative, output.size, bucket, json.dumps(_stats(rows, key)))


def _stats(rows: Any, key: str | None) -> dict[str, Any]:
    """The file's Delta statistics: the row count, null counts, and exact min/max of the key
    and of integer and floating-point columns (floats only without NaN). Other columns get
    none, which only costs readers the skipping of this file by them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    low: dict[str, Any] = {}
    high: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for field in rows.schema:
        column = rows.column(field.name)
        nulls[field.name] = column.null_count
        kind = field.type
        numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind)
        text = field.name == key and (pa.types.is_string(kind) or pa.types.is_large_string(kind))
        if not (numeric or text) or column.null_count == rows.num_rows:
            continue
        bounds = pc.min_max(column)
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        if pa.types.is_floating(kind) and (
            pc.any(pc.is_nan(column)).as_py() or not (math.isfinite(lo) and math.isfinite(hi))
        ):
            continue
        low[field.name], high[field.name] = lo, hi
    return {"numRecords": rows.num_rows, "minValues": low, "maxValues": high, "nullCount": nulls}
