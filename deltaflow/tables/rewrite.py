"""Copy-on-write by key range: the delta-rs engine's upsert of a group, with files cut so that
a rewrite never drags rows it does not change into the next one.

A MERGE (delta-rs or Spark) rewrites every file holding one of the group's keys, and writes
the rows it copies from those files into the same new file as the group's rows, one file per
partition. When groups do not line up with the files (they never do: a group is what arrived
during the previous commit), the new file holds the rest of the file the group straddled, and
the next group, whose keys continue from there, must rewrite it again, with everything it
has gathered: each bucket ends as one file rewritten by every commit, and merges grow slower
over a run (docs/tables.md).

Here the node does the copy itself, in one Delta commit of its own add and remove actions
(``DeltaTable.create_write_transaction``, under the table's commit lock):

1. the candidate files (those whose bucket and key statistics may hold a key of the group,
   :meth:`.Footprint.checked_against`) are read; a file holding none of the keys is left as it
   is;
2. the rows of a touched file whose key is not in the group are kept; the rows of the group
   that are not deletes are new;
3. per bucket, the new rows are written as one file sorted by key, together with the kept rows
   of small files (under a quarter of the new rows, so a carried row is copied a bounded number
   of times); the kept rows of a larger file get a file of their own, whose key range is then
   narrower than the one it replaces;
4. the touched files are removed and the new ones added in one commit that also carries the
   group's lane marks.

The result is the same as the MERGE's (the same table tests run through both paths). Tables
with features this writer does not implement are merged as before: deletion vectors, column
mapping, CHECK constraints, invariants, generated or identity columns, change data feed,
append-only tables, and keys of more than one column (no key range).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote

from .._faults import fault_point
from ..columnar import DELETE_COLUMN
from ..storage.paths import Location, open_input, open_output
from .footprint import Footprint
from .history import as_group_rows, rebuild
from .merging import LAST, MergeRule, merge_stored
from .sequence import resolve
from .settings import BUCKET_COLUMN

__all__ = [
    "DataFile",
    "Rewrite",
    "RewriteUnsupported",
    "rewrite",
    "write_buckets",
    "write_files",
]

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
#: Writer protocol versions whose every feature this writer honours (1: none; 2: invariants
#: and append-only, both checked below). Version 7 lists its features by name.
_SIMPLE_WRITER_VERSIONS: Final = (1, 2)
_SIMPLE_FEATURES: Final = frozenset({"appendOnly", "invariants"})
#: ... and with deletion vectors, which files that are only added (or, by merge-on-read,
#: given new vectors) honour; a copy-on-write of files that have them would not.
VECTOR_FEATURES: Final = _SIMPLE_FEATURES | {"deletionVectors"}
#: Table properties that, set to true, ask for what this writer does not do.
_UNSUPPORTED_IF_TRUE: Final = frozenset({"delta.appendOnly", "delta.enableChangeDataFeed"})
#: Reads and writes of data files (small ones cost more in opening than in bytes; pyarrow
#: releases the GIL for both). More threads than cores: on a store each file waits a round
#: trip, and a group's files (one per bucket it touches) should wait for it together.
FILE_POOL: Final = ThreadPoolExecutor(8, thread_name_prefix="deltaflow-rewrite")


class RewriteUnsupported(Exception):
    """This writer cannot apply the group: the table has a feature it does not implement, or
    a data file holds a type it does not convert. The group is merged instead; raised before
    any file is written."""


def unsupported_by(
    protocol: Any, config: Any, schema: Any, features_done: frozenset[str] = _SIMPLE_FEATURES
) -> str | None:
    """Why a table with this protocol, configuration and (Arrow) schema must be merged, or
    None (see the module docstring). ``features_done``: the writer features the caller
    honours."""
    writer = protocol.min_writer_version
    features = set(protocol.writer_features or ())
    if writer not in _SIMPLE_WRITER_VERSIONS and not (writer == 7 and features <= features_done):
        return f"writer protocol {writer} {sorted(features)}"
    for name, value in config.items():
        if name.startswith("delta.constraints."):
            return f"CHECK constraint {name}"
        if name in _UNSUPPORTED_IF_TRUE and str(value).lower() == "true":
            return f"{name} = true"
    if any(f.metadata and b"delta.invariants" in f.metadata for f in schema):
        return "column invariants"
    return None


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


@dataclass(frozen=True, slots=True)
class Rewrite:
    """A group applied as files, for one commit of add and remove actions by the engine's
    own transaction.

    Attributes:
        adds: the files written.
        removes: the live files they replace.
        partition_by: the table's partition columns.
        timestamp: milliseconds since the epoch, for the actions' times.
        superseded: rows of the group not applied: the table held a change of their key of a
            sequence at least as high (``sequence_by`` tables).
    """

    adds: list[DataFile]
    removes: list[DataFile]
    partition_by: list[str]
    timestamp: int
    superseded: int = 0

    def actions(self) -> list[dict[str, Any]]:
        """The commit's ``add`` and ``remove`` actions, as the Delta log holds them."""
        adds = [add_action(f, self.timestamp, f.stats) for f in self.adds]
        return adds + [remove_action(f, self.timestamp) for f in self.removes]


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


