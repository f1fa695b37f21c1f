"""What a Delta checkpoint holds that a node reads back: the files of the last one
(``_last_checkpoint``), the deletion vectors of its live files and its ``txn`` actions (the
lane marks it carries, :mod:`.marks`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

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
    file lists: (path, descriptor) pairs. Only the rows that have one become Python objects (a
    checkpoint lists a row per live file and per ``txn``)."""
    import pyarrow.compute as pc

    parquet = _parquet(checkpoint)
    pairs: list[tuple[str, Any]] = []
    for kind in kinds:
        if "deletionVector" not in _fields(parquet, kind):
            continue
        actions = _present(parquet, kind, ("path", "deletionVector"))
        actions = actions.filter(pc.struct_field(actions, "deletionVector").is_valid())
        pairs += [
            (action["path"], {k: v for k, v in action["deletionVector"].items() if v is not None})
            for action in actions.to_pylist()
        ]
    return pairs


def checkpoint_txns(checkpoint: Location) -> Any:
    """The ``txn`` actions a checkpoint file lists, as an Arrow table of ``appId``,
    ``version`` and ``lastUpdated`` (null where unset); no rows when it has no ``txn``
    column. Arrow, not Python objects: a checkpoint may hold a ``txn`` per stream."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parquet = _parquet(checkpoint)
    fields = _fields(parquet, "txn")
    if not {"appId", "version"} <= fields:
        return pa.schema(
            [(n, pa.string() if n == "appId" else pa.int64()) for n in _TXN_FIELDS]
        ).empty_table()
    txns = _present(parquet, "txn", tuple(n for n in _TXN_FIELDS if n in fields))
    return pa.table(
        {
            "appId": pc.struct_field(txns, "appId"),
            "version": pc.struct_field(txns, "version"),
            "lastUpdated": pc.struct_field(txns, "lastUpdated")
            if "lastUpdated" in fields
            else pa.nulls(len(txns), pa.int64()),
        }
    )


_TXN_FIELDS: Final = ("appId", "version", "lastUpdated")


def _parquet(checkpoint: Location) -> Any:
    import pyarrow.parquet as pq

    return pq.ParquetFile(open_input(checkpoint))


def _fields(parquet: Any, kind: str) -> set[str]:
    """The fields of the checkpoint's struct column ``kind`` (none without one)."""
    schema = parquet.schema_arrow
    if kind not in schema.names:
        return set()
    kind_type = schema.field(kind).type
    return {kind_type.field(i).name for i in range(kind_type.num_fields)}


def _present(parquet: Any, kind: str, fields: tuple[str, ...]) -> Any:
    """The non-null rows of the struct column ``kind``, with ``fields`` only."""
    column = parquet.read(columns=[f"{kind}.{f}" for f in fields]).column(kind).combine_chunks()
    return column.filter(column.is_valid())
