"""Table maintenance and inspection (``deltaflow table ...``), through delta-rs: no JVM needed.

Compaction rewrites small files into large ones in one commit; it holds the table's commit
lock (:mod:`.lock`) like every other deltaflow commit, so it never races a node's group commit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..receivers.base import check_table_name
from .lock import table_lock

__all__ = ["history", "optimize", "show", "table_path"]


def table_path(warehouse: Path, table: str) -> Path:
    path = Path(warehouse) / check_table_name(table)
    if not (path / "_delta_log").is_dir():
        raise UsageError(f"no Delta table {table!r} under {warehouse}")
    return path


def optimize(warehouse: Path, table: str, *, target_size: int | None = None) -> dict[str, Any]:
    """Compact the table's small files; returns delta-rs's metrics (files added/removed...)."""
    from deltalake import DeltaTable

    path = table_path(warehouse, table)
    with table_lock(Path(warehouse), table):
        metrics = DeltaTable(str(path)).optimize.compact(target_size=target_size)
    return dict(metrics)


def history(warehouse: Path, table: str, *, limit: int = 20) -> list[dict[str, Any]]:
    """The latest commits, newest first: version, time, operation, writing node, rows."""
    import json

    from deltalake import DeltaTable

    rows = []
    for h in DeltaTable(str(table_path(warehouse, table))).history(limit):
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
    warehouse: Path, table: str, *, limit: int = 10, all_columns: bool = False
) -> tuple[int, list[dict[str, Any]]]:
    """Row count and the first ``limit`` rows, without deltaflow's bucket column unless
    ``all_columns``. Reads tables with deletion vectors too (through delta-rs's query engine,
    which applies them)."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    from .tables import BUCKET_COLUMN

    dt = DeltaTable(str(table_path(warehouse, table)))
    names = [
        n for n in pa.schema(dt.schema().to_arrow()).names if all_columns or n != BUCKET_COLUMN
    ]
    columns = ", ".join('"' + n.replace('"', '""') + '"' for n in names)
    query = QueryBuilder().register("t", dt)
    count = pa.table(query.execute("SELECT count(*) AS n FROM t").read_all()).column(0)[0]
    rows = pa.table(query.execute(f"SELECT {columns} FROM t LIMIT {int(limit)}").read_all())
    return int(count.as_py()), rows.to_pylist()
