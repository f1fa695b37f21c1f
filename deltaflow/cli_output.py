"""How the ``deltaflow`` command prints: data on stdout (aligned tables through ``rich``, or
one JSON document with ``--json``), messages on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["print_json", "print_table"]


def print_json(document: Any) -> None:
    """``document`` as indented JSON on stdout (datetimes and other values as strings)."""
    print(json.dumps(document, indent=2, default=str))


def print_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    title: str | None = None,
    dim: Iterable[bool] = (),
) -> None:
    """``rows`` as aligned columns on stdout, headed by ``columns``; a row whose ``dim`` flag is
    set is shown faint (defaults, dead members). A pipe gets plain text, not folded at 80."""
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for column in columns:
        table.add_column(column, overflow="fold")
    faint = list(dim)
    for i, row in enumerate(rows):
        style = "dim" if i < len(faint) and faint[i] else None
        table.add_row(*("" if v is None else str(v) for v in row), style=style)
    terminal = sys.stdout.isatty()
    console = Console(highlight=False, width=None if terminal else 250, soft_wrap=not terminal)
    if title:
        console.print(title, style="bold")
    console.print(table)
