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
import traceback
from typing import Any, NoReturn

from .cli_cluster import add_cluster_commands
from .cli_config import add_config_commands, settings_of
from .cli_infrastructure import add_infrastructure_commands
from .cli_output import leave
from .cli_table import add_table_commands
from .engines.options import (
    DEFAULT_ENGINE,
    ENGINE_NAMES,
)
from .server.config_layers import add_flags

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

    return run_demo(rows=args.rows, warehouse=args.warehouse, engine=args.engine, keep=args.keep)


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
    demo.add_argument(
        "--rows", type=int, default=200_000, help="changes to stream (default %(default)s)"
    )
    demo.add_argument(
        "--warehouse",
        default=None,
        help="where the table goes, and stays (default: a temporary directory, removed)",
    )
    demo.add_argument(
        "--keep", action="store_true", help="keep the temporary directory and say where it is"
    )
    demo.add_argument(
        "--engine",
        choices=ENGINE_NAMES,
        default=DEFAULT_ENGINE,
        help="the nodes' table engine (default %(default)s)",
    )
    demo.set_defaults(func=_demo)

    add_table_commands(sub)

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
    except BrokenPipeError:  # `deltaflow table history | head`: the reader had enough
        sys.stdout = open(os.devnull, "w")
        return 0
    except Exception as exc:  # noqa: BLE001 - a bug: say so, the traceback only when asked
        if args.verbose:
            traceback.print_exc()
        hint = "" if args.verbose else "; run with -v for the traceback"
        print(
            f"deltaflow: unexpected error: {type(exc).__name__}: {exc} (please report it{hint})",
            file=sys.stderr,
        )
        return 1


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deltaflow")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def entry() -> NoReturn:
    """The ``deltaflow`` command: :func:`main`, then :func:`.cli_output.leave` with its code
    (no native thread can abort the exit)."""
    try:
        code = main()
    except SystemExit as exc:  # argparse's usage errors and --help
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    leave(code)


if __name__ == "__main__":
    entry()
