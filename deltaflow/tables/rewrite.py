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

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote

from .._faults import fault_point
from ..columnar import DELETE_COLUMN
from ..partitioning import partition_table
from ..storage.paths import Location
from .data_files import (
    FILE_POOL,
    DataFile,
    RewriteUnsupported,
    add_action,
    bucket_of,
    files_holding,
    read_file,
    remove_action,
    write_buckets,
)
from .footprint import Footprint
from .history import as_group_rows, rebuild
from .layout import Levels
from .merging import LAST, MergeRule, merge_stored, merges_older
from .sequence import resolve
from .settings import BUCKET_COLUMN

__all__ = [
    "Rewrite",
    "RewriteUnsupported",
    "rewrite",
    "write_files",
]

#: Writer protocol versions whose every feature this writer honours (1: none; 2: invariants
#: and append-only, both checked below). Version 7 lists its features by name.
_SIMPLE_WRITER_VERSIONS: Final = (1, 2)
_SIMPLE_FEATURES: Final = frozenset({"appendOnly", "invariants"})
#: ... and with deletion vectors, which files that are only added (or, by merge-on-read,
#: given new vectors) honour; a copy-on-write of files that have them would not.
VECTOR_FEATURES: Final = _SIMPLE_FEATURES | {"deletionVectors"}
#: Table properties that, set to true, ask for what this writer does not do.
_UNSUPPORTED_IF_TRUE: Final = frozenset({"delta.appendOnly", "delta.enableChangeDataFeed"})


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


def write_files(
    table: Any,
    path: Location,
    data: Any,
    key: str | None,
    candidates: Any | None,
    sequence: Sequence[str] = (),
    rule: MergeRule = LAST,
    levels: Levels | None = None,
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
        levels: the table's bucket levels (:mod:`.layout`), if its layout grows: the rows
            kept from the files rewritten move to the level of the group's rows.

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
    kept = _Kept(levels, data, key)  # bucket value -> kept rows of its touched files
    if rule.history:
        assert key is not None and len(sequence) == 1
        return _write_history(
            path, data, key, sequence[0], candidates, file_schema, partition_by, rule, kept
        )
    touched: list[DataFile] = []  # the candidate files that hold a key of the group
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
                merging=merges_older(data, rule),
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
                kept.add(bucket, part.filter(pa.array(~hits)))

    upserts = data.filter(pc.invert(data.column(DELETE_COLUMN))).drop_columns([DELETE_COLUMN])
    adds = [added for added, _ in write_buckets(path, upserts, kept.rows, file_schema, key)]
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
    kept: _Kept,
) -> Rewrite:
    """:func:`write_files` for a ``history="scd2"`` table: the files holding the group's keys
    are read, every stored version of those keys replaced by the versions the group's changes
    and they make (:func:`.history.rebuild`)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    keys = data.column(key)
    touched: list[DataFile] = []
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
        kept.add(bucket, rows.filter(pc.invert(hits)))
    stored = pa.concat_tables(stored_parts) if stored_parts else file_schema.empty_table()
    versions = as_group_rows(rebuild(data, stored, key, sequence, rule.tracked or None), data, key)
    adds = [added for added, _ in write_buckets(path, versions, kept.rows, file_schema, key)]
    return Rewrite(adds, touched, partition_by, int(time.time() * 1000))


class _Kept:
    """The rows a rewrite keeps from the files it replaces, by the bucket they are written
    to: their own, or on a table with bucket levels the one at the group's level."""

    def __init__(self, levels: Levels | None, data: Any, key: str | None) -> None:
        self.rows: dict[str | None, list[Any]] = {}
        self._levels = levels
        self._key = key
        self._size = (
            levels.size_of(data.column(BUCKET_COLUMN)[0].as_py())
            if levels is not None and data.num_rows
            else None
        )

    def add(self, bucket: str | None, rest: Any) -> None:
        """Keep ``rest`` (rows of a file of ``bucket``; the table's file columns)."""
        if not rest.num_rows:
            return
        levels, size = self._levels, self._size
        if levels is None or size is None or bucket is None or levels.size_of(int(bucket)) == size:
            self.rows.setdefault(bucket, []).append(rest)
            return
        import numpy as np
        import pyarrow as pa

        assert self._key is not None
        placed = levels.place(partition_table(rest, [self._key], levels.buckets), size)
        values = placed.to_numpy()
        for value in np.unique(values):
            part = rest.filter(pa.array(values == value))
            self.rows.setdefault(str(int(value)), []).append(part)


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
    levels = None if footprint is None else footprint.levels
    done = write_files(table, path, data, column, files, sequence, rule, levels)
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
