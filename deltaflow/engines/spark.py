"""The Spark engine: Delta through the process's one SparkSession (``local[*]`` by default).

Two writers apply a group in one commit (``writer``):

- ``"direct"`` (default): the node writes the group's data files itself, by copy-on-write by
  key range (:mod:`~deltaflow.tables.rewrite`, the same file work as the delta-rs engine's; on
  tables with deletion vectors, by merge-on-read, :mod:`~deltaflow.tables.merge_on_read`), and
  commits their add and remove actions through Delta's own transaction in the Spark driver
  (``DeltaLog.startTransaction().commit``): Delta's conflict detection, log, checkpoints and
  commit format, with no Spark job per group. A Spark MERGE costs seconds of job planning and
  scheduling whatever its size; this costs a few hundred milliseconds (docs/tables.md).
- ``"sql"``: every group is a Parquet staging file that Spark MERGEs (or INSERTs) into the
  table.

The direct writer falls back to the SQL one for groups it cannot apply: tables with features
it does not implement (column mapping, constraints, generated columns, ...:
:func:`~deltaflow.tables.rewrite.write_files`) and keys of more than one column or of a type
without ranges.

On a Spark Connect server (``sc://``) every group is applied by the SQL writer: the node has
no driver JVM to commit through. The server reads the staging file by its path, so it must
see the warehouse at the same path as the node. Each table has its own Connect session.

Tables are created by SQL ``CREATE TABLE`` (columns, the bucket partition column and
deltaflow's table properties), and may have deletion vectors: the replaced rows are then
marked instead of their files rewritten (by the direct writer's merge-on-read, or by the SQL
writer's MERGE).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, Final

from .._faults import fault_point
from ..errors import (
    CommitConflictError,
    DeltaflowError,
    SchemaError,
    ServerError,
    TableSettingsError,
    UsageError,
)
from ..spark_integration.session import (
    DIRECT_WRITER_JAVA_OPTIONS,
    SparkConfig,
    connect_session,
    session_for,
)
from ..storage.paths import Location, StorePath
from ..tables.engine import DELETE_COLUMN, GroupWrite, TableDescription, TableEngine
from ..tables.log import latest_version
from ..tables.merging import internal
from ..tables.rewrite import RewriteUnsupported
from ..tables.settings import (
    PROP_CHECKPOINT_INTERVAL,
    TableSettings,
    with_layout,
)
from .options import SPARK_WRITERS
from .spark_sql import literal, merge_sql, quote

__all__ = ["SparkTableEngine", "create_delta_table", "map_spark_errors"]

log = logging.getLogger(__name__)

_USER_METADATA_CONF: Final = "spark.databricks.delta.commitInfo.userMetadata"
#: Delta's retries of a commit that lost its version (at the next one, after its own conflict
#: checks): none on an object store, where the committer checks the lane marks again first.
_MAX_COMMIT_ATTEMPTS: Final = "spark.databricks.delta.maxCommitAttempts"
#: The class of Delta's post-commit hook that writes checkpoints (a Scala object).
_CHECKPOINT_HOOK: Final = "org.apache.spark.sql.delta.hooks.CheckpointHook$"

#: Whether this process's driver JVM has run the direct writer's commit path once (see
#: :meth:`SparkTableEngine._warm_up`).
_warmed = threading.Event()


@contextlib.contextmanager
def map_spark_errors(table: str, node: str) -> Iterator[None]:
    """Translate PySpark/Delta errors at the engine boundary into deltaflow errors."""
    try:
        yield
    except (DeltaflowError, RewriteUnsupported):  # the latter: nothing written, SQL applies
        raise
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        conflict = ("Concurrent", "ProtocolChanged", "MetadataChanged", "MAX_COMMIT_RETRIES")
        if any(word in text for word in conflict):
            raise CommitConflictError(
                f"commit to table {table!r} conflicted with another writer: {text[:500]}", node=node
            ) from exc
        if "AnalysisException" in text or ("DELTA_" in text and "SCHEMA" in text):
            raise SchemaError(
                f"table {table!r} rejected the rows: {text[:800]}", node=node
            ) from exc
        raise ServerError(f"commit to table {table!r} failed: {text[:800]}", node=node) from exc


def _spark_type(arrow_type: Any) -> Any:
    """The Spark type of an Arrow type (view and large variants as their plain kind)."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import BinaryType, StringType, TimestampNTZType

    text = str(arrow_type)
    if text in ("string_view", "large_string"):
        return StringType()
    if text in ("binary_view", "large_binary"):
        return BinaryType()
    if pa.types.is_timestamp(arrow_type) and arrow_type.tz is None:
        return TimestampNTZType()
    return from_arrow_type(arrow_type)


