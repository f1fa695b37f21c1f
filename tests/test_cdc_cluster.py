"""Change feeds through a cluster of node processes, one Spark node and two delta-rs nodes
writing each table (through its committer): producers delivering changes out of order, late
and twice, as rows, as a changelog with an operation column and as Debezium events, end at
the source database's rows; a table stream without a key appends, once."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import pytest_asyncio

import deltaflow
from deltaflow import StreamerOptions
from deltaflow.errors import DataStreamerError, StreamUsageError
from deltaflow.testing.changes import Change, ChangeFeed, change_feed

from .support import NODE_FLAGS, Cluster, commit_writers, open_table, read_delta

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

#: Small pages, several in flight: many small groups, committed concurrently by the nodes.
OPTIONS = StreamerOptions(page_size=40, per_partition_in_flight=2, auto_flush_interval=0.05)
ROOT = Path(__file__).parent.parent


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    """node-1 on the Spark engine, node-2 and node-3 on delta-rs, one warehouse."""
    c = Cluster(tmp_path_factory.mktemp("cdc") / "warehouse", flags=NODE_FLAGS)
    c.flags = [*NODE_FLAGS, "--engine", "spark"]
    await c.start("node-1")  # (flags are read as a node starts)
    c.flags = [*NODE_FLAGS[:6], "--engine", "delta-rs"]
    await asyncio.gather(c.start("node-2"), c.start("node-3"))
    yield c
    await c.stop()


def rows_of(cluster: Cluster, table: str) -> dict[int, dict[str, Any]]:
    return {
        k: {c: r[c] for c in ("id", "lsn", "name", "amount")}
        for k, r in read_delta(Path(cluster.warehouse) / table).items()
    }


def flat_pages(changes: list[Change], size: int = 50) -> list[pa.Table]:
    """The changes as Arrow pages with an ``op`` column."""
    return [
        pa.Table.from_pylist([c.as_flat() for c in changes[i : i + size]])
        for i in range(0, len(changes), size)
    ]


async def test_three_producers_out_of_order_end_at_the_highest_sequence(
    cluster: Cluster,
) -> None:
    feed = change_feed(keys=400, changes=4_000, deletes=0.05, seed=1)
    rows, flat, pages = feed.arrivals(producers=3, late=0.1, seed=2, repeat=0.05)
    await asyncio.to_thread(
        deltaflow.create_table,
        cluster.warehouse,
        "customers",
        schema="id:long,lsn:long,name:string,amount:long",
        key="id",
        sequence_by="lsn",
    )
    client = await cluster.wait_members(3)
    common: dict[str, Any] = {"table": "customers", "key": "id", "options": OPTIONS}
    async with client:
        summaries = await asyncio.gather(
            # Rows and deletes; flat rows with an operation column; Arrow pages of those.
            client.stream_data([c.as_item() for c in rows], sequence_by="lsn", **common),
            client.stream_data(
                [c.as_flat() for c in flat], changelog=deltaflow.Changelog(op="op"), **common
            ),
            client.stream_data(flat_pages(pages), changelog=deltaflow.Changelog(op="op"), **common),
        )
        # A stream naming another sequence than the table's: the caller's mistake.
        with pytest.raises(StreamUsageError, match=r"orders changes by \['lsn'\]") as info:
            await client.stream_data([{"id": 1, "lsn": 1}], sequence_by="name", **common)
    assert [s.items_failed for s in summaries] == [0, 0, 0]
    assert info.value.failed_items == [{"id": 1, "lsn": 1}]
    assert rows_of(cluster, "customers") == feed.final()
    # Both engines' nodes wrote it (through the table's committer).
    writers = commit_writers(Path(cluster.warehouse) / "customers")
    assert {"node-1", "node-2", "node-3"} <= set(writers)


async def test_the_debezium_example_replays_a_shuffled_file_into_the_source_rows(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``examples/cdc_debezium.py`` reads a file of Debezium events as a Kafka consumer would
    (here: shuffled, some twice, the table created by the stream)."""
    import random

    feed = change_feed(keys=300, changes=3_000, deletes=0.05, seed=3)
    events = [c.as_debezium() for c in feed.changes]
    rng = random.Random(4)
    events += rng.sample(events, 150)  # redelivered
    rng.shuffle(events)
    events.insert(10, None)  # a Kafka tombstone after a delete: skipped
    file = tmp_path / "customers.jsonl"
    file.write_text("".join(json.dumps(e) + "\n" for e in events))
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(ROOT / "examples" / "cdc_debezium.py"), str(file),
         "--nodes", cluster.nodes["node-2"].address, "--table", "shop_customers"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(events) - 1} changes applied" in done.stdout
    assert rows_of(cluster, "shop_customers") == feed.final()


