"""The node's delta-rs view of its tables' logs.

Both engines read a table's state through delta-rs, whichever engine wrote it: its latest
version, its live files with their statistics (for a group's footprint) and the table a
merge-on-read commit is planned on. :class:`LogReader` keeps each table open between commits
and brings it up to date by reading only the commits made since.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..storage.paths import Location
from .commit_file import TABLE_CHANGES
from .layout import live_rows
from .live_files import LiveFiles
from .log import (
    commit_text,
    delta_table,
    fetched,
    forget_commits,
    last_checkpoint_version,
    latest_version,
    log_dir,
)

__all__ = ["REOPEN_AFTER", "LogReader", "TableDescription"]

log = logging.getLogger(__name__)

#: Versions a kept table is brought up to date incrementally before it is opened afresh from a
#: newer checkpoint: delta-rs's incremental update keeps about 55 KB per commit read that way
#: (bench/README.md), so a table kept open for months would grow without end.
REOPEN_AFTER = 100
#: Versions between two looks for that checkpoint, once due (a table may write none).
REOPEN_LOOK = 10


@dataclass(frozen=True, slots=True)
class TableDescription:
    """What an engine reads about an existing table.

    Attributes:
        schema: the Arrow schema of every column, the bucket column included.
        partition_columns: Delta partition columns.
        properties: Delta table properties.
    """

    schema: Any
    partition_columns: tuple[str, ...]
    properties: Mapping[str, str]


class LogReader:
    """A node's delta-rs tables, kept open between commits, and their live files.

    Blocking throughout (file reads): use from a worker thread, under the table's commit lock.
    """

    def __init__(self) -> None:
        self._open: dict[Location, Any] = {}  # delta-rs tables, see latest
        # Per kept table, the version it was opened at and the one to look at
        # ``_last_checkpoint`` again from (see _stale).
        self._opened_at: dict[Location, tuple[int, int]] = {}
        self._live: dict[Location, LiveFiles] = {}  # their live files, see live_files
        self._described: dict[Location, tuple[int, TableDescription]] = {}  # see describe

    def latest(self, path: Location, known: int | None = None) -> Any:
        """The delta-rs table at ``path``, at its latest version. A commit asks twice (for its
        file statistics and its write): a listing finds the log unchanged the second time,
        far cheaper than delta-rs's own no-op update. ``known``: the latest version as the
        caller just listed it (no listing here; on a store that is a round trip)."""
        table = self._open.get(path)
        if table is not None:
            latest = self._latest(path, int(table.version()), known)
            if table.version() >= latest:
                return table
            if not self._stale(path, latest):
                table.update_incremental()
                return table
        table = self._open[path] = delta_table(path)
        opened = int(table.version())
        self._opened_at[path] = (opened, opened + REOPEN_AFTER)
        return table

    def _stale(self, path: Location, latest: int) -> bool:
        """Whether the kept table was opened :data:`REOPEN_AFTER` versions before ``latest``
        and a checkpoint was written since: opened afresh, it starts from that checkpoint.
        ``_last_checkpoint`` is read at most once per ``REOPEN_LOOK`` versions."""
        opened, look = self._opened_at.get(path, (-1, -1))
        if latest < look:
            return False
        checkpoint = last_checkpoint_version(log_dir(path))
        if checkpoint is not None and checkpoint > opened:
            return True
        self._opened_at[path] = (opened, latest + REOPEN_LOOK)
        return False

    @staticmethod
    def _latest(path: Location, version: int, known: int | None) -> int:
        return latest_version(path, version) if known is None else known

    def describe(self, path: Location) -> TableDescription:
        """The schema, partition columns and properties of the table at ``path``, latest.

        Kept per version: the owner's side and the committer each ask before their first
        commit and after commits, and a load of the log replays its last checkpoint (which
        may hold a ``txn`` per lane the table remembers)."""
        import pyarrow as pa

        kept = self._described.get(path)
        if kept is not None and (log_dir(path) / f"{kept[0]:020d}.json").exists():
            # (The kept version's commit is there: not a table made anew.)
            latest = latest_version(path, kept[0])
            if latest == kept[0]:
                return kept[1]
            if not _metadata_changed(path, kept[0], latest):
                # The commits since change no schema or property (a new committer after a
                # failover, say): the description holds; no load of the table.
                self._described[path] = (latest, kept[1])
                return kept[1]
        table = self.latest(path)
        version = int(table.version())
        meta = table.metadata()
        described = TableDescription(
            schema=pa.schema(table.schema().to_arrow()),
            partition_columns=tuple(meta.partition_columns),
            properties=dict(meta.configuration),
        )
        self._described[path] = (version, described)
        return described

    def opened(self, path: Location) -> Any:
        """The delta-rs table at ``path`` as last read, without reading the log (None if it
        was not read since the last :meth:`forget`)."""
        return self._open.get(path)

    def live_files(self, path: Location, known: int | None = None) -> tuple[Any, int] | None:
        """The table's live files with their statistics (``get_add_actions(flatten=True)``)
        and the version they are of, or None if they cannot be read (a table feature delta-rs
        does not read): the group is then merged.

        Listed through delta-rs once, then kept up to date from the commits made since
        (:class:`.LiveFiles`), which spares delta-rs's replay of the log."""
        index = self._kept(path, known)
        if index is not None:
            return index.files, index.version
        try:
            table = self.latest(path, known)
            files, version = table.get_add_actions(flatten=True), int(table.version())
        except Exception as exc:  # noqa: BLE001 - any failure only costs the append shortcut
            self._open.pop(path, None)
            log.debug("cannot read the file statistics of %s (%s): merging", path, exc)
            return None
        if LiveFiles.understood(files, table.metadata().configuration):
            index = self._live[path] = LiveFiles(path, files, version)
            return index.files, version
        return files, version

    def live_rows(self, path: Location, known: int | None) -> int:
        """The rows of the table's live files (:func:`.layout.live_rows`) at version ``known``
        or the kept files' own, whichever is later (None: listed)."""
        index = self._live.get(path)
        if index is not None and known is not None and known < index.version:
            known = index.version
        listed = self.live_files(path, known)
        return live_rows(listed[0] if listed else None)

    def planned(self, path: Location, known: int | None = None) -> tuple[Any, int]:
        """The delta-rs table (for its metadata, protocol and schema) and the version a commit
        is planned on, the latest. From the live files when they are kept (no commit since the
        table was read changed its metadata or protocol, or they would have declined), else by
        bringing the table up to date."""
        index = self._kept(path, known)
        if index is not None:
            table = self._open.get(path)
            if table is None:  # opened afresh, at the latest version: its metadata is current
                table = self.latest(path, known)
            return table, index.version
        table = self.latest(path, known)
        return table, int(table.version())

    def keeps(self, path: Location) -> bool:
        """Whether the table's live files are kept (brought up to date, not listed afresh)."""
        return path in self._live

    def forget(self, path: Location) -> None:
        """Read the table afresh next time (a write failed: its state is unknown)."""
        self._open.pop(path, None)
        self._opened_at.pop(path, None)
        self._live.pop(path, None)
        self._described.pop(path, None)
        forget_commits(path)

    def _kept(self, path: Location, known: int | None = None) -> LiveFiles | None:
        """The table's kept live files brought up to the latest commit (``known``: as the
        caller just listed it), or None (and dropped) when there are none or they declined."""
        index = self._live.get(path)
        if index is not None and index.advance(self._latest(path, index.version, known)):
            return index
        self._live.pop(path, None)
        return None


def _metadata_changed(path: Location, after: int, latest: int) -> bool:
    """Whether a commit of the table after version ``after``, up to ``latest``, changes its
    metadata or protocol (or cannot be read); past :data:`REOPEN_AFTER` commits, assumed so."""
    if latest - after > REOPEN_AFTER:
        return True
    for commit in fetched(log_dir(path), range(after + 1, latest + 1)):
        try:
            text = commit_text(commit)
        except OSError:
            return True
        if any(line.startswith(TABLE_CHANGES) for line in text.split("\n")):
            return True
    return False