def require_direct_commits(warehouse: Location, config: SparkConfig, writer: str) -> None:
    """Raises UsageError unless the engine commits to the warehouse on an object store through
    the driver's own Delta transaction (the direct writer): only it can pin a commit to the
    version after the one its lane marks were read at. A Spark SQL MERGE, or a Spark Connect
    server, picks its own snapshot and could land a batch twice."""
    if config.connect:
        raise UsageError(
            f"a Spark Connect server cannot commit to {warehouse} safely yet: its MERGE picks its "
            "own table version, so a batch two nodes race for could land twice; run the spark "
            "engine with a local or cluster master (--spark-writer direct), or delta-rs"
        )
    if writer != "direct":
        raise UsageError(
            f"the spark engine's SQL writer cannot commit to {warehouse} safely: its MERGE picks "
            "its own table version, so a batch two nodes race for could land twice; use "
            "--spark-writer direct (the default) on object storage"
        )


def create_delta_table(
    spark: Any, path: Location, schema: Any, settings: TableSettings, *, table: str, node: str
) -> None:
    """Blocking: create the empty table at ``path`` through Spark (the caller holds the lock),
    by SQL: a Spark Connect server runs it too (Delta's ``DeltaTable`` builder needs the Delta
    Connect plugin there).

    Args:
        schema: the data columns (Arrow); the bucket column is added for a bucketed table.
    """
    full, partition_by = with_layout(schema, settings)
    columns = ", ".join(f"{quote(f.name)} {_spark_type(f.type).simpleString()}" for f in full)
    sql = f"CREATE TABLE delta.{quote(str(path))} ({columns}) USING DELTA"
    if partition_by:
        sql += f" PARTITIONED BY ({', '.join(quote(c) for c in partition_by)})"
    properties = ", ".join(
        f"{literal(name)} = {literal(value)}" for name, value in settings.properties().items()
    )
    if properties:
        sql += f" TBLPROPERTIES ({properties})"
    with map_spark_errors(table, node):
        spark.sql(sql)


