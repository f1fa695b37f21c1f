"""One input fails only itself (issue #47, finding 11): a dead letter stores any value the wire
carries, its ``payload_json`` strict JSON; a Debezium truncate or message event is skipped,
never the end of the stream, and the events around it are written."""

from __future__ import annotations

import asyncio
import datetime
import decimal
import json
import logging
import math
from pathlib import Path
from typing import Any

import msgpack
import pytest

import deltaflow
from deltaflow import StreamerOptions

from .support import StartCluster, open_table, read_delta


def strict(text: str) -> Any:
    """``text`` as RFC 8259 JSON: ``NaN`` and ``Infinity`` are not in it."""

    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


async def test_dead_letters_store_any_wire_value_as_strict_json(
    warehouse: Path, start_cluster: StartCluster
) -> None:
    # Finding 11: an item with a bytes map key failed the dead-letter write (and the stream);
    # NaN gave payload_json `NaN`, which no JSON reader takes.
    (node,) = await start_cluster(warehouse, count=1, engine="delta-rs")

    def item(i: int) -> Any:
        if i == 35:
            return 35  # FailOn fails the batch of items 30-39
        return {
            b"\x00key": i,
            "nan": math.nan,
            "inf": [math.inf, -math.inf],
            "bytes": b"\x01\xff",
            "price": decimal.Decimal("12.50"),
            "day": datetime.date(2026, 1, 2),
            "at": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
            7: {2.5: True, None: "none"},
        }

    async with deltaflow.connect([node.address]) as client:
        summary = await client.stream_data(
            [item(i) for i in range(50)],
            key=lambda x: 0,
            receiver="deltaflow.testing.FailOn",
            receiver_args={"fail_on": 35},
            options=StreamerOptions(page_size=10, on_failure="fallback"),
        )
    assert (summary.items_dead_lettered, summary.items_failed) == (10, 0)
    rows = open_table(warehouse / "deltaflow_dead_letters").to_pyarrow_table().to_pylist()
    by_position = {r["position"]: r for r in rows}
    assert sorted(by_position) == list(range(30, 40))
    assert strict(by_position[35]["payload_json"]) == 35
    for position in (30, 39):
        row = by_position[position]
        assert msgpack.unpackb(row["payload"], strict_map_key=False, timestamp=3)[b"\x00key"] == (
            position
        )  # the payload keeps the item exactly
        assert strict(row["payload_json"]) == {
            "006b6579": position,
            "nan": "NaN",
            "inf": ["Infinity", "-Infinity"],
            "bytes": "01ff",
            "price": "12.50",
            "day": "2026-01-02",
            "at": "2026-01-02T03:04:05+00:00",
            "7": {"2.5": True, "null": "none"},
        }


#: Debezium events of table ``customers``: truncate and message events among row changes.
EVENTS = [
    {"op": "c", "before": None, "after": {"id": 1, "name": "a"}, "source": {}, "ts_ms": 1},
    {"op": "t", "before": None, "after": None, "source": {"table": "customers"}, "ts_ms": 2},
    {"op": "c", "before": None, "after": {"id": 2, "name": "b"}, "source": {}, "ts_ms": 3},
    {"schema": {}, "payload": {"op": "m", "message": {"prefix": "p", "content": "eA=="},
                               "source": {}, "ts_ms": 4}},
    {"op": "u", "before": {"id": 1}, "after": {"id": 1, "name": "a2"}, "source": {}, "ts_ms": 5},
    {"op": "t", "source": {}, "ts_ms": 6},
    {"op": "d", "before": {"id": 2, "name": "b"}, "after": None, "source": {}, "ts_ms": 7},
    {"op": "c", "before": None, "after": {"id": 3, "name": "c"}, "source": {}, "ts_ms": 8},
]  # fmt: skip


@pytest.mark.parametrize("kind", ["iterable", "async"])
async def test_debezium_truncate_and_message_events_are_skipped_and_the_stream_goes_on(
    warehouse: Path, start_cluster: StartCluster, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    # Finding 11: one `t` or `m` event aborted the whole stream; the event before it was not
    # written.
    caplog.set_level(logging.WARNING, logger="deltaflow.client.changelog")
    (node,) = await start_cluster(warehouse, count=1, engine="delta-rs")
    await asyncio.to_thread(
        deltaflow.create_table, warehouse, "customers", schema="id:long,name:string", key="id"
    )

    async def events_async() -> Any:
        for event in EVENTS:
            yield event

    source = iter(EVENTS) if kind == "iterable" else events_async()
    async with deltaflow.connect([node.address]) as client:
        summary = await client.stream_data(
            source, table="customers", key="id", changelog="debezium"
        )
    assert (summary.items_acked, summary.items_failed) == (5, 0)
    rows = read_delta(warehouse / "customers")
    assert {k: r["name"] for k, r in rows.items()} == {1: "a2", 3: "c"}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # the first skip, then the counts: not one per event
    assert "item #1 is a Debezium truncate event" in warnings[0]
    assert "skipped 1 message, 2 truncate event(s)" in warnings[1]


async def test_an_unknown_debezium_op_still_stops_the_stream_naming_it(
    warehouse: Path, start_cluster: StartCluster
) -> None:
    (node,) = await start_cluster(warehouse, count=1, engine="delta-rs")
    bad = [EVENTS[0], {"op": "x", "source": {}}]
    async with deltaflow.connect([node.address]) as client:
        with pytest.raises(deltaflow.DataStreamerError, match=r"item #1 has op 'x'"):
            await client.stream_data(bad, table="customers", key="id", changelog="debezium")
