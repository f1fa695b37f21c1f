"""Table names: each becomes a directory under the warehouse (and a name in catalogs).

A name is an ASCII identifier: letters, digits and ``_``, starting with a letter or ``_``,
at most 128 characters. Names are case-sensitive, as directory names on Linux and object keys
are: ``Orders`` and ``orders`` are two tables there, but one directory on a case-insensitive
file system (macOS, Windows), and one name in catalogs that fold case (Hive, Glue and Unity
store names in lower case). Use lower-case names.

The client checks a name before it sends anything (:class:`~deltaflow.errors.UsageError`);
the node checks it again, as it checks all input.
"""

from __future__ import annotations

import re
from typing import Any, Final

__all__ = ["TABLE_NAME", "table_name_problem"]

TABLE_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def table_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a table, with a name that can; None when it can."""
    if isinstance(name, str) and TABLE_NAME.fullmatch(name):
        return None
    problem = (
        f"table name {name!r:.140} is not allowed; use letters, digits and '_' (at most 128), "
        "starting with a letter or '_'"
    )
    if not isinstance(name, str) or not name:
        return problem
    fixed = re.sub(r"[^A-Za-z0-9_]", "_", name)[:128]
    if fixed[0].isdigit():
        fixed = f"_{fixed}"[:128]
    return f"{problem}: {fixed!r}, say"
