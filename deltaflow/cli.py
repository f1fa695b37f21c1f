"""The ``deltaflow`` command: ``serve`` a node, ``cluster status``, run the ``demo``,
``table`` maintenance; ``jars``, ``spark-connect`` and ``store check`` are in
:mod:`.cli_infrastructure`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from typing import Any

from .cli_cluster import add_cluster_commands
from .cli_config import add_config_commands, settings_of
from .cli_infrastructure import add_infrastructure_commands, add_warehouse, warehouse_of
from .engines.options import (
    DEFAULT_ENGINE,
    DELTA_RS,
    ENGINE_NAMES,
    SPARK,
    SparkOptions,
)
from .errors import UsageError
from .server.config_layers import add_flags
from .tables.maintenance import DEFAULT_RETENTION_HOURS
from .tables.settings import MERGE_MODES

__all__ = ["main"]

log = logging.getLogger("deltaflow.cli")


def _serve(args: argparse.Namespace) -> int:
    from .server import Node
    from .server.config_layers import node_config

    config = node_config(settings_of(args))

    async def run() -> None:
        node = Node(config)
        signalled = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signalled.set)
        # A signal during the start (Spark starting, side inputs awaited) abandons it.
        starting = asyncio.create_task(node.start())
        first = asyncio.create_task(signalled.wait())
        await asyncio.wait([starting, first], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            log.info("node %s: signalled while starting; stopped", node.node_id)
            return
        starting.result()  # the start's error, if any
        print(f"deltaflow node {node.node_id} ready on {node.address}", flush=True)
        # The first SIGTERM or SIGINT drains (hands the partitions over, finishes, stops); a
        # second one stops at once. `deltaflow node drain` drains through the node's API.
        stopped = asyncio.create_task(node.wait_stopped())
        await asyncio.wait([stopped, first], return_when=asyncio.FIRST_COMPLETED)
        if first.done():
            signalled.clear()
            drain = asyncio.create_task(node.drain(asked_by="signal"))
            again = asyncio.create_task(signalled.wait())
            await asyncio.wait([drain, again], return_when=asyncio.FIRST_COMPLETED)
            if not drain.done():
                log.warning("second signal: stopping without finishing the drain")
                drain.cancel()
                await node.stop()
            again.cancel()
        await node.wait_stopped()

    asyncio.run(run())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(rows=args.rows, warehouse=args.warehouse, engine=args.engine)


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


def _table_create(args: argparse.Namespace) -> int:
    from .engines import create_table
    from .engines.options import EngineOptions
    from .spark_integration.session import SparkConfig

    name = args.name or args.table
    if not name or (args.name and args.table and args.name != args.table):
        raise UsageError("name the table once: deltaflow table create --warehouse W NAME ...")
    engine: str | EngineOptions = args.engine
    if args.engine == SPARK:
        engine = SparkOptions(
            config=SparkConfig(master=args.spark_master, driver_memory=args.driver_memory)
        )
    settings = create_table(
        warehouse_of(args),
        name,
        schema=args.schema,
        key=[k for k in (args.key or "").split(",") if k],
        buckets=args.buckets,
        allow_schema_evolution=args.allow_schema_evolution,
        deletion_vectors=args.deletion_vectors,
        engine=engine,
        sequence_by=[c for c in (args.sequence_by or "").split(",") if c],
        tombstone_retention=args.tombstone_retention,
        merge=args.merge,
        aggregates=_aggregates(args.aggregates),
        history=args.history,
        track_history_on=[c for c in (args.track_history_on or "").split(",") if c],
    )
    print(f"table {name} created: {settings.describe()}")
    return 0


def _table(args: argparse.Namespace) -> int:
    from .tables import maintenance
    from .tables.settings import read_table_settings

    warehouse = warehouse_of(args)
    if args.table_command == "create":
        _table_create(args)
    elif args.table_command == "optimize":
        metrics = maintenance.optimize(warehouse, args.table)
        print(
            f"table {args.table}: {metrics.get('numFilesRemoved', 0)} files compacted into "
            f"{metrics.get('numFilesAdded', 0)}"
        )
    elif args.table_command == "vacuum":
        doomed = maintenance.vacuum(
            warehouse, args.table, retention_hours=args.retention_hours, dry_run=args.dry_run
        )
        verb = "would delete" if args.dry_run else "deleted"
        print(f"table {args.table}: {verb} {len(doomed)} files")
        for name in doomed:
            print(f"  {name}")
    elif args.table_command == "history":
        for row in maintenance.history(warehouse, args.table, limit=args.limit):
            print(
                f"v{row['version']:<6} {row['operation']:<10} node={row['node'] or '-':<12} "
                f"rows={row['rows_written']}"
            )
    else:
        count, rows = maintenance.show(
            warehouse, args.table, limit=args.limit, all_columns=args.all_columns
        )
        print(f"table {args.table}: {count} rows")
        print(f"settings: {read_table_settings(warehouse, args.table).describe()}")
        for row in rows:
            print(f"  {row}")
    # delta-rs's runtime threads can abort the interpreter's teardown on a busy machine
    # ("terminate called without an active exception") after the work is done; leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _name_and_bound(text: str) -> tuple[str, int]:
    name, sep, bound = text.partition("=")
    if not sep or not name or not bound.isdigit() or int(bound) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=N with N >= 1, got {text!r}")
    return name, int(bound)


def _node_default(name: str) -> Any:
    """A node setting's default, as ``NodeConfig`` declares it (its one home)."""
    from .server import NodeConfig

    return _field_default(NodeConfig, name)