async def test_a_table_stream_without_a_key_appends_once_under_resends_and_a_replay(
    cluster: Cluster,
) -> None:
    from deltaflow.testing import ConnectionDropper

    rows = [{"n": i, "text": f"event {i}"} for i in range(3_000)]
    replay = StreamerOptions(page_size=40, auto_flush_interval=0)  # batches cut by count only
    ids = {"stream_id": "appends-1", "stream_key": "k" * 16}
    # Connections cut after a few batches each: batches the nodes applied are sent again.
    dropper = ConnectionDropper(after_batches=5, limit=3)
    client = await cluster.wait_members(3)
    await client.close()
    address = cluster.nodes["node-1"].address
    async with deltaflow.connect([address], connection_factory=dropper) as client:
        first = await client.stream_data(rows, table="events", options=replay, **ids)
        with pytest.raises(DataStreamerError, match="item #0 is a Delete, which needs a key"):
            await client.stream_data([deltaflow.Delete({"n": 1})], table="events")
    async with deltaflow.connect([address]) as client:  # the same input again: nothing new
        again = await client.stream_data(rows, table="events", options=replay, **ids)
        # Arrow batches too, each to one partition.
        pages = [pa.Table.from_pylist(rows[i : i + 500]) for i in range(0, 1_000, 500)]
        await client.stream_data(pages, table="events_arrow")
    assert dropper.dropped == 3 and first.batches_retried > 0
    assert (first.items_acked, again.items_acked) == (3_000, 3_000)
    events = Path(cluster.warehouse) / "events"
    ns = sorted(r["n"] for r in open_table(events).to_pyarrow_table().to_pylist())
    assert ns == list(range(3_000))  # each once
    arrow = open_table(Path(cluster.warehouse) / "events_arrow").to_pyarrow_table()
    assert sorted(arrow.column("n").to_pylist()) == list(range(1_000))
    settings = open_table(events).metadata().configuration
    assert (settings["deltaflow.key"], settings["deltaflow.buckets"]) == ("[]", "0")


async def test_quarantined_rows_go_to_the_dead_letters_and_their_batches_apply(
    cluster: Cluster,
) -> None:
    import msgpack

    await asyncio.to_thread(
        deltaflow.create_table, cluster.warehouse, "orders",
        schema="id:long,amount:double,note:string", key="id",
    )  # fmt: skip
    rows: list[Any] = [{"id": i, "amount": i / 2, "note": f"n{i}"} for i in range(500)]
    rows[7] = {"id": 7, "amount": "lots"}  # a value that does not convert
    rows[100] = {"id": None, "amount": 1.0}  # no key
    rows[333] = {"id": 333, "colour": "red"}  # a column the table lacks
    rows[334] = {"id": 334, "amount": float("nan"), "note": None}  # fits
    options = StreamerOptions(page_size=50, on_bad_row="quarantine")
    client = await cluster.wait_members(3)
    async with client:
        summary = await client.stream_data(rows, table="orders", key="id", options=options)
        with pytest.raises(deltaflow.errors.UsageError, match=r"on_bad_row=.* is for table="):
            await client.stream_data(
                rows, key="id", receiver="deltaflow.testing.Echo", options=options
            )
    assert (summary.items_acked, summary.items_quarantined) == (497, 3)
    assert (summary.items_dead_lettered, summary.items_failed) == (3, 0)
    table = read_delta(Path(cluster.warehouse) / "orders")
    assert sorted(table) == sorted(set(range(500)) - {7, 100, 333})
    assert table[8]["note"] == "n8"  # the rest of item 7's batch applied
    dead = open_table(Path(cluster.warehouse) / "deltaflow_dead_letters").to_pyarrow_table()
    letters = {r["position"]: r for r in dead.to_pylist()}
    assert sorted(letters) == [7, 100, 333]
    assert {r["error_code"] for r in letters.values()} == {"SCHEMA_MISMATCH"}
    assert "(key 7)" in letters[7]["error"] and "'amount'" in letters[7]["error"]
    assert "key column 'id'" in letters[100]["error"]
    assert "colour" in letters[333]["error"]
    assert msgpack.unpackb(letters[333]["payload"]) == {"id": 333, "colour": "red"}


