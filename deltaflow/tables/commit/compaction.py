"""Compaction a table's committer runs between commits, so a table a stream writes for months
keeps a bounded number of files.

The committer is the one node that commits a table. Every ``interval`` seconds, while no group
is waiting for it, it picks the bucket holding the most *small* files (below ``small_bytes``,
or hiding most of their rows behind a deletion vector), at least ``min_files`` of them, and
rewrites up to ``max_bytes`` of them into one file (sorted by the key on a keyed table): the
rows their vectors keep, exactly. The file work runs on a thread with the table not held, like
a writer's preparation; the result is a :class:`.PreparedCommit` of ``dataChange: false``
actions and no lanes, pinned to the version the files were listed at, which the committer
checks and commits like any writer's group. It is taken last in its version: a writer's group
replacing one of its files wins, and the compaction is dropped (its file left for ``vacuum``).
A writer's group prepared before the compaction that replaces a compacted file is sent back to
be prepared again, as after any commit that replaced its files (counted, see
``TableStatistics.groups_sent_back_by_compaction``). So a compaction never fails or doubles a
batch, and only ever delays a few.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import unquote

from ..data_files import FILE_POOL, DataFile, read_file, remove_action, write_file
from ..deletion_vectors import read
from ..engine_settings import CompactionSettings
from ..settings import BUCKET_COLUMN
from .prepared import PreparedCommit

if TYPE_CHECKING:
    from ...storage.paths import Location

__all__ = ["Compaction", "Compactor"]

log = logging.getLogger(__name__)

#: A file whose deletion vector hides more than this share of its rows counts as small.
HIDDEN_SHARE: Final = 0.5


@dataclass(frozen=True, slots=True)
class Compaction:
    """One compaction prepared: the commit to submit and what it rewrites."""

    commit: PreparedCommit
    files: int
    bytes: int
    bucket: str | None


class Compactor:
    """A table's compactions, planned from the table's live files (a delta-rs table of its
    own, brought up to date before each plan; only the committer's compaction task uses it).

    Blocking: use from a worker thread.
    """

    def __init__(self, table: str, path: Location, node: str, settings: CompactionSettings):
        self.table, self.path, self.node = table, path, node
        self.settings = settings
        self._delta: Any = None
        self.last_at = 0.0  # when (monotonic) the last compaction was prepared

    def due(self, now: float) -> bool:
        return self.settings.enabled and now - self.last_at >= self.settings.interval

    def prepare(
        self, version: int, vectors: dict[str, dict[str, Any]]
    ) -> tuple[int, Compaction | None]:
        """The table's live files at ``version``, and its next compaction there: its new file
        written, its commit ready (None when no bucket needs one). ``vectors``: the deletion
        vector of each live file that has one at ``version``, as the log names it (the
        committer's marks read them; delta-rs lists none).

        Raises:
            Exception: the files could not be read exactly (nothing was committed).
        """
        import pyarrow as pa

        from ..log import delta_table

        self.last_at = time.monotonic()
        if self._delta is None:
            self._delta = delta_table(self.path, version)
        elif self._delta.version() != version:
            self._delta.load_as_version(version)
        files = pa.table(self._delta.get_add_actions(flatten=True)).to_pylist()
        for f in files:
            f["deletionVector"] = vectors.get(unquote(f["path"])) or vectors.get(f["path"])
        chosen = self._choose(files)
        if not chosen:
            return len(files), None
        metadata = self._delta.metadata()
        key = _single_key(metadata.configuration)
        schema = _data_schema(self._delta)
        bucket = _bucket(chosen[0])
        rows = FILE_POOL.map(lambda f: self._live_rows(f, schema), chosen)
        data = pa.concat_tables(list(rows))
        if key is not None and key in data.column_names:
            data = data.sort_by(key)
        now = int(time.time() * 1000)
        actions: list[dict[str, Any]] = []
        if data.num_rows:
            added = write_file(self.path, data, bucket, key)
            actions.append(_unchanged(_add(added, now)))
        for f in chosen:
            gone = DataFile(f["path"], int(f["size_bytes"]), bucket)
            actions.append(_unchanged(remove_action(gone, now, f["deletionVector"])))
        size = sum(int(f["size_bytes"]) for f in chosen)
        commit = PreparedCommit(self.table, self.node, version, actions, {}, {})
        return len(files), Compaction(commit, len(chosen), size, bucket)

    def _choose(self, files: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The small files of the bucket holding the most of them (at least ``min_files``),
        smallest first, up to ``max_bytes``."""
        settings = self.settings
        small: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
        for f in files:
            size = int(f.get("size_bytes") or 0)
            rows = f.get("num_records")
            hidden = int((f["deletionVector"] or {}).get("cardinality") or 0)
            if rows is None:
                continue  # without a row count the rewrite could not be checked
            if size < settings.small_bytes or (rows and hidden > HIDDEN_SHARE * rows):
                small[_bucket(f)].append(f)
        if not small:
            return []
        candidates = max(small.values(), key=len)
        if len(candidates) < settings.min_files:
            return []
        chosen: list[dict[str, Any]] = []
        total = 0
        for f in sorted(candidates, key=lambda f: int(f["size_bytes"])):
            if chosen and total + int(f["size_bytes"]) > settings.max_bytes:
                break
            chosen.append(f)
            total += int(f["size_bytes"])
        return chosen if len(chosen) >= 2 else []

    def _live_rows(self, f: dict[str, Any], schema: Any) -> Any:
        """The rows of file ``f`` its deletion vector keeps."""
        import numpy as np
        import pyarrow as pa

        rows = read_file(self.path / unquote(f["path"]), schema)
        vector = f["deletionVector"]
        if vector is None:
            return rows
        keep = np.ones(rows.num_rows, dtype=bool)
        deleted = read(self.path, vector)
        if len(deleted):
            keep[np.frombuffer(deleted.to_array(), dtype=np.uint64).astype(np.int64)] = False
        expected = rows.num_rows - int(vector.get("cardinality") or 0)
        if int(keep.sum()) != expected:
            kept = int(keep.sum())
            raise ValueError(f"{f['path']}: its vector keeps {kept} rows, not {expected}")
        return rows.filter(pa.array(keep))


def _bucket(f: dict[str, Any]) -> str | None:
    value = f.get(f"partition.{BUCKET_COLUMN}")
    return None if value is None else str(value)


def _single_key(configuration: dict[str, str]) -> str | None:
    import json

    try:
        key = json.loads(configuration.get("deltaflow.key") or "[]")
    except ValueError:
        return None
    return key[0] if isinstance(key, list) and len(key) == 1 else None


def _data_schema(delta: Any) -> Any:
    import pyarrow as pa

    full = pa.schema(delta.schema().to_arrow())
    partitions = set(delta.metadata().partition_columns)
    return pa.schema([f for f in full if f.name not in partitions])


def _add(f: DataFile, timestamp: int) -> dict[str, Any]:
    from ..data_files import add_action

    return add_action(f, timestamp, f.stats)


def _unchanged(action: dict[str, Any]) -> dict[str, Any]:
    """The action marked as moving rows, not changing them (readers of changes skip it)."""
    for body in action.values():
        body["dataChange"] = False
    return action