def write_files(
    table: Any,
    path: Location,
    data: Any,
    key: str | None,
    candidates: Any | None,
    sequence: Sequence[str] = (),
    rule: MergeRule = LAST,
) -> Rewrite:
    """Blocking, under the table's lock: write the files that apply the group ``data`` to
    ``table`` (delta-rs, at its latest version), nothing committed yet.

    Args:
        data: the group: the table's columns (the bucket column included for a bucketed
            table) and ``DELETE_COLUMN``; at most one row per key.
        key: the one key column (new files are sorted by it and carry exact bounds of it);
            None for a table without a one-column key, whose group is only appended.
        candidates: the live files that may hold one of the group's keys
            (:attr:`.Footprint.files`); None when it holds none (the group is appended).
        sequence: the table's sequence columns: a stored row whose sequence is not lower
            than the group's row of its key is kept, and the group's row dropped
            (:func:`.sequence.resolve`).
        rule: the table's merge mode: a group row meeting its key's stored row merges with it
            (:func:`.merging.merge_stored`).

    Raises:
        RewriteUnsupported: the group must be merged (nothing was written).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    assert key is not None or candidates is None
    metadata = table.metadata()
    schema = pa.schema(table.schema().to_arrow())
    # Files only added (a group of new keys) honour deletion vectors; replaced ones would not.
    done = _SIMPLE_FEATURES if candidates is not None else VECTOR_FEATURES
    reason = unsupported_by(table.protocol(), metadata.configuration, schema, done)
    if reason is not None:
        raise RewriteUnsupported(reason)
    partition_by = list(metadata.partition_columns)
    if set(partition_by) - {BUCKET_COLUMN}:  # the files written carry the bucket value only
        raise RewriteUnsupported(f"partitioned by {partition_by}")
    file_schema = pa.schema([f for f in schema if f.name not in partition_by])
    if rule.history:
        assert key is not None and len(sequence) == 1
        return _write_history(
            path, data, key, sequence[0], candidates, file_schema, partition_by, rule
        )
    touched: list[DataFile] = []  # the candidate files that hold a key of the group
    kept: dict[str | None, list[Any]] = {}  # bucket value -> kept rows of its touched files
    superseded = 0
    if key is not None and candidates is not None:
        keys = data.column(key)
        holding = files_holding(candidates, keys, key)
        read = list(
            FILE_POOL.map(lambda f: read_file(path / unquote(f["path"]), file_schema), holding)
        )
        if read:
            rows = pa.concat_tables(read)
            # One hash set for every file: the stored rows the group replaces (or deletes).
            replaced, losers, group_of = resolve(
                keys,
                [data.column(c) for c in sequence] if sequence else None,
                rows.column(key),
                [rows.column(c) for c in sequence] if sequence else None,
            )
            if rule.folds and replaced.any():  # the stored rows the group merges with
                hits = np.flatnonzero(replaced)
                data, still, dropped = merge_stored(
                    data, rows.take(pa.array(hits)), group_of[hits], rule, [key], sequence
                )
                replaced[hits[~still]] = False
                losers |= dropped
            if losers.any():  # the table holds a newer change of these keys
                superseded = int(losers.sum())
                data = data.filter(pa.array(~losers))
            start = 0
            for file, part in zip(holding, read, strict=True):
                hits = replaced[start : start + part.num_rows]
                start += part.num_rows
                if not hits.any():
                    continue  # its range holds a key of the group, its rows do not
                bucket = bucket_of(file)
                touched.append(DataFile(file["path"], int(file["size_bytes"]), bucket))
                rest = part.filter(pa.array(~hits))
                if rest.num_rows:
                    kept.setdefault(bucket, []).append(rest)

    upserts = data.filter(pc.invert(data.column(DELETE_COLUMN))).drop_columns([DELETE_COLUMN])
    adds = [added for added, _ in write_buckets(path, upserts, kept, file_schema, key)]
    return Rewrite(adds, touched, partition_by, int(time.time() * 1000), superseded)


def _write_history(
    path: Location,
    data: Any,
    key: str,
    sequence: str,
    candidates: Any | None,
    file_schema: Any,
    partition_by: list[str],
    rule: MergeRule,
) -> Rewrite:
    """:func:`write_files` for a ``history="scd2"`` table: the files holding the group's keys
    are read, every stored version of those keys replaced by the versions the group's changes
    and they make (:func:`.history.rebuild`)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    keys = data.column(key)
    touched: list[DataFile] = []
    kept: dict[str | None, list[Any]] = {}
    stored_parts = []
    holding = [] if candidates is None else files_holding(candidates, keys, key)
    read = FILE_POOL.map(lambda f: read_file(path / unquote(f["path"]), file_schema), holding)
    for file, rows in zip(holding, read, strict=True):
        hits = pc.is_in(rows.column(key), value_set=keys)
        if not pc.any(hits).as_py():
            continue
        bucket = bucket_of(file)
        touched.append(DataFile(file["path"], int(file["size_bytes"]), bucket))
        stored_parts.append(rows.filter(hits))
        rest = rows.filter(pc.invert(hits))
        if rest.num_rows:
            kept.setdefault(bucket, []).append(rest)
    stored = pa.concat_tables(stored_parts) if stored_parts else file_schema.empty_table()
    versions = as_group_rows(rebuild(data, stored, key, sequence, rule.tracked or None), data, key)
    adds = [added for added, _ in write_buckets(path, versions, kept, file_schema, key)]
    return Rewrite(adds, touched, partition_by, int(time.time() * 1000))


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
    adds = FILE_POOL.map(lambda p: _write_file(path, p[1], p[0], key), parts)
    return [(added, rows) for added, (_, rows) in zip(adds, parts, strict=True)]


