"""The ``deltaflow`` command: ``serve`` a node, ``cluster status``, run the ``demo``,
``table`` maintenance; ``jars``, ``spark-connect`` and ``store check`` are in
:mod:`.cli_infrastructure`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from typing import Any

from .cli_cluster import add_cluster_commands, peer_token_of, token_of
from .cli_infrastructure import add_infrastructure_commands, add_warehouse, warehouse_of
from .engines.options import (
    DEFAULT_ENGINE,
    DELTA_RS,
    ENGINE_NAMES,
    SPARK,
    SPARK_WRITERS,
    SparkOptions,
    engine_options,
)
from .errors import UsageError
from .tables.maintenance import DEFAULT_RETENTION_HOURS
from .tables.settings import MERGE_MODES

__all__ = ["main"]

log = logging.getLogger("deltaflow.cli")


def _serve(args: argparse.Namespace) -> int:
    from .security import NodeTls
    from .server import Node, NodeConfig
    from .spark_integration import SparkConfig

    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        tls = NodeTls(args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_auth)
    elif args.tls_ca or args.tls_client_auth:
        raise UsageError("--tls-ca and --tls-client-auth need --tls-cert and --tls-key")
    # Checked whatever the engine, as the Spark flags always were.
    spark = SparkOptions(
        config=SparkConfig(
            master=args.spark_master,
            app_name=f"deltaflow-{args.node_id}",  # one application per node, by its name
            driver_memory=args.driver_memory,
            java_options=args.driver_java_options,
            max_cores=args.spark_max_cores,
            executor_memory=args.spark_executor_memory,
            executor_wait=args.spark_executor_wait,
        ),
        writer=args.spark_writer,
    )
    config = NodeConfig(
        node_id=args.node_id,
        host=args.host,
        port=args.port,
        advertise=args.advertise,
        warehouse=args.warehouse,
        storage_options=dict(args.storage_option),
        peers=[p for p in (args.peers or "").split(",") if p],
        receivers=args.receiver or [],
        receiver_concurrency=dict(args.receiver_concurrency or []),
        token=token_of(args),
        peer_token=peer_token_of(args),
        tls=tls,
        insecure=args.insecure,
        partitions=args.partitions,
        max_frame_bytes=args.max_frame_bytes,
        heartbeat_interval=args.heartbeat_interval,
        failure_timeout=args.failure_timeout,
        peer_expiry=args.peer_expiry,
        max_group_rows=args.max_group_rows,
        max_group_bytes=args.max_group_bytes,
        min_commit_interval=args.min_commit_interval,
        table_buckets=args.table_buckets,
        schema_evolution=args.schema_evolution,
        deletion_vectors=args.deletion_vectors,
        side_inputs=args.side_input or [],
        side_input_timeout=args.side_input_timeout,
        side_input_lease=args.side_input_lease,
        side_input_poll_interval=args.side_input_poll_interval,
        engine=spark if args.engine == SPARK else engine_options(args.engine),
    )

    async def run() -> None:
        node = Node(config)
        signalled = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signalled.set)
        await node.start()
        print(f"deltaflow node {node.node_id} ready on {node.address}", flush=True)
        # The first SIGTERM or SIGINT drains (hands the partitions over, finishes, stops); a
        # second one stops at once. `deltaflow node drain` drains through the node's API.
        stopped = asyncio.create_task(node.wait_stopped())
        first = asyncio.create_task(signalled.wait())
        await asyncio.wait([stopped, first], return_when=asyncio.FIRST_COMPLETED)
        if first.done():
            signalled.clear()
            drain = asyncio.create_task(node.drain())
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
    parser = argparse.ArgumentParser(prog="deltaflow", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a node")
    serve.add_argument("--node-id", required=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=_node_default("port"))
    serve.add_argument("--advertise", help="host:port clients and peers reach this node at")
    add_warehouse(serve)
    serve.add_argument("--peers", help="other nodes as host:port,host:port")
    serve.add_argument("--receiver", action="append", help="allow a receiver class (repeatable)")
    serve.add_argument(
        "--receiver-concurrency",
        action="append",
        type=_name_and_bound,
        metavar="NAME=N",
        help="at most N receive() calls of receiver NAME at once on this node (repeatable)",
    )
    serve.add_argument("--token-file", help="file holding the client token (clients present it)")
    serve.add_argument(
        "--peer-token-file",
        help="file holding the peer token: nodes and operators prove it to change membership "
        "or drain; clients never hold it",
    )
    serve.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    serve.add_argument("--tls-key", help="the key of --tls-cert (PEM)")
    serve.add_argument("--tls-ca", help="the CA peers' (and clients') certificates must chain to")
    serve.add_argument(
        "--tls-client-auth",
        action="store_true",
        help="require a certificate signed by --tls-ca from every client and peer (mutual TLS)",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="UNSAFE: listen beyond loopback without a credential, TLS or a peer credential",
    )
    serve.add_argument("--partitions", type=int, default=_node_default("partitions"))
    serve.add_argument(
        "--spark-master",
        default="local[*]",
        help="local[*] (default), a Spark master URL or an sc:// Connect URL",
    )
    serve.add_argument(
        "--engine",
        choices=ENGINE_NAMES,
        default=DEFAULT_ENGINE,
        help=f"table engine (default: {DEFAULT_ENGINE})",
    )
    serve.add_argument(
        "--spark-writer",
        choices=SPARK_WRITERS,
        default=_field_default(SparkOptions, "writer"),
        help="spark engine: the node writes the files and commits them through Spark's Delta "
        "(direct, default), or Spark MERGEs every group (sql); see docs/tables.md",
    )
    serve.add_argument(
        "--driver-memory",
        default=_spark_default("driver_memory"),
        help="embedded Spark driver heap (default %(default)s)",
    )
    serve.add_argument(
        "--spark-max-cores",
        type=int,
        default=_spark_default("max_cores"),
        help="spark:// masters: the cores this node's application takes at most "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--spark-executor-memory",
        default=_spark_default("executor_memory"),
        help="spark:// masters: each executor's heap (default %(default)s)",
    )
    serve.add_argument(
        "--spark-executor-wait",
        type=float,
        default=_spark_default("executor_wait"),
        help="spark:// masters: seconds to wait at start for an executor (default %(default)s)",
    )
    serve.add_argument(
        "--driver-java-options",
        default=None,
        metavar="OPTS",
        help="embedded Spark driver JVM options (default: C1 compiler and serial GC with the "
        "direct writer, the JVM's own defaults with the sql writer); see docs/configuration.md",
    )
    serve.add_argument("--max-frame-bytes", type=int, default=_node_default("max_frame_bytes"))
    for name in ("heartbeat_interval", "failure_timeout"):
        flag = "--" + name.replace("_", "-")
        serve.add_argument(flag, type=float, default=_node_default(name), help="seconds")
    serve.add_argument(
        "--peer-expiry",
        type=float,
        default=_node_default("peer_expiry"),
        help="seconds without an answer after which a peer has left the cluster (default "
        "%(default)s; more than --failure-timeout)",
    )
    serve.add_argument("--max-group-rows", type=int, default=_node_default("max_group_rows"))
    serve.add_argument(
        "--max-group-bytes",
        type=int,
        default=_node_default("max_group_bytes"),
        help="largest group commit in bytes of Arrow data (default %(default)s)",
    )
    serve.add_argument(
        "--min-commit-interval",
        type=float,
        default=_node_default("min_commit_interval"),
        help="seconds between taking two groups of a table for commit on this node, at "
        "least, unless a whole group is queued (default 0: as soon as the previous commit ends)",
    )
    serve.add_argument(
        "--table-buckets",
        type=int,
        default=None,
        help="buckets of keyed tables created on first write (default: the partition count if "
        "at most 64, else its largest divisor up to 64; 0: no bucket layout)",
    )
    serve.add_argument(
        "--schema-evolution",
        action="store_true",
        help="tables created on first write accept new columns",
    )
    serve.add_argument(
        "--deletion-vectors",
        action="store_true",
        help="tables created on first write get Delta deletion vectors (delta-rs: merge-on-read)",
    )
    serve.add_argument(
        "--side-input",
        action="append",
        metavar="module.Class",
        help="serve a side input class to the receivers (repeatable)",
    )
    serve.add_argument(
        "--side-input-timeout",
        type=float,
        default=_node_default("side_input_timeout"),
        help="seconds to wait at start for every side input's value (default %(default)s)",
    )
    serve.add_argument(
        "--side-input-lease",
        type=float,
        default=_node_default("side_input_lease"),
        help="seconds a side input's leader lease lasts unrenewed (default %(default)s)",
    )
    serve.add_argument(
        "--side-input-poll-interval",
        type=float,
        default=_node_default("side_input_poll_interval"),
        help="seconds between checks for new side-input versions (default %(default)s)",
    )
    serve.set_defaults(func=_serve)

    add_cluster_commands(sub)

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
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from .errors import DeltaflowError

    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except DeltaflowError as exc:  # a clear message, not a traceback
        print(f"deltaflow: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
