"""A group's footprint (``footprint.py``): the buckets and key ranges it may touch, cut at
the widest gaps, and whether any live file can hold one of its keys."""

from __future__ import annotations

import pyarrow as pa

from deltaflow.tables import BUCKET_COLUMN
from deltaflow.tables.footprint import Footprint


def test_a_footprint_is_fresh_only_if_no_file_of_its_buckets_can_hold_a_key() -> None:
    files = pa.table(
        {
            "min.id": pa.array([0, None], pa.int64()),
            "max.id": pa.array([10, None], pa.int64()),
            f"partition.{BUCKET_COLUMN}": pa.array([1, 2], pa.int32()),
        }
    )
    assert Footprint((1,), "id", ((20, 30),)).checked_against(files).fresh
    assert not Footprint((1,), "id", ((5, 30),)).checked_against(files).fresh
    # A file without statistics may hold any key of its bucket.
    assert not Footprint((2,), "id", ((20, 30),)).checked_against(files).fresh
    assert (
        not Footprint(None, "id", ((20, 30),))
        .checked_against(files.drop_columns(["partition._deltaflow_bucket"]))
        .fresh
    )
    assert not Footprint(None, "id", ((20, 30),)).checked_against(pa.table({"path": ["x"]})).fresh
    assert (
        Footprint(None, "id", ((1, 2),))
        .checked_against(pa.table({"path": pa.array([], pa.string())}))
        .fresh
    )
    assert not Footprint(None).checked_against(pa.table({"path": pa.array([], pa.string())})).fresh


def test_footprint_cuts_integer_keys_at_their_widest_gaps() -> None:
    data = pa.table({"id": [7, 3, 1000, 5, 4, 9_000_000, 1001, 3], "_deltaflow_bucket": [1] * 8})
    footprint = Footprint.of(data, ["id"], bucketed=True, max_ranges=3)
    assert footprint.buckets == (1,)
    assert footprint.ranges == ((3, 7), (1000, 1001), (9_000_000, 9_000_000))
    assert Footprint.of(data, ["id"], bucketed=False, max_ranges=1).ranges == ((3, 9_000_000),)
    # Consecutive keys are never cut apart: one range however many are allowed.
    assert Footprint.of(pa.table({"id": [2, 1, 3]}), ["id"], bucketed=False).ranges == ((1, 3),)
    assert Footprint.of(pa.table({"k": ["b", "a"]}), ["k"], bucketed=False).ranges == (("a", "b"),)
    # Composite and non-orderable keys get no range: the MERGE then names buckets only.
    assert Footprint.of(pa.table({"a": [1], "b": [2]}), ["a", "b"], bucketed=False).ranges == ()
    assert Footprint.of(pa.table({"f": [1.5]}), ["f"], bucketed=False).ranges == ()