def history_reference(changes: list[Change]) -> list[tuple[Any, ...]]:
    """Every version: (id, start, end, name), a version per upsert, ended by the next change."""
    out = []
    by_key: dict[int, list[Change]] = {}
    for change in changes:
        by_key.setdefault(change.row["id"], []).append(change)
    for key, mine in by_key.items():
        ordered = sorted(mine, key=lambda c: c.lsn)
        for change, after in zip(ordered, [*ordered[1:], None], strict=True):
            if change.op != "d":
                end = None if after is None else after.lsn
                out.append((key, change.lsn, end, change.row["name"]))
    return sorted(out)


async def test_partial_updates_and_a_history_from_producers_out_of_order(
    cluster: Cluster,
) -> None:
    import random

    feed = change_feed(keys=150, changes=1_500, deletes=0.05, seed=5)
    rng = random.Random(6)
    # An update carries some of its columns only (the others absent): a partial update.
    partial = feed.partial(seed=6).changes
    schema = "id:long,lsn:long,name:string,amount:long"
    await asyncio.to_thread(
        deltaflow.create_table, cluster.warehouse, "patched", schema=schema, key="id",
        merge="partial",
    )  # fmt: skip
    await asyncio.to_thread(
        deltaflow.create_table, cluster.warehouse, "versions", schema=schema, key="id",
        sequence_by="lsn", history="scd2",
    )  # fmt: skip
    await asyncio.to_thread(
        deltaflow.create_table, cluster.warehouse, "patched_by_lsn", schema=schema, key="id",
        merge="partial", sequence_by="lsn",
    )  # fmt: skip
    # Partial updates in each key's order (two producers, each with its own keys); the
    # history's changes out of order (two producers, late ones); the same partial updates
    # shuffled, some twice, the newer half streamed before the older one: ordered by their
    # sequence column by column.
    streams = [("patched", [c for c in partial if c.row["id"] % 2 == p]) for p in (0, 1)]
    streams += [("versions", share) for share in feed.arrivals(producers=2, late=0.1, seed=7)]
    half = len(partial) // 2
    newer, older = [
        ChangeFeed(part).arrivals(producers=2, late=0.0, seed=8, repeat=0.05)
        for part in (partial[half:], partial[:half])
    ]
    for share in (*newer, *older):
        rng.shuffle(share)

    async def stream(streams: list[tuple[str, list[Change]]]) -> None:
        await asyncio.gather(
            *(
                client.stream_data(
                    [c.as_item() for c in changes], table=table, key="id", options=OPTIONS
                )
                for table, changes in streams
            )
        )

    client = await cluster.wait_members(3)
    async with client:
        await stream([*streams, *(("patched_by_lsn", share) for share in newer)])
        await stream([("patched_by_lsn", share) for share in older])
    assert rows_of(cluster, "patched") == ChangeFeed(partial).final_partial()
    assert rows_of(cluster, "patched_by_lsn") == ChangeFeed(partial).final_partial()
    versions = open_table(Path(cluster.warehouse) / "versions").to_pyarrow_table().to_pylist()
    got = sorted((r["id"], r["__start_at"], r["__end_at"], r["name"]) for r in versions)
    assert got == history_reference(feed.changes)
