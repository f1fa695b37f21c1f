"""A table's live files, kept up to date from the commits written since they were listed.

A commit with keys lists the table's live files under the table's lock, to find the files
that may hold its keys (:class:`.Footprint`). delta-rs lists them with
``DeltaTable.get_add_actions(flatten=True)`` after ``update_incremental()``, and that update
replays the whole log since the last checkpoint, under the lock, at every commit (figures in
docs/tables.md). :class:`LiveFiles`
lists them through delta-rs once, then applies each later commit's ``add`` and ``remove``
actions itself: the cost of a commit is that of the commits since, read from their JSON files.

It declines (:meth:`LiveFiles.advance` returns False, and the caller lists through delta-rs
again) whenever it cannot be sure to give what delta-rs would: a commit changing the table's
metadata or protocol, a commit file missing (cleaned up), a column of delta-rs's listing it
does not know, or a partition value it cannot convert. File statistics it does not convert
exactly (timestamps, decimals, binary) are left null, which a footprint reads as "may hold any
key": never a file wrongly passed over, at worst one read needlessly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from ..storage.paths import Location
from .log import commit_text, log_dir

__all__ = ["LiveFiles"]

#: Columns of delta-rs's flattened listing taken from the add action itself.
_ACTION_FIELDS: Final = {
    "path": "path",
    "size_bytes": "size",
    "modification_time": "modificationTime",
}
#: Statistics prefixes of the listing, and their key in the action's ``stats`` JSON.
_STATS_PREFIXES: Final = {"null_count.": "nullCount", "min.": "minValues", "max.": "maxValues"}


class LiveFiles:
    """The live files of the table at ``path`` as of :attr:`version`, in the layout of delta-rs's
    ``get_add_actions(flatten=True)`` (a pyarrow Table).

    Blocking (file reads): use from a worker thread, under the table's commit lock.
    """

    def __init__(self, path: Location, files: Any, version: int) -> None:
        import pyarrow as pa

        self._log_dir = log_dir(path)
        self.files = pa.table(files).combine_chunks()
        self.version = version

    @staticmethod
    def understood(files: Any, configuration: Mapping[str, Any]) -> bool:
        """Whether this class keeps delta-rs's listing ``files`` of a table with
        ``configuration`` (its properties) up to date: every column is one it knows, and the
        table has no column mapping (its log names columns by physical names)."""
        mapping = str(configuration.get("delta.columnMapping.mode") or "none").lower()
        return mapping == "none" and all(_known(name) for name in files.schema.names)

    def advance(self, latest: int) -> bool:
        """Apply the commits after :attr:`version` up to ``latest``; False when the listing
        must be read through delta-rs again (the state is then unspecified): never raises."""
        if latest < self.version:
            return False  # the log restarted (the table was deleted and made again)
        try:
            return self._advance(latest)
        except Exception:  # noqa: BLE001 - anything unexpected in a log entry: list afresh
            return False

    def _advance(self, latest: int) -> bool:
        for version in range(self.version + 1, latest + 1):
            # A missing file (cleaned up) or an entry not as the protocol writes them raises:
            # advance() declines.
            text = commit_text(self._log_dir / f"{version:020d}.json")
            removed: set[str] = set()
            added: dict[str, dict[str, Any]] = {}
            for line in text.split("\n"):  # not splitlines(): values may hold U+2028 raw
                if not line.strip():
                    continue
                kind, action = next(iter(json.loads(line).items()))
                if kind in ("metaData", "protocol"):
                    return False
                if kind == "add":
                    added[str(action["path"])] = action
                elif kind == "remove":
                    removed.add(str(action["path"]))
            if not self._apply(removed, added):
                return False
            self.version = version
        return True

    def _apply(self, removed: set[str], added: dict[str, dict[str, Any]]) -> bool:
        import pyarrow as pa
        import pyarrow.compute as pc

        files = self.files
        # A path both removed and added (a new deletion vector) ends as added.
        gone = removed | added.keys()
        if gone and files.num_rows:
            files = files.filter(pc.invert(pc.is_in(files.column("path"), pa.array(list(gone)))))
        if added:
            rows = _rows(list(added.values()), files.schema)
            if rows is None:
                return False
            # Contiguous again at once: filtering a listing of many small chunks costs far more
            # than combining them.
            files = pa.concat_tables([files, rows]).combine_chunks()
        self.files = files
        return True


def _known(name: str) -> bool:
    if name in _ACTION_FIELDS or name in ("num_records",):
        return True
    return name.startswith(("partition.", "deletionVector.", *_STATS_PREFIXES))


def _rows(adds: list[dict[str, Any]], schema: Any) -> Any:
    """The listing rows of ``adds`` (add actions) with ``schema``; None if one cannot be made
    exactly."""
    import pyarrow as pa

    stats = []
    for add in adds:
        raw = add.get("stats")
        try:
            parsed = json.loads(raw) if isinstance(raw, str) and raw else {}
        except ValueError:
            parsed = {}
        stats.append(parsed if isinstance(parsed, dict) else {})
    columns = []
    try:
        for field in schema:
            name = field.name
            if name in _ACTION_FIELDS:
                values = [a.get(_ACTION_FIELDS[name]) for a in adds]
                columns.append(pa.array(values, field.type))
            elif name == "num_records":
                columns.append(pa.array([s.get("numRecords") for s in stats], field.type))
            elif name.startswith("partition."):
                column = name.removeprefix("partition.")
                values = [(a.get("partitionValues") or {}).get(column) or None for a in adds]
                columns.append(pa.array(values, pa.string()).cast(field.type))  # "": null
            elif name.startswith("deletionVector."):
                part = name.removeprefix("deletionVector.")
                values = [(a.get("deletionVector") or {}).get(part) for a in adds]
                columns.append(pa.array(values, field.type))
            else:
                prefix = next(p for p in _STATS_PREFIXES if name.startswith(p))
                column = name.removeprefix(prefix)
                values = [_nested(s.get(_STATS_PREFIXES[prefix]), column) for s in stats]
                columns.append(_statistic(values, field.type))
    except Exception:  # noqa: BLE001 - not what delta-rs would list: decline
        return None
    if any(not f.nullable and c.null_count for f, c in zip(schema, columns, strict=True)):
        return None
    return pa.Table.from_arrays(columns, schema=schema)


def _nested(values: Any, column: str) -> Any:
    """The statistic of ``column`` (a dotted name for a nested field) in a stats mapping."""
    for part in column.split("."):
        if not isinstance(values, dict):
            return None
        values = values.get(part)
    return values


def _statistic(values: list[Any], kind: Any) -> Any:
    """A statistics column: exact for integers, floats, booleans, strings and dates; null
    otherwise, or where a value is not of the JSON type expected ("may hold any key")."""
    import pyarrow as pa

    def kept(ok: type | tuple[type, ...]) -> list[Any]:
        return [v if isinstance(v, ok) and not isinstance(v, bool) else None for v in values]

    if pa.types.is_integer(kind):
        return pa.array(kept(int), kind)
    if pa.types.is_floating(kind):
        return pa.array(kept((int, float)), kind)
    if pa.types.is_boolean(kind):
        return pa.array([v if isinstance(v, bool) else None for v in values], kind)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return pa.array(kept(str), kind)
    if pa.types.is_date32(kind):
        return pa.array(kept(str), pa.string()).cast(kind)
    return pa.nulls(len(values), kind)
