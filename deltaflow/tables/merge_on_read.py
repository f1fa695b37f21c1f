"""Merge-on-read: a group applied by writing its new rows once and marking the rows they
replace in deletion vectors, for tables with deletion vectors enabled.

The copy-on-write of :mod:`.rewrite` reads every file holding one of the group's keys and
writes its kept rows again; under load that is most of a commit (an update group over 32
buckets read about 90 small files and wrote about 70). Here a commit writes only the group's
rows (one file per bucket it touches) and, for each file holding one of its keys, a new
deletion vector: the file's previous one plus the rows whose key the group carries. All the
commit's vectors go into one ``deletion_vector_<uuid>.bin`` (:class:`.DvWriter`).

Which rows of a file hold the group's keys comes from the file's key column, kept in memory
per node (:class:`KeyColumns`): data files never change, so a key column read once (or kept
from the rows the node wrote) stays true for as long as the file is live; a commit reads
only the key columns of files it has not seen. The rows already deleted are the file's
current vector, whose descriptor the log reader tracks (:class:`.LaneMarks`) and whose bitmap
is kept beside the key column.

A file whose rows are all deleted is removed. The vectors make every later read of the file
skip its deleted rows.

Every commit adds a file to each bucket it touches, so a long stream would pile files (and
the vectors a commit rewrites) up without end. The commit therefore also merges, per bucket,
the smallest size tier once it holds :data:`MERGE_FILES_AT` files (row counts within a factor
of :data:`TIER_FACTOR`): their live rows are written as one file of the next tier, and they
are removed. A bucket keeps a few files per tier, and a row is copied once per tier it climbs
(a log-structured merge). ``deltaflow table optimize`` compacts a table fully on demand.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import unquote

from ..columnar import DELETE_COLUMN
from ..errors import CommitConflictError
from ..storage.paths import Location, open_input
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
from .deletion_vectors import DvWriter, descriptor_id, read
from .footprint import Footprint
from .history import as_group_rows, rebuild
from .merging import LAST, MergeRule, merge_stored, merges_older
from .rewrite import VECTOR_FEATURES, unsupported_by
from .sequence import resolve
from .settings import BUCKET_COLUMN, PROP_DELETION_VECTORS

__all__ = [
    "KEY_MEMORY_BYTES",
    "DvChange",
    "KeyColumns",
    "MergeOnRead",
    "has_deletion_vectors",
    "vectors_at",
    "write_group",
    "write_merge_on_read",
]

#: A bucket with this many files of one size tier has them merged into one by the commit.
MERGE_FILES_AT: Final = 8
#: Files whose row counts are within this factor are of one tier.
TIER_FACTOR: Final = 8
#: Key columns kept per table and node before the least recently used are dropped (bytes).
KEY_MEMORY_BYTES: Final = 256 * 1024 * 1024


@dataclass(slots=True)
class _Known:
    keys: Any  # the file's key column, in file order (pyarrow Array)
    deleted: Any = None  # BitMap64 of the vector ``descriptor`` names, once read
    descriptor_id: str | None = None
    stats: str = ""  # the add action's statistics, for files this node wrote
    sequence: list[Any] | None = None  # its sequence columns (``sequence_by`` tables)


@dataclass
class KeyColumns:
    """Per table, on one node: the key columns (and current deletion vectors) of data files,
    kept between commits (see the module docstring)."""

    budget: int = KEY_MEMORY_BYTES
    _files: OrderedDict[str, _Known] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def get(self, path: str) -> _Known | None:
        known = self._files.get(path)
        if known is not None:
            self._files.move_to_end(path)
        return known

    def put(self, path: str, known: _Known) -> None:
        old = self._files.pop(path, None)
        if old is not None:
            self._bytes -= old.keys.nbytes
        self._files[path] = known
        self._bytes += known.keys.nbytes
        while self._bytes > self.budget and len(self._files) > 1:
            _, dropped = self._files.popitem(last=False)
            self._bytes -= dropped.keys.nbytes

    def forget(self, paths: Iterable[str]) -> None:
        """Forget files no longer live."""
        for path in paths:
            known = self._files.pop(path, None)
            if known is not None:
                self._bytes -= known.keys.nbytes


@dataclass(frozen=True, slots=True)
class DvChange:
    """A live file whose deletion vector a commit replaces."""

    file: DataFile
    old: dict[str, Any] | None  # its current descriptor (None: no vector yet)
    new: dict[str, Any] | None  # the new one; None when every row is deleted (removed)
    stats: str


@dataclass(frozen=True, slots=True)
class MergeOnRead:
    """A group applied by merge-on-read, for one commit of the engine's own.

    Attributes:
        adds: the new files (the group's rows, and the live rows of merged files).
        changes: the files whose deletion vectors change.
        timestamp: milliseconds since the epoch.
        superseded: rows of the group not applied: the table held a change of their key of a
            sequence at least as high (``sequence_by`` tables).
    """

    adds: list[DataFile]
    changes: list[DvChange]
    timestamp: int
    superseded: int = 0

    @property
    def removed(self) -> list[str]:
        """The files no longer live once the commit lands (every row deleted, or merged)."""
        return [c.file.path for c in self.changes if c.new is None]

    def actions(self) -> list[dict[str, Any]]:
        """The commit's ``add`` and ``remove`` actions, as the Delta log holds them."""
        out: list[dict[str, Any]] = []
        for change in self.changes:
            out.append(remove_action(change.file, self.timestamp, change.old))
            if change.new is not None:
                out.append(add_action(change.file, self.timestamp, change.stats, change.new))
        return out + [add_action(f, self.timestamp, f.stats) for f in self.adds]


def vectors_at(footprint: Footprint, version: int, table: str, node: str) -> dict[str, Any]:
    """The live files' deletion vectors the footprint carries, checked to be of the table
    ``version`` the commit is planned on: a remove must name a file's current vector, and a
    writer outside deltaflow (not holding the lock) may have committed in between.

    Raises:
        CommitConflictError: they are of another version (the group is planned again).
    """
    if footprint.vectors is None or footprint.version != version:
        raise CommitConflictError(
            f"table {table!r} moved to version {version} while this group's files were "
            f"listed at version {footprint.version}",
            node=node,
        )
    return {path: dict(dv) for path, dv in footprint.vectors.items()}


def has_deletion_vectors(table: Any) -> bool:
    """Whether the delta-rs ``table`` has deletion vectors enabled (the feature in its
    protocol, and ``delta.enableDeletionVectors``): its groups are applied by merge-on-read."""
    config = table.metadata().configuration
    if str(config.get(PROP_DELETION_VECTORS, "false")).lower() != "true":
        return False
    return "deletionVectors" in (table.protocol().writer_features or ())


def write_merge_on_read(
    table: Any,
    path: Location,
    data: Any,
    key: str,
    candidates: Any | None,
    vectors: dict[str, dict[str, Any]],
    memory: KeyColumns,
    written: list[tuple[DataFile, Any]] | None = None,
    sequence: Sequence[str] = (),
    rule: MergeRule = LAST,
) -> MergeOnRead:
    """Blocking, under the table's lock: write the new files and the deletion vector file
    that apply the group ``data`` to ``table`` (delta-rs, at its latest version); nothing is
    committed yet.

    Args:
        data: the group: the table's columns (the bucket column included for a bucketed
            table) and ``DELETE_COLUMN``; at most one row per key.
        key: the one key column.
        candidates: the live files that may hold one of the group's keys
            (:attr:`.Footprint.files`), or None when none may.
        vectors: the current deletion vector descriptor of every live file that has one
            (path as in the log -> descriptor), from the log.
        memory: this node's key columns of the table's files.
        written: the group's new files, already written by :func:`write_group` (outside the
            lock); None to write them here (always, with ``sequence``).
        sequence: the table's sequence columns: a live stored row whose sequence is not
            lower than the group's row of its key stays, and the group's row is dropped
            (:func:`.sequence.resolve`).
        rule: the table's merge mode: a group row meeting its key's stored row merges with it
            (:func:`.merging.merge_stored`; the rows met are read from their files).

    Raises:
        RewriteUnsupported: the table has a feature this writer does not honour (nothing was
            written).
    """
    import numpy as np
    import pyarrow as pa
    from pyroaring import BitMap64

    metadata = table.metadata()
    schema = pa.schema(table.schema().to_arrow())
    reason = unsupported_by(table.protocol(), metadata.configuration, schema, VECTOR_FEATURES)
    if reason is not None:
        raise RewriteUnsupported(reason)
    partition_by = list(metadata.partition_columns)
    if set(partition_by) - {BUCKET_COLUMN}:
        raise RewriteUnsupported(f"partitioned by {partition_by}")
    file_schema = pa.schema([f for f in schema if f.name not in partition_by])
    keys = data.column(key)
    writer = DvWriter(path)
    changes: list[DvChange] = []

    kept: dict[str | None, list[Any]] = {}  # bucket -> live rows of the files merged away
    superseded = 0
    holding = [] if candidates is None else files_holding(candidates, keys, key)
    stored_versions = file_schema.empty_table()  # history="scd2": the versions met
    # A history's changes are slotted in, never compared against one stored row.
    compared = () if rule.history else tuple(sequence)
    if holding:
        assert written is None or not sequence
        # Held here too: the memory may drop some of them again when over its budget.
        known = {f["path"]: memory.get(f["path"]) for f in holding}
        unseen = [f for f in holding if _unknown(known[f["path"]], bool(compared))]
        columns_read = FILE_POOL.map(
            lambda f: _read_keys(path / unquote(f["path"]), [key, *compared]), unseen
        )
        for f, read_columns in zip(unseen, columns_read, strict=True):
            read_now = known[f["path"]] = _Known(read_columns[0].cast(keys.type))
            if compared:
                read_now.sequence = [
                    c.cast(data.schema.field(name).type)
                    for c, name in zip(read_columns[1:], compared, strict=True)
                ]
            memory.put(f["path"], read_now)
        files = [(f, k) for f in holding if (k := known[f["path"]]) is not None]
        stored = [k for _, k in files]
        live = stored_sequence = None
        if compared:
            # Rows a vector deleted already hold no sequence against the group.
            live = np.concatenate([_live(path, k, vectors.get(f["path"])) for f, k in files])
            stored_sequence = [
                pa.chunked_array([k.sequence[i] for k in stored if k.sequence is not None])
                for i in range(len(compared))
            ]
        if (rule.folds or rule.history) and live is None:  # (deleted rows hold no value)
            live = np.concatenate([_live(path, k, vectors.get(f["path"])) for f, k in files])
        hits, losers, group_of = resolve(
            keys,
            [data.column(c) for c in compared] if compared else None,
            pa.chunked_array([k.keys for k in stored], type=keys.type),
            stored_sequence,
            live,
            merges_older(data, rule),
        )
        if rule.history:  # every stored version of the group's keys
            at = np.flatnonzero(hits)
            if len(at):
                stored_versions = _stored_rows(path, files, at, file_schema)
        elif rule.folds and hits.any():  # the stored rows the group merges with
            at = np.flatnonzero(hits)
            found = _stored_rows(path, files, at, file_schema)
            data, still, dropped = merge_stored(data, found, group_of[at], rule, [key], sequence)
            hits[at[~still]] = False
            losers |= dropped
        if losers.any():  # the table holds a newer change of these keys: not applied
            superseded = int(losers.sum())
            data = data.filter(pa.array(~losers))
        merging = _tier_to_merge(holding)
        merged: list[tuple[dict[str, Any], Any]] = []  # (file, its rows deleted from now on)
        start = 0
        for f, k in files:
            rows = np.flatnonzero(hits[start : start + len(k.keys)])
            start += len(k.keys)
            if not len(rows) and f["path"] not in merging:
                continue
            old = vectors.get(f["path"])
            deleted = _deleted(path, k, old)
            now = deleted | BitMap64(rows.tolist()) if len(rows) else deleted
            file = DataFile(f["path"], int(f["size_bytes"]), bucket_of(f))
            stats = _loosened(k.stats) if k.stats else _wide_stats(f, key, len(k.keys))
            if f["path"] in merging:  # removed; its live rows go into the bucket's new files
                changes.append(DvChange(file, old, None, stats))
                merged.append((f, now))
                continue
            if len(now) == len(deleted):
                continue  # only rows deleted before
            if len(now) >= len(k.keys):
                changes.append(DvChange(file, old, None, stats))
                continue
            new = writer.add(now)
            changes.append(DvChange(file, old, new, stats))
            k.deleted, k.descriptor_id = now, descriptor_id(new)
        read_rows = FILE_POOL.map(
            lambda m: read_file(path / unquote(m[0]["path"]), file_schema), merged
        )
        for (f, now), rows in zip(merged, read_rows, strict=True):
            live = np.ones(rows.num_rows, dtype=bool)
            live[np.frombuffer(now.to_array(), dtype=np.uint64).astype(np.int64)] = False
            if live.any():
                kept.setdefault(bucket_of(f), []).append(rows.filter(pa.array(live)))

    if rule.history:  # the group's changes and the stored versions make the versions anew
        versions = rebuild(data, stored_versions, key, sequence[0], rule.tracked or None)
        data = as_group_rows(versions, data, key)
    # A bucket's merged rows make one file (with the group's rows when they are few and not
    # written yet).
    gathered = {b: [pa.concat_tables(rows).sort_by(key)] for b, rows in kept.items()}
    if written is None:
        written = write_group(path, data, file_schema, key, gathered)
    elif gathered:
        written = written + write_group(path, data.slice(0, 0), file_schema, key, gathered)
    adds = []
    for added, rows in written:
        order = [rows.column(c).combine_chunks() for c in sequence] if sequence else None
        memory.put(
            added.path,
            _Known(rows.column(key).combine_chunks(), stats=added.stats, sequence=order),
        )
        adds.append(added)
    if any(c.new is not None for c in changes):
        writer.write()
    return MergeOnRead(adds, changes, int(time.time() * 1000), superseded)


def write_group(
    path: Location,
    data: Any,
    schema: Any,
    key: str,
    kept: dict[str | None, list[Any]] | None = None,
) -> list[tuple[DataFile, Any]]:
    """Blocking, needing no lock: write the group ``data``'s rows that are not deletes as new
    data files of the table at ``path`` (one per bucket, sorted by ``key``, with the file
    ``schema``: the table's columns without its partition columns), and the rows ``kept``
    per bucket; each file with its rows. Nothing refers to them until a commit adds them."""
    import pyarrow.compute as pc

    upserts = data.filter(pc.invert(data.column(DELETE_COLUMN))).drop_columns([DELETE_COLUMN])
    return write_buckets(path, upserts, kept or {}, schema, key)


def _tier_to_merge(files: list[dict[str, Any]]) -> set[str]:
    """The files (paths) to merge into one per bucket in this commit: in each bucket, the
    smallest size tier (row counts within a factor of :data:`TIER_FACTOR`) holding
    :data:`MERGE_FILES_AT` files or more, if any. Each commit adds a file to every bucket it
    touches; merging tier by tier keeps a bucket to a few files per tier (and a commit's
    vectors to as many), while a row is copied once per tier it climbs."""
    tiers: dict[tuple[str | None, int], list[str]] = {}
    for f in files:
        rows = f.get("num_records")
        if rows is None:
            continue
        tier = int(math.log(max(int(rows), 1), TIER_FACTOR))
        tiers.setdefault((bucket_of(f), tier), []).append(f["path"])
    lowest: dict[str | None, tuple[int, list[str]]] = {}
    for (bucket, tier), paths in tiers.items():
        if len(paths) >= MERGE_FILES_AT and (bucket not in lowest or tier < lowest[bucket][0]):
            lowest[bucket] = (tier, paths)
    return {p for _, paths in lowest.values() for p in paths}


def _deleted(table: Location, known: _Known, descriptor: dict[str, Any] | None) -> Any:
    """The rows a file's current vector deletes (kept beside its key column once read)."""
    from pyroaring import BitMap64

    if descriptor is None:
        return BitMap64()
    ident = descriptor_id(descriptor)
    if known.deleted is None or known.descriptor_id != ident:
        known.deleted, known.descriptor_id = read(table, descriptor), ident
    return known.deleted


def _read_keys(file: Location, columns: list[str]) -> list[Any]:
    """The ``columns`` (the key, and the sequence columns) of a data file."""
    import pyarrow.parquet as pq

    with open_input(file) as source:
        rows = pq.ParquetFile(source).read(columns=columns, use_threads=False)
    return [rows.column(c).combine_chunks() for c in columns]


def _stored_rows(
    table: Location, files: list[tuple[dict[str, Any], _Known]], at: Any, schema: Any
) -> Any:
    """The rows at positions ``at`` (ascending) of the files' rows, in that order, read from
    the files that hold them."""
    import numpy as np
    import pyarrow as pa

    wanted: list[tuple[dict[str, Any], Any]] = []
    start = 0
    for f, k in files:
        end = start + len(k.keys)
        mine = at[(at >= start) & (at < end)] - start
        if len(mine):
            wanted.append((f, mine))
        start = end
    read = FILE_POOL.map(lambda w: read_file(table / unquote(w[0]["path"]), schema), wanted)
    parts = [
        rows.take(pa.array(np.asarray(mine))) for (_, mine), rows in zip(wanted, read, strict=True)
    ]
    return pa.concat_tables(parts)


def _unknown(known: _Known | None, sequence: bool) -> bool:
    """Whether a file's columns must be read (not kept, or kept without its sequence)."""
    return known is None or (sequence and known.sequence is None)


def _live(table: Location, known: _Known, descriptor: dict[str, Any] | None) -> Any:
    """Per row of a file, whether its current deletion vector keeps it (numpy bools)."""
    import numpy as np

    live = np.ones(len(known.keys), dtype=bool)
    deleted = _deleted(table, known, descriptor)
    if len(deleted):
        live[np.frombuffer(deleted.to_array(), dtype=np.uint64).astype(np.int64)] = False
    return live


def _loosened(stats: str) -> str:
    """A file's statistics once a vector deletes some of its rows: the bounds become wide."""
    loose = json.loads(stats)
    loose["tightBounds"] = False
    return json.dumps(loose)


def _wide_stats(file: dict[str, Any], key: str, rows: int) -> str:
    """Statistics for a file another writer added, from what the snapshot lists: the row
    count and the key's bounds, marked wide (the vector may have deleted the extremes)."""
    stats: dict[str, Any] = {"numRecords": rows, "tightBounds": False}
    low, high = file.get(f"min.{key}"), file.get(f"max.{key}")
    if low is not None and high is not None:
        stats["minValues"] = {key: low}
        stats["maxValues"] = {key: high}
    return json.dumps(stats)
