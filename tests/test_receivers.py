"""Custom receivers by class name: results back to the caller, failures reported exactly."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import reactivex

import deltaflow
from deltaflow import DataStreamerError, StreamerOptions
from deltaflow.errors import ItemFailedError, ReceiverError, UnknownReceiverError
from deltaflow.partitioning import partition_of
from deltaflow.receivers import Receiver
from deltaflow.server import Node

from .support import StartCluster, read_delta

ONE_BATCH_PER_PARTITION = StreamerOptions(page_size=1000, auto_flush_interval=0)


async def test_results_of_a_registered_receiver_reach_a_callable(cluster: list[Node]) -> None:
    items = list(range(500))
    results: list[Any] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            items, key=lambda x: x, receiver="deltaflow.testing.Echo", on_result=results.append
        )
    assert sorted(results) == items
    assert summary.results == len(items)


async def test_streamed_results_reach_an_async_callable_and_an_observer(
    cluster: list[Node],
) -> None:
    items = [{"n": i} for i in range(300)]
    seen_async: list[Any] = []
    seen_observer: list[Any] = []
    completed = asyncio.Event()

    async def on_result(value: Any) -> None:
        await asyncio.sleep(0)
        seen_async.append(value)

    observer = reactivex.Observer(on_next=seen_observer.append, on_completed=completed.set)
    async with deltaflow.connect([cluster[1].address]) as client:
        await client.stream_data(
            items, key="n", receiver="deltaflow.testing.EchoStream", on_result=on_result
        )
        await client.stream_data(
            items, key="n", receiver="deltaflow.testing.EchoStream", on_result=observer
        )
    key = lambda r: r["n"]  # noqa: E731
    assert sorted(seen_async, key=key) == items
    assert sorted(seen_observer, key=key) == items
    assert completed.is_set()


async def test_a_raising_receiver_fails_the_stream_with_exactly_that_batchs_items(
    cluster: list[Node],
) -> None:
    items = list(range(200))
    bad = 137
    results: list[Any] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        partitions = client.partition_map.partitions
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                items,
                key=lambda x: x,
                receiver="deltaflow.testing.FailOn",
                receiver_args={"fail_on": bad},
                on_result=results.append,
                options=ONE_BATCH_PER_PARTITION,
            )
    bad_batch = [i for i in items if partition_of(i, partitions) == partition_of(bad, partitions)]
    err = info.value
    assert err.failed_items == bad_batch
    assert isinstance(err.cause, ReceiverError)
    assert "ValueError" in str(err.cause) and "injected failure on item 137" in str(err.cause)
    assert err.cause.node in {"node-1", "node-2"}
    # Every other batch was applied and its results came back.
    assert sorted(results) == [i for i in items if i not in bad_batch]


async def test_a_retriable_receiver_error_is_resent_and_succeeds(cluster: list[Node]) -> None:
    from deltaflow.testing import FailOn

    FailOn.raised = 0
    results: list[Any] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            list(range(50)),
            key=lambda x: x,
            receiver="deltaflow.testing.FailOn",
            receiver_args={"fail_on": 7, "retriable": True, "times": 2},
            on_result=results.append,
        )
    assert summary.batches_retried == 2
    assert sorted(results) == list(range(50))


async def test_unknown_receiver_is_a_clear_error_and_other_streams_go_on(
    cluster: list[Node],
) -> None:
    async with deltaflow.connect([cluster[0].address]) as client:
        good = asyncio.create_task(
            client.stream_data(
                list(range(2000)),
                key=lambda x: x,
                receiver="deltaflow.testing.Echo",
                on_result=lambda v: None,
            )
        )
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(["x", "y"], key=lambda x: x, receiver="os.system")
        summary = await good
    cause = info.value.cause
    assert isinstance(cause, UnknownReceiverError)
    assert "'os.system' is not registered" in str(cause)
    assert "--receiver os.system" in str(cause)
    assert sorted(info.value.failed_items) == ["x", "y"]
    assert summary.items_acked == 2000
    # Nothing was imported on the node's behalf.
    assert "os.system" not in cluster[0].registry


async def test_the_enrichment_example_reads_a_side_input_writes_a_table_and_streams_results(
    warehouse: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, start_cluster: StartCluster
) -> None:
    import json

    from deltaflow import Delete

    rates = tmp_path / "vat.json"
    rates.write_text(json.dumps({"default": 0.5, "DE": 0.19}))
    monkeypatch.setenv("VAT_RATES_FILE", str(rates))
    nodes = await start_cluster(
        warehouse,
        engine="delta-rs",
        receivers=["examples.receivers.EnrichOrders"],
        side_inputs=["examples.receivers.VatRates"],
    )
    try:
        orders: list[Any] = [
            {"id": i, "amount": 10.0 * i, "country": "DE" if i % 2 else "FR"} for i in range(100)
        ]
        orders.append(Delete({"id": 5}))
        results: list[Any] = []
        async with deltaflow.connect([nodes[0].address]) as client:
            await client.stream_data(
                orders,
                key="id",
                receiver="examples.receivers.EnrichOrders",
                on_result=results.append,
            )
    finally:
        for node in nodes:
            await node.stop()
    assert sorted(r["id"] for r in results) == list(range(100))
    by_id = {r["id"]: r for r in results}
    assert by_id[10]["gross"] == 150.0 and by_id[10]["rate"] == 0.5  # FR: the default
    assert by_id[11]["gross"] == 130.9 and by_id[11]["rate"] == 0.19  # DE
    table = read_delta(warehouse / "orders")
    assert set(table) == set(range(100)) - {5}
    assert table[10]["gross"] == 150.0


# -- the receiver API: single items failed, retries and attempts, concurrency, streaming -----

ITEMS_SOME_NOT_OK = [{"id": i, "ok": i % 20 != 3} for i in range(200)]
NOT_OK = [item for item in ITEMS_SOME_NOT_OK if not item["ok"]]


async def test_items_marked_failed_are_dropped_alone_and_the_rest_applied(
    cluster: list[Node],
) -> None:
    results: list[Any] = []
    acked: list[Any] = []
    positions: list[int] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        summary = await client.stream_data(
            ITEMS_SOME_NOT_OK,
            key="id",
            receiver="deltaflow.testing.Validate",
            on_result=results.append,
            on_ack=acked.extend,
            on_commit=lambda pos: positions.append(pos.count),
            options=StreamerOptions(on_failure="drop", page_size=50),
        )
    ok = [item for item in ITEMS_SOME_NOT_OK if item["ok"]]
    assert summary.items_failed == len(NOT_OK) == 10
    assert summary.items_acked == len(ok)
    key = lambda r: r["id"]  # noqa: E731
    assert sorted(results, key=key) == ok
    assert sorted(acked, key=key) == ok  # on_ack sees only the applied items
    assert positions[-1] == len(ITEMS_SOME_NOT_OK)  # the rejected items settle too


async def test_items_marked_failed_stop_the_stream_under_fail(cluster: list[Node]) -> None:
    results: list[Any] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                ITEMS_SOME_NOT_OK,
                key="id",
                receiver="deltaflow.testing.Validate",
                on_result=results.append,
                options=StreamerOptions(page_size=50, max_in_flight=1),
            )
    err = info.value
    assert isinstance(err.cause, ItemFailedError)
    assert "is not ok" in str(err.cause) and err.cause.node in {"node-1", "node-2"}
    failed_ids = {item["id"] for item in err.failed_items}
    applied_ids = {item["id"] for item in results}
    # Exactly the items not applied are reported: rejected ones, and those never sent.
    assert failed_ids.isdisjoint(applied_ids)
    assert failed_ids | applied_ids == {item["id"] for item in ITEMS_SOME_NOT_OK}
    assert any(item in err.failed_items for item in NOT_OK)
    assert not any(item in results for item in NOT_OK)
    # Each item is reported with its reason: its own rejection, or never sent.
    for f in err.failures:
        own = f"item {f.item['id']!r} is not ok"
        assert f.reason == own or "stopped before it was sent" in f.reason, f


async def test_each_rejected_item_keeps_its_own_reason(cluster: list[Node]) -> None:
    items = [{"id": i, "ok": i not in (3, 7)} for i in range(10)]
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                items,
                key=lambda r: 0,  # one partition, one batch
                receiver="deltaflow.testing.Validate",
                options=StreamerOptions(page_size=10),
            )
    err = info.value
    assert [(f.position, f.item, f.reason) for f in err.failures] == [
        (3, items[3], "item 3 is not ok"),
        (7, items[7], "item 7 is not ok"),
    ]
    assert err.failed_items == [items[3], items[7]]
    assert [f.item for f in err.failures] == err.failed_items


async def test_items_marked_failed_reach_the_dead_letter_table_with_their_reason(
    cluster: list[Node], warehouse: Any
) -> None:
    async with deltaflow.connect([cluster[1].address]) as client:
        summary = await client.stream_data(
            ITEMS_SOME_NOT_OK,
            key="id",
            receiver="deltaflow.testing.Validate",
            options=StreamerOptions(on_failure="fallback", dead_letter_table="rejects"),
        )
    assert summary.items_dead_lettered == len(NOT_OK)
    assert summary.items_acked == len(ITEMS_SOME_NOT_OK) - len(NOT_OK)
    rows = read_delta(warehouse / "rejects", key="position")
    assert sorted(rows) == [item["id"] for item in NOT_OK]  # source position == id here
    assert {r["error_code"] for r in rows.values()} == {"ITEM_FAILED"}
    assert rows[3]["error"] == "item 3 is not ok"


async def test_an_idempotent_receiver_is_retried_on_the_node_before_the_client_resends(
    cluster: list[Node],
) -> None:
    from deltaflow.testing import Flaky

    options = StreamerOptions(page_size=1000, auto_flush_interval=0)
    async with deltaflow.connect([cluster[0].address]) as client:
        Flaky.calls = 0
        results: list[Any] = []
        summary = await client.stream_data(
            [7],
            key=lambda x: x,
            receiver="deltaflow.testing.Flaky",
            receiver_args={"times": 2},
            on_result=results.append,
            options=options,
        )
        # Two failures absorbed on the node: the client never resent, the third run succeeded.
        assert summary.batches_retried == 0
        assert results == [{"item": 7, "attempt": 3}]
        # Three failures exhaust the node's retries (node_retries = 2): the client resends, and
        # the receiver sees that delivery's attempt number.
        Flaky.calls = 0
        results.clear()
        summary = await client.stream_data(
            [7],
            key=lambda x: x,
            receiver="deltaflow.testing.Flaky",
            receiver_args={"times": 3},
            on_result=results.append,
            options=options,
        )
        assert summary.batches_retried == 1
        assert results == [{"item": 7, "attempt": 2}]
    assert sum(n.dispatcher.stats.node_retries for n in cluster) == 4


@pytest.mark.parametrize(
    ("override", "bound"), [({}, 2), ({"deltaflow.testing.Concurrency": 3}, 3)]
)
async def test_receiver_concurrency_is_bounded_across_streams_and_partitions(
    warehouse: Any, override: dict[str, int], bound: int, start_cluster: StartCluster
) -> None:
    from deltaflow.testing import Concurrency

    (node,) = await start_cluster(
        warehouse, count=1, engine="delta-rs", receiver_concurrency=override
    )
    Concurrency.peak = 0
    try:
        async with deltaflow.connect([node.address]) as client:
            summaries = await asyncio.gather(
                *(
                    client.stream_data(
                        range(s * 1000, (s + 1) * 1000),
                        key=lambda x: x,
                        receiver="deltaflow.testing.Concurrency",
                        options=StreamerOptions(page_size=20, max_in_flight=32),
                    )
                    for s in range(3)
                )
            )
    finally:
        await node.stop()
    assert [s.items_acked for s in summaries] == [1000, 1000, 1000]
    assert Concurrency.peak == bound  # the class's max_concurrency, or the node's override


async def test_streamed_results_arrive_before_the_batch_is_acked(cluster: list[Node]) -> None:
    from deltaflow.testing import Gated

    Gated.gate = asyncio.Event()
    events: list[str] = []

    def on_result(value: Any) -> None:
        events.append(f"result {value}")
        # The batch cannot complete before this: its receiver waits for the gate.
        assert Gated.gate is not None
        Gated.gate.set()

    try:
        async with deltaflow.connect([cluster[0].address]) as client:
            await client.stream_data(
                [1, 2, 3],
                key=lambda x: "one key",
                receiver="deltaflow.testing.Gated",
                on_result=on_result,
                on_ack=lambda items: events.append(f"ack {items}"),
            )
    finally:
        Gated.gate = None
    # The first result reached the caller while the batch was still running; the others are
    # delivered through the result buffer, in order.
    assert events[0] == "result 1"
    assert [e for e in events if e.startswith("result")] == ["result 1", "result 2", "result 3"]
    assert "ack [1, 2, 3]" in events


async def test_a_receiver_writes_two_tables_returns_results_and_rejects_single_items(
    warehouse: Any,
    start_cluster: StartCluster,
) -> None:
    import deltalake

    payments = [
        {"id": i, "payer": f"acct-{i % 7}", "payee": f"acct-{(i + 1) % 7}", "amount": 10.0 + i}
        for i in range(300)
    ]
    for bad in (3, 150):
        payments[bad]["amount"] = -1.0
    payments[200]["payee"] = payments[200]["payer"]
    nodes = await start_cluster(
        warehouse, engine="delta-rs", receivers=["examples.receivers.SettlePayments"]
    )
    results: list[Any] = []
    try:
        async with deltaflow.connect([nodes[0].address]) as client:
            summary = await client.stream_data(
                payments,
                key="id",
                receiver="examples.receivers.SettlePayments",
                receiver_args={"fee_rate": 0.1},
                on_result=results.append,
                options=StreamerOptions(on_failure="drop"),
            )
    finally:
        for node in nodes:
            await node.stop()
    assert summary.items_failed == 3 and summary.items_acked == 297
    settled = read_delta(warehouse / "payments")
    assert sorted(settled) == sorted(set(range(300)) - {3, 150, 200})
    assert settled[10]["fee"] == 2.0 and settled[10]["net"] == 18.0
    assert {r["id"]: (r["fee"], r["net"]) for r in results}[10] == (2.0, 18.0)
    ledger = deltalake.DeltaTable(str(warehouse / "account_ledger")).to_pyarrow_table().to_pylist()
    assert len(ledger) == 2 * 297  # one debit and one credit per settled payment, once each
    fees = sum(row["fee"] for row in settled.values())
    assert round(sum(row["delta"] for row in ledger), 6) == round(-fees, 6)


class StageThenRaise(Receiver):
    """Upserts its items into ``held``, then, for a batch holding a ``boom`` item, waits for
    ``gate`` and raises: its write sits queued while other batches commit."""

    gate: asyncio.Event | None = None

    async def receive(self, items: list[Any], ctx: Any) -> None:
        await ctx.table("held", key="id").upsert(items)
        if any(item.get("boom") for item in items):
            assert StageThenRaise.gate is not None
            await StageThenRaise.gate.wait()
            raise ValueError("raised after staging its write")


async def test_a_receiver_that_raises_after_staging_leaves_nothing_in_the_table(
    warehouse: Any,
    start_cluster: StartCluster,
) -> None:
    (node,) = await start_cluster(
        warehouse, count=1, engine="delta-rs", receivers=["tests.test_receivers.StageThenRaise"]
    )
    StageThenRaise.gate = asyncio.Event()
    receiver = "tests.test_receivers.StageThenRaise"
    try:
        async with deltaflow.connect([node.address]) as client:
            doomed = asyncio.create_task(
                client.stream_data([{"id": 1, "boom": True}], key="id", receiver=receiver)
            )
            # Committed while the doomed batch's write is queued ahead of it.
            other = await client.stream_data(
                [{"id": i, "boom": False} for i in range(2, 11)], key="id", receiver=receiver
            )
            assert other.items_acked == 9
            StageThenRaise.gate.set()
            with pytest.raises(DataStreamerError) as info:
                await doomed
    finally:
        StageThenRaise.gate = None
        await node.stop()
    assert info.value.failed_items == [{"id": 1, "boom": True}]
    assert sorted(read_delta(warehouse / "held")) == list(range(2, 11))  # id 1 never landed


async def test_the_summary_reports_how_long_acks_took(cluster: list[Node]) -> None:
    """A batch's ack latency runs from its send to its ack: here, the 0.3 s its receiver is
    held after yielding its first result."""
    from deltaflow.testing import Gated

    Gated.gate = asyncio.Event()
    held = 0.3
    opened: list[asyncio.TimerHandle] = []

    def on_result(value: Any) -> None:  # the receiver runs: open its gate in 0.3 s
        if not opened:
            assert Gated.gate is not None
            opened.append(asyncio.get_running_loop().call_later(held, Gated.gate.set))

    try:
        async with deltaflow.connect([cluster[0].address]) as client:
            summary = await client.stream_data(
                [1, 2, 3],
                key=lambda x: "one key",
                receiver="deltaflow.testing.Gated",
                on_result=on_result,
            )
    finally:
        Gated.gate = None
    latency = summary.ack_latency
    assert latency.batches == 1
    assert held <= latency.max < held + 1.0
    assert held * 0.97 <= latency.p50 <= latency.p99 <= latency.max
    assert latency.mean == latency.max


def test_ack_latency_quantiles_are_within_two_percent() -> None:
    import random

    from deltaflow.client.latency import LatencyHistogram

    rng = random.Random(7)
    seconds = [rng.lognormvariate(-2.0, 1.0) for _ in range(20_000)]
    histogram = LatencyHistogram()
    for s in seconds:
        histogram.observe(s)
    ordered = sorted(seconds)
    summary = histogram.summary()
    assert summary.batches == len(seconds)
    for q, got in ((0.5, summary.p50), (0.9, summary.p90), (0.99, summary.p99)):
        exact = ordered[int(q * len(ordered)) - 1]
        assert abs(got - exact) <= 0.025 * exact, (q, got, exact)
    assert summary.max == ordered[-1]
    assert abs(summary.mean - sum(seconds) / len(seconds)) < 1e-9


async def test_dropped_batches_are_told_once_then_summed_up(
    cluster: list[Node], caplog: pytest.LogCaptureFixture
) -> None:
    """20 items dropped under on_failure="drop" make two warnings, not one per batch."""
    with caplog.at_level(logging.WARNING, logger="deltaflow.client.stream"):
        async with deltaflow.connect([cluster[0].address]) as client:
            summary = await client.stream_data(
                ["bad"] * 20,
                key=lambda item: item,
                receiver="deltaflow.testing.FailOn",
                receiver_args={"fail_on": "bad"},
                options=StreamerOptions(on_failure="drop", page_size=1, max_in_flight=1),
            )
    assert summary.items_failed == 20
    warnings = [r.getMessage() for r in caplog.records if r.name == "deltaflow.client.stream"]
    assert len(warnings) == 2, warnings
    assert "further drops are summed up when the stream ends" in warnings[0]
    assert "dropped 20 item(s) in 20 batches in all" in warnings[1]


async def test_a_receiver_reads_a_table_of_its_warehouse(
    tmp_path: Any, start_cluster: StartCluster
) -> None:
    """``ctx.read_table``: a receiver enriches items from a table other streams wrote, and
    ``ctx.warehouse`` names where the node's tables are."""
    nodes = await start_cluster(tmp_path, engine="delta-rs")
    customers = [{"id": i, "name": f"customer {i}", "tier": i % 3} for i in range(50)]
    async with deltaflow.connect([nodes[0].address]) as client:
        await client.stream_data(customers, table="customers", key="id")
        results: list[Any] = []
        await client.stream_data(
            [3, 7, 60], key=lambda i: i, receiver="deltaflow.testing.Lookup",
            receiver_args={"table": "customers"}, on_result=results.append,
        )  # fmt: skip
        with pytest.raises(DataStreamerError, match="no Delta table 'nowhere'"):
            await client.stream_data(
                [1], key=lambda i: i, receiver="deltaflow.testing.Lookup",
                receiver_args={"table": "nowhere"},
            )  # fmt: skip
    by_id = {r["id"]: r for r in results}
    assert by_id[3]["name"] == "customer 3"
    assert by_id[7]["name"] == "customer 7"
    assert by_id[60]["name"] is None
    assert {r["warehouse"] for r in results} == {str(tmp_path)}
