"""Table maintenance (``maintenance.py``): vacuum deletes what no version needs and keeps
the deletion vectors the log names."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from pathlib import Path
from typing import Any

import pytest

from deltaflow.errors import UsageError
from deltaflow.tables import maintenance

from .support import read_delta, read_spark, table_engine, upsert


async def test_vacuum_deletes_what_no_version_needs_and_keeps_deletion_vectors(
    spark: Any, warehouse: Path
) -> None:
    """Files of failed commits go; the deletion vector files the log names stay, live ones
    included (delta-rs's own full vacuum deletes those, and the table can no longer be
    read)."""
    path = warehouse / "swept"
    async with table_engine("delta-rs-dv", warehouse, table_buckets=2) as eng:
        for round_ in range(3):
            rows = [{"id": i, "name": f"r{round_}"} for i in range(round_ * 30, 100)]
            await upsert(eng, "swept", rows)
    vectors = {f.name for f in path.glob("deletion_vector_*.bin")}
    assert vectors  # merge-on-read wrote some
    # What a commit that never landed leaves behind: a data file and a vector file.
    (path / "_deltaflow_bucket=1" / "part-00000-failed.snappy.parquet").write_bytes(b"x")
    (path / "deletion_vector_00000000-0000-0000-0000-000000000000.bin").write_bytes(b"\x01")
    week_ago = time.time() - 7 * 86400
    for file in path.rglob("*"):
        if file.is_file() and "_delta_log" not in file.parts:
            os.utime(file, (week_ago, week_ago))
    before = read_delta(path)
    vacuum = functools.partial(maintenance.vacuum, warehouse, "swept", retention_hours=24)
    listed = await asyncio.to_thread(vacuum, dry_run=True)
    assert sorted(listed) == [
        "_deltaflow_bucket=1/part-00000-failed.snappy.parquet",
        "deletion_vector_00000000-0000-0000-0000-000000000000.bin",
    ]
    # Delta's retention check: below the table's 7 days only when forced, nothing deleted.
    with pytest.raises(UsageError, match=r"retention of 24 h is below table swept's "
                       r"delta.deletedFileRetentionDuration \(168 h\).*--force"):  # fmt: skip
        await asyncio.to_thread(vacuum, dry_run=False)
    assert all((path / name).exists() for name in listed)
    assert await asyncio.to_thread(vacuum, dry_run=False, force=True) == listed
    assert not any((path / name).exists() for name in listed)
    assert {f.name for f in path.glob("deletion_vector_*.bin")} == vectors
    assert read_delta(path) == before
    assert {k: r["name"] for k, r in read_spark(spark, path).items()} == {
        k: r["name"] for k, r in before.items()
    }