def rewrite(
    table: Any,
    path: Location,
    data: Any,
    footprint: Footprint | None,
    commit_properties: Any,
    post_commithook_properties: Any = None,
    sequence: Sequence[str] = (),
    rule: MergeRule = LAST,
    key: str | None = None,
) -> Rewrite:
    """Blocking, under the table's lock: apply the group ``data`` to ``table`` (delta-rs, at
    its latest version) in one delta-rs commit, by copy-on-write of the files holding its keys
    (see :func:`write_files`).

    Args:
        footprint: the group's footprint on its one key column, checked against the live
            files (``column`` and ``files`` set).
        commit_properties: the commit's properties (its ``userMetadata`` carries the marks).
        post_commithook_properties: delta-rs's hooks after the commit (checkpoint, log
            cleanup); None for its defaults.
        sequence, rule: the table's sequence columns and merge mode (see
            :func:`write_files`).
        key: with ``footprint`` None (no live file can hold a key of the group), the key
            column: the group's files are only added.

    Returns what was written and removed.

    Raises:
        RewriteUnsupported: the group must be merged (nothing was written).
    """
    from deltalake.transaction import AddAction, RemoveAction

    if footprint is None:
        column, files = key, None
    elif footprint.column is None or footprint.files is None:
        raise RewriteUnsupported("no key range to rewrite by")
    else:
        column, files = footprint.column, footprint.files
    done = write_files(table, path, data, column, files, sequence, rule)
    actions: list[Any] = [
        AddAction(
            path=f.path,
            size=f.size,
            partition_values=f.partition_values,
            modification_time=done.timestamp,
            data_change=True,
            stats=f.stats,
        )
        for f in done.adds
    ]
    actions += [
        RemoveAction(
            path=f.path,
            data_change=True,
            deletion_timestamp=done.timestamp,
            size=f.size,
            partition_values=f.partition_values or None,
        )
        for f in done.removes
    ]
    # Committed even without actions (deletes of keys no file holds): the lane marks must land.
    fault_point("before_commit")
    table.create_write_transaction(
        actions,
        mode="append",
        schema=table.schema(),
        partition_by=done.partition_by or None,
        commit_properties=commit_properties,
        post_commithook_properties=post_commithook_properties,
    )
    return done


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


def _write_file(path: Location, rows: Any, bucket: str | None, key: str | None) -> DataFile:
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
