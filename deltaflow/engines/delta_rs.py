"""The delta-rs engine: groups are appended, rewritten or merged with the ``deltalake``
package, no JVM.

A group whose keys the table may hold is applied by copy-on-write by key range
(:mod:`~deltaflow.tables.rewrite`: the files holding its keys are read and replaced in one
commit, keeping files to their key ranges), or, on a table with deletion vectors, by
merge-on-read (:mod:`~deltaflow.tables.merge_on_read`: its rows are written once and the rows
they replace marked in deletion vectors). Tables with features those writers do not
implement, and keys of more than one column, are merged with delta-rs's MERGE.

Same semantics as the Spark engine (the same table tests run against both): one commit per
group, lane marks in the commit's ``userMetadata``, the same cross-process table lock.

Deletion vectors: delta-rs 1.x reads and writes tables that have them (its MERGE and OPTIMIZE
rewrite the files they touch, honouring their vectors), but its transactions take no vectors
of their own, and a table it creates (or alters) to have them also gets the ``variantType``
feature, which Delta 3.3 (Spark) cannot read. So this engine writes the creation commit of
such a table, and its merge-on-read commits, as log entries of its own
(:func:`commit_log_entry`, under the table's lock like every deltaflow commit). Every table's
version 0 is put that way (create-if-absent), so concurrent creators cannot both succeed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any, Final

from .._faults import fault_point
from ..columnar import NULLS_COLUMN
from ..errors import CommitConflictError, DeltaflowError, SchemaError, ServerError
from ..storage.paths import Location
from ..tables.engine import DELETE_COLUMN, GroupWrite, TableDescription, TableEngine
from ..tables.footprint import Footprint
from ..tables.log import commit_log_entry, delta_table, is_table
from ..tables.log import log_dir as delta_log_dir
from ..tables.merge_on_read import MergeOnRead, has_deletion_vectors
from ..tables.merging import REPLACE_COLUMN, internal, matched_clauses
from ..tables.rewrite import RewriteUnsupported, rewrite
from ..tables.settings import (
    BUCKET_COLUMN,
    TableSettings,
    with_layout,
)

__all__ = ["DeltaRsTableEngine", "create_delta_table"]

log = logging.getLogger(__name__)


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
    from deltalake.exceptions import CommitFailedError, DeltaProtocolError, SchemaMismatchError

    try:
        yield
    except DeltaflowError:
        raise
    except CommitFailedError as exc:
        raise CommitConflictError(
            f"commit to table {table!r} conflicted with another writer: {exc}", node=node
        ) from exc
    except DeltaProtocolError as exc:
        raise ServerError(
            f"delta-rs cannot write table {table!r}, which uses a Delta feature it does not "
            f"support ({exc}); write it from nodes with the spark engine",
            node=node,
        ) from exc
    except SchemaMismatchError as exc:
        raise SchemaError(f"table {table!r} rejected the rows: {exc}", node=node) from exc
    except BaseException as exc:
        # A panic in delta-rs's Rust comes as a BaseException, which would end the task that
        # awaits the write (its batches never answered): it fails the write instead.
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        if _NOT_NULL.search(str(exc)):  # a table made elsewhere, with a NOT NULL column
            raise SchemaError(
                f"table {table!r} refused the rows: a column it declares NOT NULL got a null "
                f"({str(exc)[:400]})",
                node=node,
            ) from exc
        raise ServerError(
            f"commit to table {table!r} failed: {type(exc).__name__}: {str(exc)[:800]}", node=node
        ) from exc


#: How pyarrow's cast (copy-on-write) and delta-rs's MERGE (a panic) refuse a null in a NOT
#: NULL column.
_NOT_NULL: Final = re.compile(r"null values to non-nullable|non-nullable but contains null")


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(value: Any) -> str:
    """A key value as a DataFusion SQL literal."""
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return str(int(value))


def create_delta_table(
    path: Location, schema: Any, settings: TableSettings, *, table: str, node: str
) -> None:
    """Blocking: create the empty table at ``path`` (the caller holds the lock).

    Version 0 is put create-if-absent (:func:`commit_log_entry`), so of writers creating the
    table at once exactly one does: delta-rs's own create, refused version 0, retries at
    version 1 and succeeds too (seen on S3), giving the table a second ``metaData``.

    Args:
        schema: the data columns (Arrow); the bucket column is added for a bucketed table.

    Raises:
        CommitConflictError: another writer created it first.
    """
    full, partition_by = with_layout(schema, settings)
    with map_deltars_errors(table, node):
        if settings.deletion_vectors:
            actions = _first_commit_with_deletion_vectors(full, partition_by, settings.properties())
        else:
            actions = _first_commit(path, full, partition_by, settings.properties())
        if is_table(path):  # version 0 of a long-lived table may be cleaned up: never put anew
            raise CommitConflictError(f"table {table!r} was created by another writer", node=node)
        delta_log_dir(path).mkdir(parents=True, exist_ok=True)  # nothing to do on a store
        commit_log_entry(path, 0, actions)


def _first_commit(
    path: Location, schema: Any, partition_by: list[str], properties: dict[str, str]
) -> list[dict[str, Any]]:
    """The actions of the first commit delta-rs gives such a table at ``path`` (its protocol
    follows from the properties), composed in a scratch directory (whose name its
    ``commitInfo`` gives as the table's location: put right here)."""
    import tempfile
    from pathlib import Path

    from deltalake import DeltaTable

    with tempfile.TemporaryDirectory(prefix="deltaflow-create-") as scratch:
        DeltaTable.create(
            scratch,
            schema,
            partition_by=partition_by or None,
            configuration=properties,
            # deltaflow.* keys are ours; delta-rs refuses keys it does not know without this.
            raise_if_key_not_exists=False,
        )
        entry = Path(scratch, "_delta_log", f"{0:020d}.json").read_text()
    actions = [json.loads(line) for line in entry.splitlines() if line]
    for action in actions:
        parameters = action.get("commitInfo", {}).get("operationParameters", {})
        if "location" in parameters:
            parameters["location"] = path.resolve().as_uri()
    return actions


def _first_commit_with_deletion_vectors(
    schema: Any, partition_by: list[str], properties: dict[str, str]
) -> list[dict[str, Any]]:
    """The table's first commit, composed here: delta-rs's own ways (creating with the
    property, or setting it afterwards) also add the ``variantType`` feature, which Delta 3.3
    (Spark) cannot read. The protocol is the one Spark gives such a table."""
    import time
    import uuid

    from deltalake import Schema

    now = int(time.time() * 1000)
    protocol = {
        "minReaderVersion": 3,
        "minWriterVersion": 7,
        "readerFeatures": ["deletionVectors"],
        "writerFeatures": ["deletionVectors", "appendOnly", "invariants"],
    }
    metadata = {
        "id": str(uuid.uuid4()),
        "format": {"provider": "parquet", "options": {}},
        "schemaString": Schema.from_arrow(schema).to_json(),
        "partitionColumns": partition_by,
        "configuration": properties,
        "createdTime": now,
    }
    info = {
        "timestamp": now,
        "operation": "CREATE TABLE",
        "operationParameters": {"partitionBy": json.dumps(partition_by)},
        "engineInfo": "deltaflow",
    }
    return [{"commitInfo": info}, {"protocol": protocol}, {"metaData": metadata}]


#: A MERGE copies every row of the files it touches. Once the candidate files hold more than
#: this many times the group's rows (an earlier MERGE gathered the rest of a straddled file
#: into its own), the group is applied by the copy-on-write of
#: :mod:`~deltaflow.tables.rewrite`, which splits them by key range again; below it the
#: MERGE, whose file work runs in Rust off the GIL, is cheaper (docs/tables.md).
REWRITE_ABOVE_COPIES: Final = 2


def _copies_much(footprint: Footprint, rows: int) -> bool:
    """Whether the files a MERGE of this group would copy hold many more rows than it."""
    files = footprint.files
    if files is None or footprint.column is None or "num_records" not in files.column_names:
        return False
    held = files.column("num_records").to_pylist()
    # A file without a row count may hold anything: count it as large.
    return sum(n if n is not None else rows for n in held) > REWRITE_ABOVE_COPIES * rows


class DeltaRsTableEngine(TableEngine):
    """Delta through delta-rs (the ``deltalake`` package): fast commits, no JVM."""

    name = "delta-rs"
    creates_deletion_vectors = True

    def merges_on_read(self, settings: TableSettings) -> bool:
        return settings.deletion_vectors

    def _start_engine(self) -> None:
        _require_deltalake()

    def describe(self, table: str, path: Location) -> TableDescription:
        with map_deltars_errors(table, self.node_id):
            return super().describe(table, path)

    def create(self, table: str, path: Location, schema: Any, settings: TableSettings) -> None:
        create_delta_table(path, schema, settings, table=table, node=self.node_id)

    def add_columns(self, table: str, path: Location, fields: Sequence[Any]) -> None:
        from deltalake import Field

        with map_deltars_errors(table, self.node_id):
            delta_table(path).alter.add_columns(
                [Field.from_arrow(f.with_nullable(True)) for f in fields]
            )

    def write(self, group: GroupWrite) -> None:
        try:
            version = self._write(group)
        except BaseException:
            self.log.forget(group.path)  # read afresh next time, whatever state it is in
            raise
        self._note_checkpoint(group.path, version)

    def _write(self, group: GroupWrite) -> int | None:
        """Apply the group in one commit; the commit's version when it is known without reading
        the log again (merge-on-read writes the log entry itself), else None."""
        import pyarrow.compute as pc
        from deltalake import CommitProperties, PostCommitHookProperties, write_deltalake

        path, key, data, footprint = group.path, group.key, group.data, group.footprint
        # Without a lock (object storage) a commit lands at exactly the version after the
        # one its lane marks were checked at, or not at all: delta-rs must not rebase it.
        retries = None if group.read_version is None else 0
        props = CommitProperties(
            custom_metadata={"userMetadata": group.metadata},
            max_commit_retries=retries,
            app_transactions=group.app_transactions() or None,
        )
        # The checkpoint is written after the lock is released (see TableEngine.checkpoint).
        hooks = PostCommitHookProperties(create_checkpoint=False)
        columns = [c for c in data.column_names if not internal(c)]
        with map_deltars_errors(group.table, self.node_id):
            listed = footprint is not None and footprint.files is not None
            merge_on_read = group.written is not None or listed
            if merge_on_read and len(key) == 1:
                target, planned = self.log.planned(path)
                self._check_read_version(group, planned)
                if has_deletion_vectors(target):
                    try:
                        done = self._merge_on_read(group, target, planned)
                        return self._commit_merge_on_read(path, done, group, planned)
                    except RewriteUnsupported as exc:
                        log.debug("table %s: merging this group (%s)", group.table, exc)
            target = self.log.latest(path)
            self._check_read_version(group, int(target.version()))
            if group.rule.history:  # versions are rebuilt by deltaflow's writer, never a MERGE
                rebuilt = rewrite(
                    target, path, data, footprint, props, hooks, group.sequence, group.rule,
                    key=key[0],
                )  # fmt: skip
                self.landed(path, rebuilt)
                return None
            if footprint is None:
                rows = data.filter(pc.invert(data.column(DELETE_COLUMN))).select(columns)
                write_deltalake(
                    target,
                    rows,
                    mode="append",
                    commit_properties=props,
                    post_commithook_properties=hooks,
                )
                return None
            if _copies_much(footprint, data.num_rows):
                try:
                    self.landed(
                        path,
                        rewrite(
                            target, path, data, footprint, props, hooks, group.sequence, group.rule
                        ),
                    )
                    return None
                except RewriteUnsupported as exc:
                    log.debug("table %s: merging this group (%s)", group.table, exc)
            flag = f"s.{_quote(DELETE_COLUMN)}"
            values = {_quote(c): f"s.{_quote(c)}" for c in columns}
            # A stored row of a sequence not lower stays (sequence_by tables); the merge mode
            # says what the others become.
            clauses = matched_clauses(
                [c for c in columns if c not in key and c != BUCKET_COLUMN],
                group.rule,
                group.sequence,
                _quote,
                replacing=REPLACE_COLUMN in data.column_names,
                nulls=NULLS_COLUMN in data.column_names,
                moved=footprint.levels is not None,
            )
            merger = target.merge(
                data,
                predicate=footprint.merge_condition(key, _quote, _literal),
                source_alias="s",
                target_alias="t",
                streamed_exec=False,
                commit_properties=props,
                post_commithook_properties=hooks,
            )
            for condition, sets in clauses:
                if sets is None:
                    merger = merger.when_matched_delete(predicate=condition)
                else:
                    updates = {_quote(c): v for c, v in sets.items()}
                    merger = merger.when_matched_update(updates=updates, predicate=condition)
            before = target.version()
            merger.when_not_matched_insert(updates=values, predicate=f"NOT {flag}").execute()
            if target.version() == before:
                # delta-rs commits nothing for a MERGE that changes no row (every change older
                # than its stored row, or deletes of absent keys): the lane marks must land.
                target.create_write_transaction(
                    [],
                    mode="append",
                    schema=target.schema(),
                    partition_by=list(target.metadata().partition_columns) or None,
                    commit_properties=props,
                    post_commithook_properties=hooks,
                )
            return None

    def _check_read_version(self, group: GroupWrite, version: int) -> None:
        """Raises CommitConflictError when the group's commit would not land at exactly the
        version after the one its lane marks were checked at (see ``GroupWrite``)."""
        if group.read_version is not None and version != group.read_version:
            raise CommitConflictError(
                f"table {group.table!r} is at version {version}, its lane marks were read at "
                f"{group.read_version}: checking them again",
                node=self.node_id,
            )

    def checkpoint(self, table: str, path: Location, version: int) -> None:
        with map_deltars_errors(table, self.node_id):
            super().checkpoint(table, path, version)

    def _commit_merge_on_read(
        self, path: Location, done: MergeOnRead, group: GroupWrite, planned: int
    ) -> int:
        """Commit a group applied by merge-on-read (:mod:`~deltaflow.tables.merge_on_read`) on
        table version ``planned`` by writing the next log entry directly (delta-rs's
        transaction API takes no deletion vectors)."""
        version = planned + 1
        info = {
            "timestamp": done.timestamp,
            "operation": "MERGE",
            "operationParameters": {"mode": "merge-on-read"},
            "readVersion": planned,
            "isBlindAppend": False,
            "userMetadata": group.metadata,
            "engineInfo": f"deltaflow {self.name}",
        }
        fault_point("before_commit")
        actions = [{"commitInfo": info}, *done.actions(), *group.transactions]
        commit_log_entry(path, version, actions)
        self.landed(path, done)
        return version
