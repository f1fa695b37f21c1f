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

import json
from typing import Any, Final

from ..errors import UsageError
from ..storage.paths import Location
from .atomicity import atomicity_for
from .log import delta_table, table_path
from .log import log_dir as delta_log_dir

__all__ = ["DEFAULT_RETENTION_HOURS", "history", "optimize", "show", "table_path", "vacuum"]

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
) -> list[str]:
    """Delete the table's files that no version within ``retention_hours`` needs (older than
    that, and named by none of its live files), keeping every deletion vector file the log
    names; returns them, relative to the table (with ``dry_run``, only lists them).

    Files younger than the retention are kept whatever they are: a node may be writing the
    files of a commit that has not landed yet, so keep the retention well above a commit's
    duration.
    """
    if retention_hours < 0:
        raise UsageError(f"retention_hours must be >= 0, got {retention_hours}")
    path = table_path(warehouse, table)
    with atomicity_for(warehouse).hold(table):
        unreferenced = delta_table(path).vacuum(
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


def _vector_files(path: Location) -> set[Location]:
    """Every deletion vector file the table's log names, in the commits and checkpoints still
    there: those of live files, and of removed ones a reader of an older version may need."""
    from .deletion_vectors import file_of
    from .marks import checkpoint_vectors, commit_vectors

    log_dir = delta_log_dir(path)
    descriptors = [dv for commit in log_dir.glob("*.json") for dv in commit_vectors(commit)]
    for checkpoint in log_dir.glob("*.checkpoint*.parquet"):
        descriptors += [dv for _, dv in checkpoint_vectors(checkpoint, ("add", "remove"))]
    files = (file_of(path, d) for d in descriptors)
    return {f.resolve() for f in files if f is not None}


def history(warehouse: Location, table: str, *, limit: int = 20) -> list[dict[str, Any]]:
    """The latest commits, newest first: version, time, operation, writing node, rows."""

    rows = []
    for h in delta_table(table_path(warehouse, table)).history(limit):
        meta = h.get("userMetadata")
        node = ""
        if isinstance(meta, str) and "deltaflow" in meta:
            node = str(json.loads(meta).get("deltaflow", {}).get("node", ""))
        metrics = h.get("operationMetrics") or {}
        written = metrics.get("num_output_rows", metrics.get("numOutputRows", ""))
        rows.append(
            {
                "version": h.get("version"),
                "timestamp": h.get("timestamp"),
                "operation": h.get("operation"),
                "node": node,
                "rows_written": written,
            }
        )
    return rows


def show(
    warehouse: Location, table: str, *, limit: int = 10, all_columns: bool = False
) -> tuple[int, list[dict[str, Any]]]:
    """Row count and the first ``limit`` rows, without deltaflow's bucket column unless
    ``all_columns``. Reads tables with deletion vectors too (through delta-rs's query engine,
    which applies them)."""
    import pyarrow as pa
    from deltalake import QueryBuilder

    from .settings import BUCKET_COLUMN

    dt = delta_table(table_path(warehouse, table))
    names = [
        n for n in pa.schema(dt.schema().to_arrow()).names if all_columns or n != BUCKET_COLUMN
    ]
    columns = ", ".join('"' + n.replace('"', '""') + '"' for n in names)
    query = QueryBuilder().register("t", dt)
    count = pa.table(query.execute("SELECT count(*) AS n FROM t").read_all()).column(0)[0]
    rows = pa.table(query.execute(f"SELECT {columns} FROM t LIMIT {int(limit)}").read_all())
    return int(count.as_py()), rows.to_pylist()
