"""Table maintenance and inspection (``deltaflow table ...``), through delta-rs: no JVM needed.

Compaction rewrites small files into large ones in one commit; it holds the table's commit
atomicity (:mod:`.atomicity`) like every other deltaflow commit, so it never races a node's
group commit.

Vacuum deletes the files no version within the retention needs: files that compaction or a
rewrite replaced, files of commits that failed, and deletion vector files no file uses any
more. delta-rs's own full vacuum (1.6) does not know deletion vector files: it deletes the
live ones too, and the table can no longer be read; this one keeps every vector file the log
still names.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any, Final

from ..columnar import INTERNAL_PREFIXES
from ..errors import UsageError
from ..storage.paths import Location
from .atomicity import atomicity_for
from .log import commit_text, commit_versions, delta_table, table_path
from .log import log_dir as delta_log_dir
from .marks import METADATA_KEY
from .sequence import parse_interval

__all__ = [
    "DEFAULT_RETENTION_HOURS",
    "INTERNAL_PREFIXES",
    "history",
    "last_compaction",
    "optimize",
    "read_rows",
    "show",
    "table_path",
    "vacuum",
]

#: Hours a file outlives the last version that needs it, before vacuum deletes it (Delta's
#: default ``delta.deletedFileRetentionDuration``: 7 days).
DEFAULT_RETENTION_HOURS: Final = 168


def optimize(warehouse: Location, table: str, *, target_size: int | None = None) -> dict[str, Any]:
    """Compact the table's small files; returns delta-rs's metrics (files added/removed...)."""
    path = table_path(warehouse, table)
    with atomicity_for(warehouse).hold(table):
        metrics = delta_table(path).optimize.compact(target_size=target_size)
    return dict(metrics)


def vacuum(
    warehouse: Location,
    table: str,
    *,
    retention_hours: int = DEFAULT_RETENTION_HOURS,
    dry_run: bool = True,
    force: bool = False,
) -> list[str]:
    """Delete the table's files that no version within ``retention_hours`` needs (older than
    that, and named by none of its live files), keeping every deletion vector file the log
    names; returns them, relative to the table (with ``dry_run``, only lists them).

    Files younger than the retention are kept whatever they are: a node may be writing the
    files of a commit that has not landed yet, so keep the retention well above a commit's
    duration.

    Raises:
        UsageError: a retention below the table's ``delta.deletedFileRetentionDuration``
            without ``force`` (Delta's own retention check), unless ``dry_run``.
    """
    if retention_hours < 0:
        raise UsageError(f"retention_hours must be >= 0, got {retention_hours}")
    path = table_path(warehouse, table)
    with atomicity_for(warehouse).hold(table):
        dt = delta_table(path)
        if not (dry_run or force):
            _check_retention(dt, table, retention_hours)
        unreferenced = dt.vacuum(
            retention_hours=retention_hours,
            dry_run=True,
            enforce_retention_duration=False,
            full=True,
        )
        named = _vector_files(path)
        doomed = sorted(f for f in unreferenced if (path / f).resolve() not in named)
        if not dry_run:
            for name in doomed:
                (path / name).unlink(missing_ok=True)
    return doomed


def _check_retention(dt: Any, table: str, retention_hours: int) -> None:
    """Delta's retention check: vacuuming below the table's
    ``delta.deletedFileRetentionDuration`` may delete files a reader or a commit in flight
    still needs.

    Raises:
        UsageError: ``retention_hours`` is below it, or it cannot be read.
    """
    name = "delta.deletedFileRetentionDuration"
    configured = dt.metadata().configuration.get(name)
    fix = "; --force vacuums anyway (Delta's retentionDurationCheck.enabled=false)"
    try:
        kept = parse_interval(configured) if configured else DEFAULT_RETENTION_HOURS * 3600
    except UsageError as exc:
        raise UsageError(f"table {table}'s {name} {configured!r} cannot be read{fix}") from exc
    if retention_hours * 3600 < kept:
        raise UsageError(
            f"a retention of {retention_hours} h is below table {table}'s {name} "
            f"({kept / 3600:g} h): a reader of an older version, or a node whose commit has not "
            f"landed yet, may need the files it deletes. Look first with --dry-run{fix}"
        )


def _vector_files(path: Location) -> set[Location]:
    """Every deletion vector file the table's log names, in the commits and checkpoints still
    there: those of live files, and of removed ones a reader of an older version may need."""
    from .checkpoints import checkpoint_vectors
    from .deletion_vectors import file_of
    from .marks import commit_vectors

    log_dir = delta_log_dir(path)
    descriptors = [dv for commit in log_dir.glob("*.json") for dv in commit_vectors(commit)]
    for checkpoint in log_dir.glob("*.checkpoint*.parquet"):
        descriptors += [dv for _, dv in checkpoint_vectors(checkpoint, ("add", "remove"))]
    files = (file_of(path, d) for d in descriptors)
    return {f.resolve() for f in files if f is not None}


def history(warehouse: Location, table: str, *, limit: int = 20) -> list[dict[str, Any]]:
    """The latest commits, newest first, each as a dict:

    ``version``; ``time`` (a UTC datetime; None if the commit does not say); ``operation``;
    ``node`` (the node that committed it, for deltaflow's commits, else None); ``writers``
    (the nodes whose rows it holds); ``rows_added`` and ``rows_removed`` (logical rows: a
    file's rows less those its deletion vector hides; None where the commit does not say);
    ``files_added``, ``files_removed``; ``streams`` (stream id -> lanes of it the commit
    marks) and ``lanes`` (lane -> its mark, ``[seq, k]``: the batches the table holds, see
    :mod:`.marks`); ``deletes_recorded`` (keys whose deletes it records, on ``sequence_by``
    tables).

    Read from the commit files themselves, each value checked: any writer can put anything
    in a ``commitInfo``, and a value of the wrong type, size or shape is shown as unknown
    (None, empty), never fails the listing.
    """
    path = table_path(warehouse, table)
    out = []
    for version in reversed(commit_versions(path, every=True)[-limit:] if limit > 0 else []):
        actions = _actions(path, version)
        infos = (a["commitInfo"] for a in actions if isinstance(a.get("commitInfo"), dict))
        info: dict[str, Any] = next(infos, {})
        meta = _deltaflow_metadata(info.get("userMetadata"))
        adds = [a["add"] for a in actions if isinstance(a.get("add"), dict)]
        removes = [a["remove"] for a in actions if isinstance(a.get("remove"), dict)]
        lanes = meta.get("lanes")
        lanes = {str(k): _mark(v) for k, v in lanes.items()} if isinstance(lanes, dict) else {}
        streams: dict[str, int] = {}
        for lane in lanes:
            sid = lane.split("/", 1)[0]
            streams[sid] = streams.get(sid, 0) + 1
        metrics = info.get("operationMetrics")
        metrics = metrics if isinstance(metrics, dict) else {}
        added = _rows(adds)
        removed = _removed_rows(path, version, removes) if removes else 0
        node = meta.get("node") if isinstance(meta.get("node"), str) else None
        writers = meta.get("writers")
        deleted = meta.get("deleted")
        keys = deleted.get("keys") if isinstance(deleted, dict) else None
        out.append(
            {
                "version": version,
                "time": _time(info.get("timestamp")),
                "operation": _shown(info.get("operation")),
                "node": _shown(node),
                "writers": [_shown(w) for w in writers if isinstance(w, str)]
                if isinstance(writers, list)
                else ([_shown(node)] if node else []),
                "rows_added": added if added is not None else _metric(metrics, "added"),
                "rows_removed": removed if removed is not None else _metric(metrics, "removed"),
                "files_added": len(adds),
                "files_removed": len(removes),
                "streams": streams,
                "lanes": lanes,
                "deletes_recorded": len(keys) if isinstance(keys, list) else 0,
            }
        )
    return out


def last_compaction(
    warehouse: Location, table: str, *, within: int = 1000
) -> dict[str, Any] | None:
    """The latest compaction among the last ``within`` commits (a version whose removes and
    adds all say ``dataChange: false``: the committer's, an OPTIMIZE's): its ``version``,
    ``time``, ``files_removed`` and ``files_added``; None if there is none."""
    path = table_path(warehouse, table)
    for version in reversed(commit_versions(path, every=True)[-within:]):
        actions = _actions(path, version)
        moved = [a[k] for a in actions for k in ("add", "remove") if isinstance(a.get(k), dict)]
        if not moved or any(m.get("dataChange", True) for m in moved):
            continue
        if not any(isinstance(a.get("remove"), dict) for a in actions):
            continue
        info: dict[str, Any] = next(
            (a["commitInfo"] for a in actions if isinstance(a.get("commitInfo"), dict)), {}
        )
        return {
            "version": version,
            "time": _time(info.get("timestamp")),
            "files_removed": sum(isinstance(a.get("remove"), dict) for a in actions),
            "files_added": sum(isinstance(a.get("add"), dict) for a in actions),
        }
    return None


#: The characters of a commit's text value (operation, node) that :func:`history` keeps.
_SHOWN_CHARS: Final = 200


def _shown(value: Any) -> str | None:
    """A commit's text value, cut short: None if it is not text."""
    if not isinstance(value, str):
        return None
    return value if len(value) <= _SHOWN_CHARS else value[:_SHOWN_CHARS] + "…"


def _mark(value: Any) -> list[int] | None:
    """A lane's mark, ``[seq, k]``, if it is one."""
    ok = isinstance(value, list) and len(value) == 2
    return value if ok and all(_count(v) == v for v in value) else None


def _time(stamp: Any) -> datetime.datetime | None:
    """A commit's ``timestamp`` (milliseconds since 1970) as a UTC datetime, if it is one."""
    if not isinstance(stamp, int) or isinstance(stamp, bool):
        return None
    try:
        return datetime.datetime.fromtimestamp(stamp / 1000, datetime.UTC)
    except (OverflowError, OSError, ValueError):  # past the years a datetime holds
        return None


def _deltaflow_metadata(text: Any) -> dict[str, Any]:
    if not isinstance(text, str) or METADATA_KEY not in text:
        return {}
    try:
        meta = json.loads(text).get(METADATA_KEY)
    except (ValueError, AttributeError, RecursionError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _actions(path: Location, version: int) -> list[dict[str, Any]]:
    """The actions of commit ``version`` (none if its file is gone: checkpointed and cleaned;
    a line that is not a JSON object is left out)."""
    try:
        text = commit_text(delta_log_dir(path) / f"{version:020d}.json")
    except (OSError, ValueError):  # gone, or not UTF-8
        return []
    actions = []
    for line in text.split("\n"):  # not splitlines(): a value may hold U+2028 raw
        try:
            action = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):
            continue
        if isinstance(action, dict):
            actions.append(action)
    return actions


def _count(value: Any) -> int | None:
    """A count from a commit (an int, or its digits as text), if it is one."""
    if isinstance(value, bool):
        return None
    try:
        return int(value) if isinstance(value, int | str) and len(str(value)) <= 20 else None
    except ValueError:
        return None


def _hidden(action: dict[str, Any]) -> int:
    """The rows an add or remove action's deletion vector hides."""
    vector = action.get("deletionVector")
    return (_count(vector.get("cardinality", 0)) or 0) if isinstance(vector, dict) else 0


def _rows(files: list[dict[str, Any]]) -> int | None:
    """Logical rows of ``files`` (add actions): records less deleted ones; None if a file has
    no record count."""
    total = 0
    for f in files:
        try:
            stats = json.loads(f.get("stats") or "{}")
        except (TypeError, ValueError, RecursionError):
            return None
        records = _count(stats.get("numRecords")) if isinstance(stats, dict) else None
        if records is None:
            return None
        total += records - _hidden(f)
    return total


def _removed_rows(path: Location, version: int, removes: list[dict[str, Any]]) -> int | None:
    """Logical rows the removed files held at ``version - 1`` (their add actions then); None
    if that version cannot be read."""
    import pyarrow as pa
    from deltalake.exceptions import DeltaError

    try:
        before = delta_table(path, version - 1)
        live = pa.table(before.get_add_actions(flatten=True)).to_pydict()
    except (DeltaError, OSError, ValueError):
        return None
    records = dict(zip(live["path"], live.get("num_records") or [], strict=False))
    total = 0
    for r in removes:
        count = records.get(r["path"]) if isinstance(r.get("path"), str) else None
        if count is None:
            return None
        total += int(count) - _hidden(r)
    return total


def _metric(metrics: dict[str, Any], kind: str) -> int | None:
    """Rows added or removed as the writer's own operation metrics say (Spark, delta-rs)."""
    names = {
        "added": ("num_added_rows", "numOutputRows", "num_output_rows", "num_target_rows_inserted"),
        "removed": ("num_removed_rows", "numTargetRowsDeleted", "num_target_rows_deleted"),
    }[kind]
    for name in names:
        if (count := _count(metrics.get(name))) is not None:
            return count
    return None


def show(
    warehouse: Location, table: str, *, limit: int = 10, all_columns: bool = False
) -> tuple[int, list[dict[str, Any]]]:
    """Row count and the first ``limit`` rows, without deltaflow's bucket column unless
    ``all_columns``. Reads tables with deletion vectors too (through delta-rs's query engine,
    which applies them)."""
    import pyarrow as pa

    rows = read_rows(warehouse, table, all_columns=all_columns, limit=limit)
    count = read_rows(warehouse, table, select="count(*) AS n").column(0)[0]
    return int(count.as_py()), pa.Table.to_pylist(rows)


def read_rows(
    warehouse: Location,
    table: str,
    *,
    columns: Sequence[str] | None = None,
    where: str | None = None,
    limit: int | None = None,
    all_columns: bool = False,
    select: str | None = None,
) -> Any:
    """Blocking: the table's live rows as a pyarrow Table, through delta-rs's query engine
    (deletion vectors applied): ``columns`` (default all but deltaflow's own), rows matching
    the SQL condition ``where``, at most ``limit``; ``select`` replaces the column list (an
    aggregate).

    Raises:
        UsageError: there is no such table, or a column is not one of it.
    """
    import pyarrow as pa
    from deltalake import QueryBuilder

    dt = delta_table(table_path(warehouse, table))  # no table: UsageError
    names = list(pa.schema(dt.schema().to_arrow()).names)
    if columns is None:
        columns = [n for n in names if all_columns or not n.startswith(INTERNAL_PREFIXES)]
    unknown = [c for c in columns if c not in names]
    if unknown:
        raise UsageError(f"table {table!r} has no column {unknown[0]!r} (it has {names})")
    listed = select or ", ".join('"' + c.replace('"', '""') + '"' for c in columns)
    sql = f"SELECT {listed} FROM t"
    if where:
        sql += f" WHERE {where}"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    return pa.table(QueryBuilder().register("t", dt).execute(sql).read_all())
