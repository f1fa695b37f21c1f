"""What a Delta checkpoint holds that a node reads back: the files of the last one
(``_last_checkpoint``), the deletion vectors of its live files and its ``txn`` actions (the
lane marks it carries, :mod:`.marks`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..storage.paths import Location, open_input

__all__ = [
    "checkpoint_files",
    "checkpoint_txns",
    "checkpoint_vectors",
    "last_checkpoint",
    "vectors_of_last_checkpoint",
]


def last_checkpoint(log_dir: Location) -> dict[str, Any] | None:
    """The log's ``_last_checkpoint`` (its ``version`` an int), or None without a readable
    one."""
    try:
        last = json.loads((log_dir / "_last_checkpoint").read_text(encoding="utf-8"))
        last["version"] = int(last["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return last if isinstance(last, dict) else None


def _listdir(path: Location) -> list[str]:
    try:
        return [p.name for p in path.iterdir()]
    except FileNotFoundError:
        return []


def vectors_of_last_checkpoint(log_dir: Location, into: dict[str, dict[str, Any]]) -> int:
    """Read the deletion vectors of the live files the last checkpoint lists into ``into``;
    the checkpoint's version (-1 without one)."""
    last = last_checkpoint(log_dir)
    if last is None:
        return -1
    for part in checkpoint_files(log_dir, last):
        into.update(checkpoint_vectors(part, ("add",)))
    return int(last["version"])


def checkpoint_files(log_dir: Location, last: Mapping[str, Any]) -> list[Location]:
    """The parquet files of the checkpoint ``_last_checkpoint`` (``last``) names: by its
    ``parts`` when it has them (no listing of a log that may hold a month of commits), else
    the one classic file, else what a listing finds under its version (a v2 checkpoint)."""
    version = int(last["version"])
    parts = last.get("parts")
    if isinstance(parts, int) and parts > 1:
        return [
            log_dir / f"{version:020d}.checkpoint.{i:010d}.{parts:010d}.parquet"
            for i in range(1, parts + 1)
        ]
    single = log_dir / f"{version:020d}.checkpoint.parquet"
    if single.exists():
        return [single]
    prefix = f"{version:020d}.checkpoint"
    return [
        log_dir / n
        for n in sorted(_listdir(log_dir))
        if n.startswith(prefix) and n.endswith(".parquet")
    ]


def checkpoint_vectors(checkpoint: Location, kinds: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The deletion vectors of the actions of ``kinds`` (``add``, ``remove``) a checkpoint
    file lists: (path, descriptor) pairs."""
    import pyarrow.parquet as pq

    rows = pq.read_table(open_input(checkpoint), columns=list(kinds)).to_pylist()
    return [
        (action["path"], {k: v for k, v in action["deletionVector"].items() if v is not None})
        for row in rows
        for action in (row.get(kind) for kind in kinds)
        if action and action.get("deletionVector")
    ]


def checkpoint_txns(checkpoint: Location) -> list[dict[str, Any]]:
    """The ``txn`` actions a checkpoint file lists (none when it has no ``txn`` column)."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(open_input(checkpoint))
    if "txn" not in parquet.schema_arrow.names:
        return []
    rows = parquet.read(columns=["txn"]).column("txn").to_pylist()
    return [row for row in rows if row]
