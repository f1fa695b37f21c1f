"""The Spark engine: each group is a Parquet staging file that Spark MERGEs (or appends) into
the Delta table in one commit; the process's one SparkSession (``local[*]`` by default)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from ..errors import CommitConflictError, DeltaflowError, SchemaError, ServerError
from .engine import DELETE_COLUMN, TableEngine
from .session import SparkConfig, get_spark

__all__ = ["SparkTableEngine", "map_spark_errors"]

_USER_METADATA_CONF: Final = "spark.databricks.delta.commitInfo.userMetadata"


@contextlib.contextmanager
def map_spark_errors(table: str, node: str) -> Iterator[None]:
    """Translate PySpark/Delta errors at the engine boundary into deltaflow errors."""
    try:
        yield
    except DeltaflowError:
        raise
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        if "Concurrent" in text or "ProtocolChanged" in text or "MetadataChanged" in text:
            raise CommitConflictError(
                f"commit to table {table!r} conflicted with another writer: {text[:500]}", node=node
            ) from exc
        if "AnalysisException" in text or ("DELTA_" in text and "SCHEMA" in text):
            raise SchemaError(
                f"table {table!r} rejected the rows: {text[:800]}", node=node
            ) from exc
        raise ServerError(f"commit to table {table!r} failed: {text[:800]}", node=node) from exc


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


class SparkTableEngine(TableEngine):
    """Delta through PySpark with the Delta extension.

    Args:
        spark: Spark settings (the process's session is shared by every engine in it).
        **kwargs: see :class:`~.engine.TableEngine`.
    """

    name = "spark"

    def __init__(self, warehouse: Path, *, spark: SparkConfig | None = None, **kwargs: Any):
        super().__init__(warehouse, **kwargs)
        self.spark_config = spark
        self.spark: Any = None
        self._sessions: dict[str, Any] = {}

    def _start_engine(self) -> None:
        self.spark = get_spark(self.spark_config)

    def _session(self, table: str) -> Any:
        # A session per table: its SQL conf (commit metadata) is not shared with the commits
        # other tables run at the same time on other threads.
        if table not in self._sessions:
            self._sessions[table] = self.spark.newSession()
        return self._sessions[table]

    def read_schema(self, table: str, path: Path) -> Any:
        from pyspark.sql.pandas.types import to_arrow_schema

        with map_spark_errors(table, self.node_id):
            schema = self.spark.read.format("delta").load(str(path)).schema
        return to_arrow_schema(schema)

    def write(
        self, table: str, path: Path, key: list[str], data: Any, exists: bool, metadata: str
    ) -> None:
        import pyarrow.parquet as pq

        staging = self.staging_dir / f"{uuid.uuid4().hex}.parquet"
        staging.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(data, staging)
        session = self._session(table)
        columns = [c for c in data.column_names if c != DELETE_COLUMN]
        try:
            with map_spark_errors(table, self.node_id):
                if not exists:
                    (
                        session.read.parquet(str(staging))
                        .where(f"NOT {_quote(DELETE_COLUMN)}")
                        .select(*[_quote(c) for c in columns])
                        .write.format("delta")
                        .option("userMetadata", metadata)
                        .mode("append")
                        .save(str(path))
                    )
                    return
                session.conf.set(_USER_METADATA_CONF, metadata)
                try:
                    source = f"parquet.{_quote(str(staging))}"
                    if key:
                        session.sql(_merge_sql(path, key, source, data.column_names))
                    else:
                        cols = ", ".join(_quote(c) for c in columns)
                        session.sql(
                            f"INSERT INTO delta.{_quote(str(path))} ({cols}) "
                            f"SELECT {cols} FROM {source}"
                        )
                finally:
                    session.conf.unset(_USER_METADATA_CONF)
        finally:
            staging.unlink(missing_ok=True)


def _merge_sql(path: Path, key: Sequence[str], source: str, columns: Sequence[str]) -> str:
    data = [c for c in columns if c != DELETE_COLUMN]
    on = " AND ".join(f"t.{_quote(k)} = s.{_quote(k)}" for k in key)
    sets = ", ".join(f"t.{_quote(c)} = s.{_quote(c)}" for c in data)
    cols = ", ".join(_quote(c) for c in data)
    vals = ", ".join(f"s.{_quote(c)}" for c in data)
    flag = f"s.{_quote(DELETE_COLUMN)}"
    return (
        f"MERGE INTO delta.{_quote(str(path))} AS t USING {source} AS s ON {on} "
        f"WHEN MATCHED AND {flag} THEN DELETE "
        f"WHEN MATCHED THEN UPDATE SET {sets} "
        f"WHEN NOT MATCHED AND NOT {flag} THEN INSERT ({cols}) VALUES ({vals})"
    )
