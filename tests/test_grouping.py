"""A group's rows collapsed to the last row of each key (``grouping.py``)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from deltaflow.tables.grouping import last_per_key


@pytest.mark.parametrize(
    ("key", "values"),
    [
        (["id"], [3, 1, 3, 2, 1, 3]),  # integers
        (["id"], ["b", "a", "b", "c", "a", "b"]),  # dictionary codes
        (["id"], [1.5, 2.5, 1.5, 0.5, 2.5, 1.5]),  # floats: dictionary codes
        (["id", "region"], [1, 2, 1, 1, 2, 1]),  # composite: the hash aggregation
    ],
)
def test_a_group_keeps_the_last_row_of_each_key_in_order(key: list[str], values: list[Any]) -> None:
    """A group's rows collapse to the last per key, in the order those rows came, across the
    pages (chunks) the group was staged in."""
    rows = [{"id": v, "region": "eu", "seq": i} for i, v in enumerate(values)]
    if key == ["id", "region"]:
        rows[2]["region"] = "us"  # (1, eu) at 0, 3, 5 and (1, us) at 2
    pages = [pa.Table.from_pylist(rows[:2]), pa.Table.from_pylist(rows[2:])]
    group = pa.concat_tables(pages)
    last: dict[Any, int] = {}
    for i, row in enumerate(rows):
        last[repr([row[k] for k in key])] = i
    kept = last_per_key(group, key)
    assert kept.column("seq").to_pylist() == sorted(last.values())