def _spark_default(name: str) -> Any:
    """A Spark setting's default, as ``SparkConfig`` declares it."""
    from .spark_integration.session import SparkConfig

    return _field_default(SparkConfig, name)


def _field_default(cls: Any, name: str) -> Any:
    [default] = [f.default for f in dataclasses.fields(cls) if f.name == name]
    return default


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="deltaflow",
        description="Stream records into Delta Lake tables through a cluster of nodes.",
        epilog="Exit codes: 0 success; 1 the operation failed; 2 refused or bad usage; "
        "69 a service could not be reached; 78 the configuration is not valid; 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"deltaflow {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=None,
        help="text for people (default), json: one object a line",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run a node",
        description="Run a node. Every setting is a flag, a key of the --config file and a "
        "DELTAFLOW_* environment variable; flags win over the environment, which wins over the "
        "file (docs/configuration.md).",
    )
    add_flags(serve)
    serve.set_defaults(func=_serve)

    add_cluster_commands(sub)
    add_config_commands(sub)

    demo = sub.add_parser("demo", help="two local nodes, 200,000 rows into a Delta table")
    demo.add_argument("--rows", type=int, default=200_000)
    demo.add_argument("--warehouse", default=None, help="default: a temporary directory")
    demo.add_argument("--engine", choices=ENGINE_NAMES, default=DEFAULT_ENGINE)
    demo.set_defaults(func=_demo)

    table = sub.add_parser("table", help="inspect and maintain a deltaflow table")
    tsub = table.add_subparsers(dest="table_command", required=True)
    for name, text in (
        ("optimize", "compact small files (holds the table's commit lock)"),
        ("history", "latest commits, with the node that wrote each"),
        ("show", "row count and first rows"),
    ):
        cmd = tsub.add_parser(name, help=text)
        add_warehouse(cmd)
        cmd.add_argument("--table", required=True)
        cmd.add_argument("--limit", type=int, default=10)
        if name == "show":
            cmd.add_argument(
                "--all-columns",
                action="store_true",
                help="also show deltaflow's bucket column (_deltaflow_bucket)",
            )
        cmd.set_defaults(func=_table)
    vacuum = tsub.add_parser(
        "vacuum",
        help="delete files no version within the retention needs (keeps deletion vectors)",
    )
    add_warehouse(vacuum)
    vacuum.add_argument("--table", required=True)
    vacuum.add_argument(
        "--retention-hours",
        type=int,
        default=DEFAULT_RETENTION_HOURS,
        help="keep files needed by versions of the last N hours (default %(default)s, 7 days)",
    )
    vacuum.add_argument("--dry-run", action="store_true", help="list the files, delete nothing")
    vacuum.set_defaults(func=_table)
    create = tsub.add_parser(
        "create", help="create an empty table with a schema, key, layout and settings"
    )
    create.add_argument("name", nargs="?", help="the table name")
    create.add_argument("--table", help="the table name (instead of NAME)")
    add_warehouse(create)
    create.add_argument(
        "--schema", required=True, help="columns as 'id:long,name:string,price:decimal(10,2)'"
    )
    create.add_argument("--key", help="merge key column(s), comma-separated; none: append table")
    create.add_argument(
        "--buckets", type=int, default=None, help="bucket layout (default 64 with a key; 0: off)"
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
    create.add_argument("--spark-master", default="local[*]")
    create.add_argument("--driver-memory", default="2g")
    create.set_defaults(func=_table)

    add_infrastructure_commands(sub, _spark_default("driver_memory"))

    args = parser.parse_args(argv)
    from .errors import DeltaflowError
    from .logs import configure
    from .server.config_layers import EX_CONFIG, ConfigError

    try:
        if args.func is _serve:
            settings = settings_of(args)
            if args.log_format and not hasattr(args, "setting_log__format"):
                args.setting_log__format = args.log_format
                settings = settings_of(args)
            configure(settings["log.level"], settings["log.format"])
        else:
            configure("info" if args.verbose else "warning", args.log_format or "text")
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:
        print(f"deltaflow: {exc}", file=sys.stderr)
        return EX_CONFIG
    except DeltaflowError as exc:  # a clear message, not a traceback
        print(f"deltaflow: {exc}", file=sys.stderr)
        return 2


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deltaflow")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
