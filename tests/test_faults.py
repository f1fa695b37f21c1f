"""Delivery through injected faults (deltaflow.testing seams): lost requests, a node that
keeps failing, ordering of one key under pipelining while requests are lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import deltaflow
from deltaflow import DataStreamerError, Delete, StreamerOptions
from deltaflow.server import Node
from deltaflow.testing import FailOn, RequestDropper

from .support import echo_stream, read_delta

FAST_RETRY = {"retry_initial_backoff": 0.01, "retry_max_backoff": 0.1}
LOSSY = {**FAST_RETRY, "ack_timeout": 1.0}  # a lost request costs one ack timeout


@pytest.fixture
def engine() -> str:
    return "delta-rs"  # commits in milliseconds: a 1 s ack timeout is never hit by a commit


async def test_every_fifth_request_lost_and_every_item_lands_once(cluster: list[Node]) -> None:
    dropper = RequestDropper(every=5)
    items = list(range(5000))
    opts = StreamerOptions(page_size=100, **LOSSY)
    summary, results = await echo_stream(cluster[0].address, items, opts, dropper)
    assert dropper.dropped >= 10
    assert summary.items_acked == 5000 and summary.batches_retried == dropper.dropped
    assert sorted(results) == items
    assert sum(n.statistics().dispatcher.items_applied for n in cluster) == 5000


async def test_a_node_that_keeps_failing_exhausts_retries_with_exact_failed_items(
    cluster: list[Node],
) -> None:
    FailOn.raised = 0
    items = list(range(60))
    opts = StreamerOptions(page_size=10, retry_limit=3, per_partition_in_flight=2, **FAST_RETRY)
    results: list[int] = []
    async with deltaflow.connect([cluster[0].address]) as client:
        with pytest.raises(DataStreamerError) as info:
            await client.stream_data(
                items,
                key=lambda x: 0,
                receiver="deltaflow.testing.FailOn",
                receiver_args={"fail_on": 25, "retriable": True, "times": 10**9},
                on_result=results.append,
                options=opts,
            )
    # Batches 0 and 1 applied; batch 2 (items 20-29) never could be; everything after it was
    # queued behind it or never sent.
    assert info.value.failed_items == list(range(20, 60))
    assert info.value.cause is not None and "injected retriable failure" in str(info.value.cause)
    assert results == list(range(20))
    assert FailOn.raised == 4  # the first try and retry_limit=3 resends


async def test_put_delete_put_rounds_on_one_key_keep_order_while_requests_are_lost(
    cluster: list[Node], warehouse: Path
) -> None:
    items: list[Any] = []
    for r in range(40):  # one key, one lane: each lost request costs its ack timeout in turn
        items += [{"id": 7, "v": r}, Delete({"id": 7}), {"id": 7, "v": r + 1000}]
    items += [{"id": 8, "v": -1}]
    dropper = RequestDropper(every=5)
    opts = StreamerOptions(page_size=4, per_partition_in_flight=4, **LOSSY)
    async with deltaflow.connect([cluster[1].address], connection_factory=dropper) as client:
        await client.stream_data(items, table="one_key", key="id", options=opts)
    assert dropper.dropped > 0
    table = read_delta(warehouse / "one_key")
    assert table[7]["v"] == 1039  # the last put of the last round
    assert table[8]["v"] == -1
