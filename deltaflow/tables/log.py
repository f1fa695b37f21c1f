"""Where a table is, and where its Delta log is: the one place that spells ``_delta_log``."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from ..errors import UsageError
from ..receivers.base import check_table_name

__all__ = ["DELTA_LOG", "is_table", "latest_version", "log_dir", "table_path"]

#: The directory of a table that holds its Delta log.
DELTA_LOG: Final = "_delta_log"


def log_dir(path: Path) -> Path:
    """The Delta log directory of the table at ``path``."""
    return path / DELTA_LOG


def is_table(path: Path) -> bool:
    """Whether a Delta table exists at ``path``."""
    return log_dir(path).is_dir()


def table_path(warehouse: Path, table: str) -> Path:
    """The path of the existing table ``table`` under ``warehouse``.

    Raises:
        UsageError: a bad table name, or no Delta table by that name.
    """
    path = Path(warehouse) / check_table_name(table)
    if not is_table(path):
        raise UsageError(f"no Delta table {table!r} under {warehouse}")
    return path


def latest_version(path: Path) -> int:
    """The highest commit version in the table's log directory (-1 if none)."""
    try:
        names = [p.name for p in log_dir(path).iterdir()]
    except FileNotFoundError:
        return -1
    return max(
        (int(n[:20]) for n in names if len(n) == 25 and n.endswith(".json") and n[:20].isdigit()),
        default=-1,
    )
