"""``deltaflow table create|show|history|optimize|vacuum NAME``: a table of the warehouse,
named as a positional argument; the warehouse from ``--warehouse``, else ``DELTAFLOW_WAREHOUSE``
or the config file a node reads (``--config``, ``$DELTAFLOW_CONFIG``), so an operator on a
node's host types only the table's name."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import decimal
from typing import Any

from .cli_output import plain, print_json, print_table, readable
from .engines.options import DELTA_RS, ENGINE_NAMES, SPARK, SparkOptions
from .errors import UsageError
from .tables.maintenance import DEFAULT_RETENTION_HOURS, INTERNAL_PREFIXES
from .tables.settings import MERGE_MODES

__all__ = ["add_table_commands", "warehouse_of"]


def warehouse_of(args: argparse.Namespace) -> Any:
    """The warehouse the command names: ``--warehouse`` and ``--storage-option``, else the
    settings a node would read (environment, config file)."""
    from .cli_infrastructure import storage_options_of
    from .server.config_layers import resolve
    from .storage.paths import location

    if args.warehouse:
        return location(args.warehouse, storage_options_of(args))
    settings = resolve(file=getattr(args, "config", None), require=False)
    if not settings["warehouse"]:
        raise UsageError(
            "no warehouse: pass --warehouse DIR|URI, or set DELTAFLOW_WAREHOUSE or a config "
            "file (--config FILE, DELTAFLOW_CONFIG) with warehouse = ..."
        )
    options = {**settings["storage_options"], **dict(args.storage_option)}
    return location(settings["warehouse"], options)


def _table_name(args: argparse.Namespace) -> str:
    name = args.name or args.table
    if not name or (args.name and args.table and args.name != args.table):
        raise UsageError(f"name the table once: deltaflow table {args.table_command} NAME")
    return str(name)


def add_table_commands(sub: Any) -> None:
    from .cli_infrastructure import add_warehouse

    table = sub.add_parser("table", help="inspect and maintain a deltaflow table")
    tsub = table.add_subparsers(dest="table_command", required=True)

    def command(name: str, text: str, *, data: bool = True) -> argparse.ArgumentParser:
        cmd: argparse.ArgumentParser = tsub.add_parser(name, help=text, description=text)
        if data:  # it prints data: as aligned text, or one JSON document
            cmd.add_argument("--json", action="store_true", help="one JSON document")
        cmd.add_argument("name", nargs="?", metavar="NAME", help="the table")
        cmd.add_argument("--table", help=argparse.SUPPRESS)  # the older spelling
        add_warehouse(cmd, required=False)
        cmd.add_argument(
            "--config", metavar="FILE", help="read the warehouse from this node config file"
        )
        return cmd

    show = command("show", "row count, settings and the first rows")
    show.add_argument("--limit", type=int, default=10, help="rows to show (default 10)")
    show.add_argument(
        "--all-columns",
        action="store_true",
        help="also show deltaflow's own columns (_deltaflow_bucket...)",
    )
    show.set_defaults(func=_show)
    history = command(
        "history", "the latest commits: time, operation, node, rows added and removed, streams"
    )
    history.add_argument("--limit", type=int, default=10, help="commits to show (default 10)")
    history.set_defaults(func=_history)
    optimize = command("optimize", "compact small files (holds the table's commit lock)")
    optimize.set_defaults(func=_optimize)
    vacuum = command(
        "vacuum", "delete files no version within the retention needs (keeps deletion vectors)"
    )
    vacuum.add_argument(
        "--retention-hours",
        type=int,
        default=DEFAULT_RETENTION_HOURS,
        help="keep files needed by versions of the last N hours (default %(default)s, 7 days)",
    )
    vacuum.add_argument("--dry-run", action="store_true", help="list the files, delete nothing")
    vacuum.add_argument(
        "--force",
        action="store_true",
        help="vacuum with a retention below the table's delta.deletedFileRetentionDuration",
    )
    vacuum.set_defaults(func=_vacuum)
    _add_create(
        command(
            "create", "create an empty table with a schema, key, layout and settings", data=False
        )
    )


def _add_create(create: argparse.ArgumentParser) -> None:
    create.add_argument(
        "--schema", required=True, help="columns as 'id:long,name:string,price:decimal(10,2)'"
    )
    create.add_argument("--key", help="merge key column(s), comma-separated; none: append table")
    create.add_argument(
        "--buckets", type=int, default=None, help="bucket layout (default 64 with a key; 0: off)"
    )
    create.add_argument(
        "--bucket-rows",
        type=int,
        default=None,
        help="rows per bucket the layout grows by (default 4096; 0: every bucket at once)",
    )
    create.add_argument(
        "--allow-schema-evolution", action="store_true", help="writes may add columns"
    )
    create.add_argument(
        "--deletion-vectors", action="store_true", help="Delta deletion vectors (merge-on-read)"
    )
    create.add_argument(
        "--sequence-by",
        help="column(s) ordering the changes to a key, comma-separated (docs/cdc.md): a change "
        "applies only if its sequence is greater than the table's",
    )
    create.add_argument(
        "--merge",
        choices=MERGE_MODES,
        default="last",
        help="how a change merges with the stored row of its key (default last: it replaces it)",
    )
    create.add_argument(
        "--aggregates",
        help="with --merge aggregate: column=sum|min|max|last_non_null, comma-separated",
    )
    create.add_argument(
        "--history",
        choices=("none", "scd2"),
        default="none",
        help="scd2: keep every version of a key, with __start_at and __end_at (needs "
        "--sequence-by)",
    )
    create.add_argument(
        "--track-history-on",
        help="with --history scd2: the columns whose change opens a version, comma-separated "
        "(default: all)",
    )
    create.add_argument(
        "--tombstone-retention",
        default="7 days",
        help="with --sequence-by: how long a deleted key's sequence is kept (default 7 days)",
    )
    create.add_argument(
        "--engine",
        choices=ENGINE_NAMES,
        default=DELTA_RS,
        help="what creates the table (default delta-rs: no JVM)",
    )
    create.add_argument("--spark-master", default="local[*]", help="with --engine spark")
    create.add_argument("--driver-memory", default="2g", help="with --engine spark")
    create.set_defaults(func=_create)


def _aggregates(text: str | None) -> dict[str, str]:
    """``--aggregates amount=sum,qty=max`` as a dict."""
    out = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        column, sep, function = part.partition("=")
        if not sep or not column.strip():
            raise UsageError(f"--aggregates entry {part!r} is not column=function")
        out[column.strip()] = function.strip()
    return out


def _columns(text: str | None) -> list[str]:
    return [c for c in (text or "").split(",") if c]


def _create(args: argparse.Namespace) -> int:
    from .engines import create_table
    from .engines.options import EngineOptions
    from .spark_integration.session import SparkConfig

    name = _table_name(args)
    engine: str | EngineOptions = args.engine
    if args.engine == SPARK:
        engine = SparkOptions(
            config=SparkConfig(master=args.spark_master, driver_memory=args.driver_memory)
        )
    settings = create_table(
        warehouse_of(args),
        name,
        schema=args.schema,
        key=_columns(args.key),
        buckets=args.buckets,
        bucket_rows=args.bucket_rows,
        allow_schema_evolution=args.allow_schema_evolution,
        deletion_vectors=args.deletion_vectors,
        engine=engine,
        sequence_by=_columns(args.sequence_by),
        tombstone_retention=args.tombstone_retention,
        merge=args.merge,
        aggregates=_aggregates(args.aggregates),
        history=args.history,
        track_history_on=_columns(args.track_history_on),
    )
    print(f"table {name} created: {settings.describe()}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from .tables import maintenance
    from .tables.settings import read_table_settings

    name, warehouse = _table_name(args), warehouse_of(args)
    count, rows = maintenance.show(warehouse, name, limit=args.limit, all_columns=True)
    settings = read_table_settings(warehouse, name)
    compacted = maintenance.last_compaction(warehouse, name)
    last = {k: _jsonable(v) for k, v in compacted.items()} if compacted else None
    columns = [c for c in (rows[0] if rows else {}) if args.all_columns or not _internal(c)]
    if args.json:
        print_json({
            "table": name,
            "rows": count,
            "settings": dataclasses.asdict(settings),
            "last_compaction": last,
            "sample": [{c: _jsonable(r[c]) for c in columns} for r in rows],
        })  # fmt: skip
        return 0
    print(f"table {name}: {count} rows")
    print(f"settings: {plain(settings.describe())}")  # column names are data too
    if compacted is None:
        print("last compacted: not in its last 1,000 versions")
    else:
        print(
            f"last compacted: version {compacted['version']} at {readable(compacted['time'])}"
            f" ({compacted['files_removed']} files into {compacted['files_added']})"
        )
    if rows:
        print_table(columns, ([readable(r[c]) for c in columns] for r in rows))
    return 0


def _history(args: argparse.Namespace) -> int:
    from .tables import maintenance

    name = _table_name(args)
    commits = maintenance.history(warehouse_of(args), name, limit=args.limit)
    if args.json:
        print_json(commits)
        return 0
    header = ("VERSION", "TIME", "OPERATION", "NODE", "WRITERS", "+ROWS", "-ROWS", "STREAMS")
    print_table(
        header,
        (
            (
                c["version"],
                readable(c["time"]),
                c["operation"],
                c["node"] or "",
                ",".join(c["writers"][:_SHOWN]) + _more(c["writers"]),
                _count(c["rows_added"]),
                _count(c["rows_removed"]),
                _streams(c["streams"]),
            )
            for c in commits
        ),
    )
    return 0


def _optimize(args: argparse.Namespace) -> int:
    from .tables import maintenance

    name = _table_name(args)
    metrics = maintenance.optimize(warehouse_of(args), name)
    removed, added = metrics.get("numFilesRemoved", 0), metrics.get("numFilesAdded", 0)
    if args.json:
        print_json({"table": name, "files_removed": removed, "files_added": added})
    else:
        print(f"table {name}: {removed} files compacted into {added}")
    return 0


def _vacuum(args: argparse.Namespace) -> int:
    from .tables import maintenance

    name = _table_name(args)
    doomed = maintenance.vacuum(
        warehouse_of(args),
        name,
        retention_hours=args.retention_hours,
        dry_run=args.dry_run,
        force=args.force,
    )
    if args.json:
        print_json({"table": name, "dry_run": args.dry_run, "files": list(doomed)})
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(f"table {name}: {verb} {len(doomed)} files")
    for file in doomed:
        print(f"  {plain(file)}")
    return 0


#: Writers and streams a commit's row shows (``--json`` lists them all).
_SHOWN = 8


def _more(listed: Any) -> str:
    return f" (+{len(listed) - _SHOWN} more)" if len(listed) > _SHOWN else ""


def _streams(streams: dict[str, int]) -> str:
    shown = sorted(streams.items())[:_SHOWN]
    return ", ".join(f"{s} ({n} lanes)" for s, n in shown) + _more(streams)


def _internal(column: str) -> bool:
    return column.startswith(INTERNAL_PREFIXES)


def _count(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, (datetime.date, datetime.datetime, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    return value