class SparkTableEngine(TableEngine):
    """Delta through PySpark with the Delta extension.

    Args:
        spark: Spark settings (the process's session is shared by every engine in it).
        writer: ``"direct"`` (default) or ``"sql"``: how groups are applied (see the module
            docstring).
        **kwargs: see :class:`~deltaflow.tables.engine.TableEngine`.
    """

    name = "spark"
    creates_deletion_vectors = True

    def __init__(
        self,
        warehouse: Location | str,
        *,
        spark: SparkConfig | None = None,
        writer: str = "direct",
        **kwargs: Any,
    ):
        super().__init__(warehouse, **kwargs)
        if writer not in SPARK_WRITERS:
            raise ValueError(f"writer must be one of {SPARK_WRITERS}, got {writer!r}")
        self.spark_config = spark or SparkConfig()
        # Over Spark Connect only SQL reaches the server's Delta (see the module docstring).
        self.writer = "sql" if self.spark_config.connect else writer
        # The SQL writer MERGEs each group itself: its groups do not go to a committer.
        self.prepares_groups = self.writer == "direct"
        if isinstance(self.warehouse, StorePath):
            require_direct_commits(self.warehouse, self.spark_config, self.writer)
            self.spark_config = dataclasses.replace(self.spark_config, object_store=True)
        self.spark: Any = None
        self._sessions: dict[str, Any] = {}
        self._checkpoint_hook: list[Any] | None = None  # Delta's CheckpointHook, _commit_files

    def merges_on_read(self, settings: TableSettings) -> bool:
        return self.writer == "direct" and settings.deletion_vectors

    def _start_engine(self) -> None:
        config = self.spark_config
        if self.writer == "direct" and config.java_options is None:
            config = dataclasses.replace(config, java_options=DIRECT_WRITER_JAVA_OPTIONS)
        self.spark = session_for(self.warehouse, config)
        if self.writer == "direct" and not _warmed.is_set():
            self._warm_up()

    def _warm_up(self) -> None:
        """Run the commit path once on a scratch table, so that a fresh JVM loads Delta's
        classes while the node starts rather than inside the first group's commit. The commit
        is due a checkpoint, so Delta also computes the table's state in it, as in every commit
        that reaches the interval, slow the first time in a JVM. Best effort: a failure only
        leaves the JVM cold."""
        scratch = self.staging_dir / f"warm-up-{uuid.uuid4().hex}"
        try:
            self.spark.sql(
                f"CREATE TABLE delta.{quote(str(scratch))} (id BIGINT) USING DELTA "
                f"TBLPROPERTIES ('{PROP_CHECKPOINT_INTERVAL}' = '1')"
            )
            self._commit_files(self.spark, "warm-up", scratch, [], "{}", 0)
            self.checkpoints_due.pop(scratch, None)
            _warmed.set()
        except Exception as exc:  # noqa: BLE001 - the first commit is only slower
            log.debug("warming the Delta commit path failed: %s", exc)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _session(self, table: str) -> Any:
        # A session per table: its SQL conf (commit metadata) is not shared with the commits
        # other tables run at the same time on other threads.
        if table not in self._sessions:
            self._sessions[table] = (
                connect_session(self.spark_config)
                if self.spark_config.connect
                else self.spark.newSession()
            )
            if self.atomicity.optimistic:
                # A commit lands at the version its marks were read at + 1 or not at all:
                # Delta must not retry it at a later version (see GroupWrite.read_version).
                self._sessions[table].conf.set(_MAX_COMMIT_ATTEMPTS, "0")
        return self._sessions[table]

    async def stop(self) -> None:
        await super().stop()
        if self.spark_config.connect:  # each ends its session on the server
            sessions, self._sessions = list(self._sessions.values()), {}
            for session in sessions:
                await asyncio.to_thread(session.stop)

    def describe(self, table: str, path: Location) -> TableDescription:
        try:
            return super().describe(table, path)
        except Exception as exc:  # noqa: BLE001 - a Delta feature delta-rs cannot read
            log.debug("table %s: described by Spark (delta-rs: %s)", table, exc)
        from pyspark.sql.pandas.types import to_arrow_schema

        session = self._session(table)
        with map_spark_errors(table, self.node_id):
            schema = session.read.format("delta").load(str(path)).schema
            detail = session.sql(f"DESCRIBE DETAIL delta.{quote(str(path))}").collect()[0]
        return TableDescription(
            schema=to_arrow_schema(schema),
            partition_columns=tuple(detail["partitionColumns"] or ()),
            properties=dict(detail["properties"] or {}),
        )

    def create(self, table: str, path: Location, schema: Any, settings: TableSettings) -> None:
        create_delta_table(
            self._session(table), path, schema, settings, table=table, node=self.node_id
        )

    def add_columns(self, table: str, path: Location, fields: Sequence[Any]) -> None:
        columns = ", ".join(f"{quote(f.name)} {_spark_type(f.type).simpleString()}" for f in fields)
        with map_spark_errors(table, self.node_id):
            self._session(table).sql(
                f"ALTER TABLE delta.{quote(str(path))} ADD COLUMNS ({columns})"
            )

    def write(self, group: GroupWrite) -> None:
        if self.writer == "direct":
            try:
                self._write_direct(group)
                return
            except RewriteUnsupported as exc:
                log.debug("table %s: applying this group by Spark SQL (%s)", group.table, exc)
        self._write_sql(group)

    def _write_direct(self, group: GroupWrite) -> None:
        """Apply the group by the node's own files, committed through the driver's Delta.

        Raises:
            RewriteUnsupported: nothing was written; the group needs the SQL writer.
        """
        table, path = group.table, group.path
        session = self._session(table)
        if getattr(session, "_jsparkSession", None) is None:
            raise RewriteUnsupported("a Spark Connect session has no driver JVM to commit in")
        try:
            target = self.log.latest(path)  # delta-rs: the version the files are planned on
        except Exception as exc:
            self.log.forget(path)
            raise RewriteUnsupported(f"delta-rs cannot read the table ({exc})") from exc
        if group.read_version is not None and target.version() != group.read_version:
            raise CommitConflictError(
                f"table {table!r} is at version {target.version()}, its lane marks were read "
                f"at {group.read_version}: checking them again",
                node=self.node_id,
            )
        with map_spark_errors(table, self.node_id):
            done = self.write_group_files(group, target)
            fault_point("before_commit")
            version = self._commit_files(
                session,
                table,
                path,
                [*done.actions(), *group.transactions],
                group.metadata,
                target.version(),
            )
            self._note_checkpoint(path, version)
            self.landed(path, done)

    def commit_actions(
        self, table: str, path: Location, version: int, actions: list[dict[str, Any]], metadata: str
    ) -> int:
        """Through Delta's transaction in the driver, when the node has one (its checksum
        and protocol checks come with it); else as the log entry itself."""
        session = self._session(table)
        if getattr(session, "_jsparkSession", None) is None:
            return super().commit_actions(table, path, version, actions, metadata)
        with map_spark_errors(table, self.node_id):
            return self._commit_files(session, table, path, actions, metadata, version)

    def _commit_files(
        self,
        session: Any,
        table: str,
        path: Location,
        actions: list[dict[str, Any]],
        metadata: str,
        version: int,
    ) -> int:
        """Commit the written files as version ``version + 1`` through Delta's transaction in
        the driver JVM (called under the table's lock, on the commit's thread); the version
        committed."""
        jvm = session._jvm
        delta = jvm.org.apache.spark.sql.delta
        jsession = session._jsparkSession
        # Delta's transaction takes its settings from the thread's active session.
        jvm.org.apache.spark.sql.SparkSession.setActiveSession(jsession)
        txn = delta.DeltaLog.forTable(jsession, str(path)).startTransaction()
        if txn.readVersion() != version:  # a writer outside deltaflow committed meanwhile
            raise CommitConflictError(
                f"table {table!r} moved from version {version} to {txn.readVersion()} while "
                "this group's files were written",
                node=self.node_id,
            )
        txn.readWholeTable()  # the candidate files were chosen from the whole table
        # Each kind of action is read by Delta's own JSON mapper in one call: a py4j round trip
        # per action would cost more than the commit.
        mapper = delta.util.JsonUtils.mapper()
        types = mapper.getTypeFactory()
        reflect = jvm.py4j.reflection.ReflectionUtil
        buffer = jvm.scala.collection.mutable.ArrayBuffer()
        for kind, listed in _action_json(actions).items():
            list_type = types.constructCollectionType(
                reflect.classForName("java.util.ArrayList"),
                reflect.classForName(f"org.apache.spark.sql.delta.actions.{kind}"),
            )
            parsed = mapper.readValue(listed, list_type)
            # JavaConverters is in Scala 2.12 and 2.13 alike (WrappedArray is not in 2.13).
            getattr(buffer, "$plus$plus$eq")(
                jvm.scala.collection.JavaConverters.asScalaBuffer(parsed)
            )
        # A streaming update, not a "manual update": Delta derives the version's checksum file
        # from the previous one only for the former (else a Spark job rebuilds the table's
        # state every commit), and other writers read protocol and metadata from it.
        operation = getattr(delta, "DeltaOperations$StreamingUpdate")(
            jvm.org.apache.spark.sql.streaming.OutputMode.Update(),
            f"deltaflow:{self.node_id}",
            version + 1,
            jvm.scala.Option.apply(metadata),
        )
        # Delta writes a due checkpoint inside commit() (its CheckpointHook), under the table
        # lock; without the hook the commit only says whether one is due, and the node writes
        # it after releasing the lock (see TableEngine.checkpoint).
        hooks = txn.postCommitHooks()
        if self._checkpoint_hook is None:  # looked up once: a Scala object, one per JVM
            found = [hooks.apply(i) for i in range(hooks.size())]
            self._checkpoint_hook = [h for h in found if h.getClass().getName() == _CHECKPOINT_HOOK]
        for hook in self._checkpoint_hook:
            getattr(hooks, "$minus$eq")(hook)
        return int(txn.commit(buffer.toList(), operation))  # an immutable Seq for Scala 2.13

    def checkpoint(self, table: str, path: Location, version: int) -> None:
        try:
            super().checkpoint(table, path, version)
            return
        except Exception as exc:  # noqa: BLE001 - a Delta feature delta-rs cannot write
            if self.spark_config.connect:  # no driver JVM here: the next SQL commit's Delta does
                log.warning("table %s: no checkpoint at version %d (%s)", table, version, exc)
                return
            log.debug("table %s: checkpoint by Spark (delta-rs: %s)", table, exc)
        session = self._session(table)
        jvm = session._jvm
        jsession = session._jsparkSession
        jvm.org.apache.spark.sql.SparkSession.setActiveSession(jsession)
        delta_log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(jsession, str(path))
        none = jvm.scala.Option.apply(None)
        with map_spark_errors(table, self.node_id):
            delta_log.checkpoint(delta_log.getSnapshotAt(version, none, none), none)

    def _write_sql(self, group: GroupWrite) -> None:
        table, path, data = group.table, group.path, group.data
        if group.rule.history:
            raise TableSettingsError(
                f"table {table!r} keeps its history (history='scd2'): its versions are rebuilt "
                "by deltaflow's own writer, which this node cannot use for it (a Spark Connect "
                "server, the sql writer, or a table feature it does not implement); write it "
                "from nodes with the delta-rs engine or the Spark engine's direct writer",
                node=self.node_id,
            )
        if not data.num_rows and group.transactions:
            # Nothing to MERGE (every change superseded): the marks alone, in one commit.
            read = group.read_version if group.read_version is not None else latest_version(path)
            with map_spark_errors(table, self.node_id):
                self.commit_actions(table, path, read, group.transactions, group.metadata)
            return
        import pyarrow.parquet as pq

        staging = self.staging_dir / f"{uuid.uuid4().hex}.parquet"
        staging.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(data, staging)
        session = self._session(table)
        columns = [c for c in data.column_names if not internal(c)]
        try:
            with map_spark_errors(table, self.node_id):
                session.conf.set(_USER_METADATA_CONF, group.metadata)
                try:
                    source = f"parquet.{quote(str(staging))}"
                    if group.footprint is not None:
                        session.sql(
                            merge_sql(
                                path,
                                group.key,
                                source,
                                data.column_names,
                                group.footprint,
                                group.sequence,
                                group.rule,
                            )
                        )
                    else:
                        cols = ", ".join(quote(c) for c in columns)
                        session.sql(
                            f"INSERT INTO delta.{quote(str(path))} ({cols}) "
                            f"SELECT {cols} FROM {source} WHERE NOT {quote(DELETE_COLUMN)}"
                        )
                finally:
                    session.conf.unset(_USER_METADATA_CONF)
        finally:
            staging.unlink(missing_ok=True)
        if group.transactions:
            self._carry_marks(group)

    def _carry_marks(self, group: GroupWrite) -> None:
        """A SQL MERGE or INSERT cannot add ``txn`` actions: the group's lane marks follow it
        in a commit of their own, where a checkpoint keeps them. If that commit fails (or the
        node dies first), the marks are still in the MERGE's ``commitInfo``, and the table's
        next commit carries them (:mod:`deltaflow.tables.marks`)."""
        try:
            version = latest_version(group.path)
            self.commit_actions(
                group.table, group.path, version, group.transactions, group.metadata
            )
        except Exception as exc:  # noqa: BLE001 - the next commit carries them
            log.info("table %s: its lane marks wait for the next commit (%s)", group.table, exc)


def _action_json(actions: list[dict[str, Any]]) -> dict[str, str]:
    """Log actions (``{"add": ...}``, ``{"remove": ...}``, ``{"txn": ...}``) as JSON arrays of
    Delta's ``AddFile``, ``RemoveFile`` and ``SetTransaction``, by class name."""
    return {
        cls: json.dumps([a[kind] for a in actions if kind in a])
        for kind, cls in (("add", "AddFile"), ("remove", "RemoveFile"), ("txn", "SetTransaction"))
    }
