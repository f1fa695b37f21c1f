"""How the ``deltaflow`` command prints: data on stdout (aligned tables through ``rich``, or
one JSON document with ``--json``), messages on stderr; and how it leaves (:func:`leave`)."""

from __future__ import annotations

import atexit
import datetime
import decimal
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from .logs import printable

__all__ = ["leave", "plain", "print_json", "print_table", "readable"]


def leave(code: int) -> NoReturn:
    """Exit with ``code`` once the output is flushed and the exit handlers have run, skipping
    the interpreter's teardown.

    Native thread pools can outlive that teardown: a ``deltalake`` table read as a pyarrow
    dataset and not read to its end (``head()``, a loop left early) leaves Arrow's I/O threads
    calling into delta-rs's file system, and the process then aborts after its work is done
    ("terminate called without an active exception", exit 134; apache/arrow#34314,
    delta-io/delta-rs#2184). Every ``deltaflow`` command ends here, so none can.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there
            pass
    atexit._run_exitfuncs()
    os._exit(code)


def print_json(document: Any) -> None:
    """``document`` as indented JSON on stdout (datetimes in ISO 8601, other values as
    strings)."""
    print(json.dumps(document, indent=2, default=_plain))


def _plain(value: Any) -> Any:
    isoformat = getattr(value, "isoformat", None)
    return isoformat() if callable(isoformat) else str(value)


def print_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    title: str | None = None,
    dim: Iterable[bool] = (),
) -> None:
    """``rows`` as aligned columns on stdout, headed by ``columns``; a row whose ``dim`` flag is
    set is shown faint (defaults, dead members). A pipe gets plain text, not folded at 80.

    Every value is printed as the text it is (:func:`plain`): a table's rows and commits hold
    what clients wrote, which must neither be read as ``rich`` markup nor drive the terminal.
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for column in columns:
        table.add_column(Text(plain(column)), overflow="fold")
    faint = list(dim)
    for i, row in enumerate(rows):
        style = "dim" if i < len(faint) and faint[i] else None
        table.add_row(*(Text(plain(v)) for v in row), style=style)
    terminal = sys.stdout.isatty()
    console = Console(
        highlight=False,
        markup=False,
        emoji=False,
        width=None if terminal else 250,
        soft_wrap=not terminal,
    )
    if title:
        console.print(Text(plain(title)), style="bold")
    console.print(table)


def plain(value: Any) -> str:
    """``value`` as text to print to an operator's terminal: control characters (ESC, newline,
    tab, the C1 controls, Unicode's line separators...) shown as escapes (``\\x1b``), so no
    value can set the title, clear the screen, make a link or start a line; None as empty."""
    return "" if value is None else printable(str(value))


def readable(value: Any) -> str:
    """A value as a person reads it: times in ISO 8601 (UTC), numbers without exponents."""
    if value is None:
        return "null"
    if isinstance(value, datetime.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(datetime.UTC)
        return str(value.isoformat(sep=" ", timespec="milliseconds")).replace("+00:00", "Z")
    if isinstance(value, float):
        return f"{value:.15g}" if abs(value) < 1e15 else f"{value:,.0f}"
    if isinstance(value, decimal.Decimal):
        return format(value, "f")
    if isinstance(value, bytes):
        return value.hex() if len(value) <= 16 else value[:16].hex() + "…"
    return str(value)
