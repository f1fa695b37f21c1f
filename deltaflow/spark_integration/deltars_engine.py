"""The delta-rs engine: groups are merged (or appended) with the ``deltalake`` package, no JVM.

Same semantics as the Spark engine (the same table tests run against both): one commit per
group, lane marks in the commit's ``userMetadata``, the same cross-process table lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import CommitConflictError, DeltaflowError, SchemaError, ServerError
from .engine import DELETE_COLUMN, TableEngine

__all__ = ["DeltaRsTableEngine"]


def _require_deltalake() -> Any:
    try:
        import deltalake
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "the delta-rs engine needs the deltalake package: pip install 'deltaflow[deltars]'"
        ) from exc
    return deltalake


@contextlib.contextmanager
def map_deltars_errors(table: str, node: str) -> Iterator[None]:
    """Translate delta-rs errors at the engine boundary into deltaflow errors."""
    from deltalake.exceptions import CommitFailedError, SchemaMismatchError

    try:
        yield
    except DeltaflowError:
        raise
    except CommitFailedError as exc:
        raise CommitConflictError(
            f"commit to table {table!r} conflicted with another writer: {exc}", node=node
        ) from exc
    except SchemaMismatchError as exc:
        raise SchemaError(f"table {table!r} rejected the rows: {exc}", node=node) from exc
    except Exception as exc:
        raise ServerError(
            f"commit to table {table!r} failed: {type(exc).__name__}: {str(exc)[:800]}", node=node
        ) from exc


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class DeltaRsTableEngine(TableEngine):
    """Delta through delta-rs (the ``deltalake`` package): fast commits, no JVM."""

    name = "delta-rs"

    def _start_engine(self) -> None:
        _require_deltalake()

    def read_schema(self, table: str, path: Path) -> Any:
        import pyarrow as pa
        from deltalake import DeltaTable

        with map_deltars_errors(table, self.node_id):
            return pa.schema(DeltaTable(str(path)).schema().to_arrow())

    def write(
        self, table: str, path: Path, key: list[str], data: Any, exists: bool, metadata: str
    ) -> None:
        import pyarrow.compute as pc
        from deltalake import CommitProperties, DeltaTable, write_deltalake

        props = CommitProperties(custom_metadata={"userMetadata": metadata})
        columns = [c for c in data.column_names if c != DELETE_COLUMN]
        with map_deltars_errors(table, self.node_id):
            if not exists or not key:
                rows = data.filter(pc.invert(data.column(DELETE_COLUMN))).select(columns)
                write_deltalake(str(path), rows, mode="append", commit_properties=props)
                return
            flag = f"s.{_quote(DELETE_COLUMN)}"
            values = {_quote(c): f"s.{_quote(c)}" for c in columns}
            (
                DeltaTable(str(path))
                .merge(
                    data,
                    predicate=" AND ".join(f"t.{_quote(k)} = s.{_quote(k)}" for k in key),
                    source_alias="s",
                    target_alias="t",
                    streamed_exec=False,
                    commit_properties=props,
                )
                .when_matched_delete(predicate=flag)
                .when_matched_update(updates=values)
                .when_not_matched_insert(updates=values, predicate=f"NOT {flag}")
                .execute()
            )
