"""``deltaflow config show`` (every setting, its value and where it came from, secrets
masked) and ``deltaflow config check`` (is this a node that can start?), with exit codes as
Vector's ``validate``: 0 valid, 78 not valid, 69 the warehouse cannot be reached."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .cli_output import print_json, print_table
from .server.config_layers import EX_CONFIG, ConfigError, Resolved, add_flags, node_config, resolve
from .server.node_settings import SETTINGS

__all__ = ["EX_UNAVAILABLE", "add_config_commands", "settings_of"]

#: The exit code of a check that could not reach the warehouse (sysexits' EX_UNAVAILABLE).
EX_UNAVAILABLE: Final = 69


def settings_of(args: argparse.Namespace) -> Resolved:
    """The settings a ``serve``-like command's flags, the environment and the file give;
    ``-v`` before the command counts as ``--log-level info``."""
    if getattr(args, "verbose", False) and not hasattr(args, "setting_log__level"):
        args.setting_log__level = "info"
    return resolve(args)


def add_config_commands(sub: Any) -> None:
    config = sub.add_parser("config", help="show or check a node's settings")
    csub = config.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser(
        "show",
        help="every setting, its value and its source (default, file, env, flag)",
        description="Show the settings `deltaflow serve` would run with, given the same flags, "
        "environment and file; secrets are masked.",
    )
    show.add_argument("--json", action="store_true", help="one JSON document")
    add_flags(show)
    show.set_defaults(func=_show)
    check = csub.add_parser(
        "check",
        help="validate the settings: keys, types, values, files, receivers and the warehouse",
        description="Validate what `deltaflow serve` would run with. Exit 0: valid; 78: not "
        "valid (each problem listed); 69: valid, but the warehouse cannot be reached.",
    )
    check.add_argument("file", nargs="?", help="the config file (same as --config)")
    check.add_argument(
        "--offline", action="store_true", help="do not reach the warehouse (files and values only)"
    )
    check.add_argument("--json", action="store_true", help="one JSON document")
    add_flags(check)
    check.set_defaults(func=_check)


def _show(args: argparse.Namespace) -> int:
    resolved = settings_of(args)
    if args.json:
        file = str(resolved.file) if resolved.file else None
        print_json({"file": file, "settings": resolved.masked()})
        return 0
    rows = resolved.show()
    title = f"file: {resolved.file}" if resolved.file else None
    print_table(
        ("KEY", "VALUE", "SOURCE"), rows, title=title, dim=[r[2] == "default" for r in rows]
    )
    return 0


@dataclass(slots=True)
class Check:
    name: str
    ok: bool
    detail: str


def _check(args: argparse.Namespace) -> int:
    if args.file:
        args.config = args.file
    checks: list[Check] = []
    problems: list[str] = []
    code = 0
    # Every problem in one pass: what resolved goes on to the next checks.
    config = None
    try:
        resolved: Resolved | None = settings_of(args)
    except ConfigError as exc:
        problems, resolved = list(exc.problems), exc.resolved
    # The node's own checks need its required settings; without one, its absence is the
    # problem (said above), not what NodeConfig would make of a None.
    if resolved is not None and not any(s.required and not resolved[s.key] for s in SETTINGS):
        try:
            config = node_config(resolved)
        except ConfigError as exc:
            problems.extend(exc.problems)
    checks.append(
        Check("settings", True, "keys, types and values")
        if not problems
        else Check("settings", False, f"{len(problems)} problem(s)")
    )
    found_all = [_classes(resolved)] if resolved is not None else []
    if config is not None and not problems:  # 69 only for a configuration that is valid
        found_all.append(_warehouse(config, offline=args.offline))
    for found in found_all:
        if found is not None:
            checks.append(found[0])
            if not found[0].ok:
                problems.extend(found[1])
                code = code or found[2]
    if problems and not code:
        code = EX_CONFIG
    elif any(not c.ok for c in checks) and not code:
        code = EX_CONFIG
    if args.json:
        print_json({
            "valid": code == 0,
            "exit_code": code,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
            "problems": problems,
        })  # fmt: skip
        return code
    for c in checks:
        print(f"{'ok ' if c.ok else 'BAD'} {c.name}: {c.detail}")
    for problem in problems:
        print(f"  - {problem}", file=sys.stderr)
    verdict = {
        0: "configuration valid",
        EX_UNAVAILABLE: "configuration valid, but the warehouse cannot be reached",
    }.get(code, "configuration NOT valid")
    print(verdict, file=sys.stderr)
    return code


def _classes(r: Resolved) -> tuple[Check, list[str], int] | None:
    """Every receiver and side-input class named can be imported, as the node will."""
    names = [*r["receivers"], *r["receiver_concurrency"], *r["side_inputs"]]
    if not names:
        return None
    problems = []
    for name in dict.fromkeys(names):
        module, _, attribute = name.rpartition(".")
        try:
            if not getattr(importlib.import_module(module), attribute, None):
                problems.append(f"{name}: module {module} has no {attribute}")
        except Exception as exc:  # noqa: BLE001 - any import failure is the finding
            problems.append(f"{name}: cannot import {module or name}: {exc}")
    detail = f"{len(names)} importable" if not problems else f"{len(problems)} not importable"
    return Check("classes", not problems, detail), problems, EX_CONFIG


def _warehouse(config: Any, *, offline: bool) -> tuple[Check, list[str], int] | None:
    from .storage.paths import StorePath, location

    where = location(config.warehouse, config.storage_options)
    if isinstance(where, StorePath):
        if offline:
            return None
        from .storage.conditional import first_line
        from .storage.stores import reach_store

        try:
            reach_store(str(where), config.storage_options)
        except Exception as exc:  # noqa: BLE001 - obstore's errors, named by their first line
            why = f"warehouse {where} cannot be reached: {first_line(exc, config.storage_options)}"
            return Check("warehouse", False, "not reachable"), [why], EX_UNAVAILABLE
        return Check("warehouse", True, f"{where} reachable"), [], 0
    path = Path(os.fspath(where)).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = f"warehouse {path}: {existing or path} is not a writable directory"
        return Check("warehouse", False, "not writable"), [why], EX_CONFIG
    state = "exists" if path.is_dir() else f"will be created in {existing}"
    return Check("warehouse", True, f"{path} {state}"), [], 0
