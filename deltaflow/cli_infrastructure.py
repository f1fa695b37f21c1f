"""The ``deltaflow`` subcommands about what surrounds the nodes: ``jars`` (Delta's jars),
``spark-connect`` (a Spark Connect server with Delta) and ``store check`` (an object store's
conditional writes)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .cli_output import print_json

__all__ = [
    "add_infrastructure_commands",
    "add_storage_option",
    "add_warehouse",
    "storage_options_of",
    "warehouse_of",
]


def add_storage_option(parser: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable): an object store's settings."""
    parser.add_argument(
        "--storage-option",
        type=_storage_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an object store setting (repeatable), by delta-rs's names, e.g. "
        "AWS_ENDPOINT_URL=http://127.0.0.1:7070; secrets only from the environment: the AWS_* "
        "variables, or DELTAFLOW_STORAGE_OPTIONS_<NAME>",
    )


def add_warehouse(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """``--warehouse`` (a directory or an object-store URI) and ``--storage-option``."""
    parser.add_argument(
        "--warehouse",
        required=required,
        help="where the Delta tables are: a directory, or s3://bucket/prefix (see "
        "docs/object-storage.md)",
    )
    add_storage_option(parser)


def warehouse_of(args: argparse.Namespace) -> Any:
    """The warehouse the command names, as a location (a path, or a place on a store)."""
    from .storage.paths import location

    return location(args.warehouse, storage_options_of(args))


def storage_options_of(args: argparse.Namespace) -> dict[str, str]:
    """``DELTAFLOW_STORAGE_OPTIONS_*`` from the environment, then ``--storage-option``."""
    from .server.config_layers import storage_options_from_env

    return {**storage_options_from_env(), **dict(args.storage_option)}


def add_infrastructure_commands(sub: Any, driver_memory: str) -> None:
    """Add the subcommands to ``sub`` (the ``deltaflow`` parser's subparsers)."""
    jars = sub.add_parser("jars", help="fetch Delta's jars from Maven Central into the cache")
    jars.add_argument(
        "--object-store",
        action="store_true",
        help="also S3A's jars (the AWS SDK bundle: about 690 MB) and deltaflow's S3 log store, "
        "built with javac: what the spark engine needs on an s3:// warehouse",
    )
    jars.add_argument("--json", action="store_true", help="the jars as a JSON list")
    jars.set_defaults(func=_jars)

    store = sub.add_parser("store", help="check an object store for deltaflow's tables")
    ssub = store.add_subparsers(dest="store_command", required=True)
    check = ssub.add_parser(
        "check", help="check that a store honours conditional writes (commits rely on them)"
    )
    check.add_argument("uri", help="a location on the store, e.g. s3://bucket/warehouse")
    check.add_argument("--json", action="store_true", help="one JSON document")
    add_storage_option(check)
    check.set_defaults(func=_store_check)

    connect = sub.add_parser(
        "spark-connect",
        help="run a Spark Connect server with Delta from the installed pyspark, for nodes "
        "started with --spark-master sc://HOST:PORT",
    )
    connect.add_argument("--host", default="127.0.0.1", help="address to listen on")
    connect.add_argument("--port", type=int, default=15002, help="default %(default)s")
    connect.add_argument(
        "--master", default="local[*]", help="where its jobs run: local[*] or spark://HOST:PORT"
    )
    connect.add_argument("--driver-memory", default=driver_memory)
    connect.add_argument(
        "--conf",
        type=_setting,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a further Spark setting (repeatable), e.g. spark.cores.max=2",
    )
    connect.set_defaults(func=_spark_connect)


def _jars(args: argparse.Namespace) -> int:
    from .spark_integration.jars import ensure_jars

    jars = ensure_jars()
    if args.object_store:
        from .spark_integration.s3a import ensure_object_store_jars

        jars += ensure_object_store_jars()
    if args.json:
        print_json([str(jar) for jar in jars])
        return 0
    for jar in jars:
        print(jar)
    return 0


def _store_check(args: argparse.Namespace) -> int:
    """Check that a store honours conditional writes, as commits on it need."""
    from .storage.conditional import check_conditional_writes, first_line, store_errors

    options = storage_options_of(args)
    try:
        check = check_conditional_writes(args.uri, options)
    except store_errors() as exc:
        why = first_line(exc, options)
        print(f"deltaflow: cannot check the store {args.uri}: {why}", file=sys.stderr)
        return 2
    if args.json:
        print_json({
            "uri": check.uri, "ok": check.ok, "create_refused": check.create_refused,
            "stale_etag_refused": check.stale_etag_refused, "racers": check.racers,
            "winners": check.winners, "problems": check.problems(),
        })  # fmt: skip
        if not check.ok:
            print(f"deltaflow: {check.refusal()}", file=sys.stderr)
        return 0 if check.ok else 2
    print(f"store {check.uri}:")
    print(f"  create of an existing key refused:   {_yes(check.create_refused)}")
    print(f"  write on a stale ETag refused:       {_yes(check.stale_etag_refused)}")
    print(f"  racing creates of one key:           {check.winners} of {check.racers} won")
    if not check.ok:
        print(f"deltaflow: {check.refusal()}", file=sys.stderr)
        return 2
    print("conditional writes: OK")
    return 0


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _spark_connect(args: argparse.Namespace) -> int:
    """Become a Spark Connect server with Delta (``spark-submit``, in this process's place)."""
    from .spark_integration.servers import connect_server_command, spark_env

    command = connect_server_command(
        host=args.host,
        port=args.port,
        master=args.master,
        driver_memory=args.driver_memory,
        settings=dict(args.conf),
    )
    sys.stdout.flush()
    os.execve(command[0], command, spark_env(args.host))


def _storage_option(text: str) -> tuple[str, str]:
    from .server.config_layers import secret_on_command_line
    from .storage.stores import is_secret_option

    name, value = _setting(text)
    if is_secret_option(name):
        raise argparse.ArgumentTypeError(secret_on_command_line("--storage-option", name))
    return name, value


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value
