"""The Spark SQL the Spark engine runs: names and key values quoted, and the MERGE of a group
(its ON clause naming the group's buckets and key ranges, its clauses the table's sequence and
merge mode)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..columnar import NULLS_COLUMN
from ..storage.paths import Location
from ..tables.engine import DELETE_COLUMN
from ..tables.footprint import Footprint
from ..tables.merging import LAST, REPLACE_COLUMN, MergeRule, internal, matched_clauses
from ..tables.settings import BUCKET_COLUMN

__all__ = ["literal", "merge_sql", "quote"]


def quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def literal(value: Any) -> str:
    """A key value as a Spark SQL literal (backslash escapes, Spark's default parsing)."""
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(int(value))


def merge_sql(
    path: Location,
    key: Sequence[str],
    source: str,
    columns: Sequence[str],
    footprint: Footprint,
    sequence: Sequence[str] = (),
    rule: MergeRule = LAST,
) -> str:
    data = [c for c in columns if not internal(c)]
    # Delta prunes a MERGE's target files by the literal predicates on target columns in its
    # ON clause, not by the join: the footprint names the group's buckets and key ranges.
    on = footprint.merge_condition(key, quote, literal)
    cols = ", ".join(quote(c) for c in data)
    vals = ", ".join(f"s.{quote(c)}" for c in data)
    flag = f"s.{quote(DELETE_COLUMN)}"
    # A stored row of a sequence not lower stays; the merge mode says what the others become.
    matched = []
    for condition, sets in matched_clauses(
        [c for c in data if c != BUCKET_COLUMN and c not in key],
        rule,
        sequence,
        quote,
        replacing=REPLACE_COLUMN in columns,
        nulls=NULLS_COLUMN in columns,
        moved=footprint.levels is not None,
    ):
        when = "WHEN MATCHED" + (f" AND {condition}" if condition else "")
        if sets is None:
            matched.append(f"{when} THEN DELETE")
        else:
            assignments = ", ".join(f"t.{quote(c)} = {v}" for c, v in sets.items())
            matched.append(f"{when} THEN UPDATE SET {assignments}")
    return (
        f"MERGE INTO delta.{quote(str(path))} AS t USING {source} AS s ON {on} "
        + " ".join(matched)
        + f" WHEN NOT MATCHED AND NOT {flag} THEN INSERT ({cols}) VALUES ({vals})"
    )
