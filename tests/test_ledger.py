"""The failure ledger: exactly the items not applied, in source order, each with its reason;
and the commit watermark that only moves over a contiguous settled prefix."""

from __future__ import annotations

import asyncio

import pytest

from deltaflow.client.ledger import CommitPosition, Ledger, Watermark, locate
from deltaflow.errors import (
    DataStreamerError,
    FailedItem,
    SchemaError,
    ServerError,
    is_retriable,
)


def test_a_failed_stream_lists_exactly_the_recorded_items_in_source_order() -> None:
    ledger = Ledger()
    ledger.fail([5, 6], ["e", "f"], ["bad e", "bad f"])
    ledger.fail([0, 9], ["a", "j"])  # never sent
    ledger.fail([3], ["d"], [None])
    assert len(ledger) == 5
    cause = ValueError("boom")
    with pytest.raises(DataStreamerError) as info:
        ledger.raise_outcome(cause, sid="s1", applied=12)
    err = info.value
    assert err.failed_items == ["a", "d", "e", "f", "j"]
    stopped = "not applied: the stream stopped before it was sent (boom)"
    assert err.failures == [
        FailedItem(0, "a", stopped),
        FailedItem(3, "d", stopped),
        FailedItem(5, "e", "bad e"),
        FailedItem(6, "f", "bad f"),
        FailedItem(9, "j", stopped),
    ]
    assert err.cause is cause and err.__cause__ is cause
    assert str(err) == "stream s1 failed: boom; 5 item(s) not applied (12 applied)"


def test_a_cancelled_stream_stays_cancelled_and_says_what_became_of_each_item() -> None:
    ledger = Ledger()
    ledger.fail([4, 1], ["d", "b"])
    ledger.doubt([7, 2], ["g", "c"])
    cancelled = asyncio.CancelledError()
    with pytest.raises(asyncio.CancelledError) as info:
        ledger.raise_outcome(cancelled, sid="s", applied=3)
    assert info.value is cancelled
    assert info.value.not_applied == ["b", "d"]  # type: ignore[attr-defined]
    assert info.value.in_doubt == ["c", "g"]  # type: ignore[attr-defined]
    assert info.value.applied == 3  # type: ignore[attr-defined]


def test_items_and_reasons_must_pair_up() -> None:
    with pytest.raises(ValueError, match="zip"):
        Ledger().fail([1, 2], ["a"])
    with pytest.raises(ValueError, match="zip"):
        Ledger().fail([1], ["a"], ["x", "y"])
    with pytest.raises(ValueError, match="zip"):
        Ledger().doubt([1, 2], ["a"])
    with pytest.raises(ValueError, match="zip"):
        Watermark().settle([0, 1], ["a"])


def test_items_are_reported_in_source_order_not_in_the_order_of_the_items() -> None:
    ledger = Ledger()
    ledger.fail([2, 0], [{"id": "a"}, {"id": "z"}], ["bad a", "bad z"])
    ledger.doubt([5, 3], ["b", "y"])
    cancelled = asyncio.CancelledError()
    with pytest.raises(asyncio.CancelledError):
        ledger.raise_outcome(cancelled, sid="s", applied=0)
    assert cancelled.not_applied == [{"id": "z"}, {"id": "a"}]  # type: ignore[attr-defined]
    assert cancelled.in_doubt == ["y", "b"]  # type: ignore[attr-defined]
    with pytest.raises(DataStreamerError) as info:
        ledger.raise_outcome(ValueError("x"), sid="s", applied=0)
    assert [f.position for f in info.value.failures] == [0, 2]


def test_the_watermark_moves_only_over_a_contiguous_settled_prefix() -> None:
    mark = Watermark()
    assert mark.settle([1, 2], ["b", "c"]) is None  # 0 is still out
    assert mark.count == 0
    assert mark.settle([0], ["a"]) == CommitPosition(3, "c")
    assert mark.settle([4], ["e"]) is None
    assert mark.settle([3], ["d"]) == CommitPosition(5, "e")
    assert mark.count == 5
    assert mark.settle([], []) is None


def test_an_item_a_node_names_by_its_index_is_named_by_source_position_and_key() -> None:
    exc = SchemaError(
        "item #1 of the batch: column 'v' of table 't' is long; 2.5 (float) has a fraction",
        node="n1",
        details={"item": 1, "column": "v"},
    )
    items = [{"id": 10}, {"id": 11}, {"id": 12}]
    located, reasons = locate(exc, items, [40, 41, 42], partition=3, key_of=lambda row: row["id"])
    assert type(located) is SchemaError
    assert located.node == "n1"
    assert located.details == {"item": 1, "column": "v", "position": 41}
    assert located.args[0] == (
        "source item #41 (key 11): column 'v' of table 't' is long; 2.5 (float) has a fraction"
    )
    refused = f"not applied: its batch (partition 3) was refused: {located}"
    assert reasons == [refused, str(located), refused]


def test_only_the_item_the_node_named_first_is_renamed_in_its_message() -> None:
    # "item #1 of the batch: same key as item #0 of the batch": the second is another item.
    exc = SchemaError("item #1 of the batch: same key as item #0 of the batch", details={"item": 1})
    located, _ = locate(exc, ["a", "b"], [8, 9], partition=0, key_of=str)
    assert located.args[0] == "source item #9 (key 'b'): same key as item #0 of the batch"


def test_a_message_without_the_batch_index_gets_the_source_position_in_front() -> None:
    exc = SchemaError("no key", details={"item": 0})
    located, _ = locate(exc, ["x"], [7], partition=0, key_of=lambda item: None)
    assert located.args[0] == "source item #7 (key None): no key"


@pytest.mark.parametrize("item", [None, -1, 2, True, "1"])
def test_an_error_naming_no_valid_item_is_kept_for_the_whole_batch(item: object) -> None:
    exc = ServerError("the node broke", details={} if item is None else {"item": item})
    located, reasons = locate(exc, ["a", "b"], [0, 1], partition=0, key_of=str)
    assert located is exc
    assert reasons == [str(exc), str(exc)]
    plain = ValueError("not from a node")
    assert locate(plain, ["a"], [0], partition=0, key_of=str) == (plain, [str(plain)])


@pytest.mark.parametrize(
    "exc",
    [
        ServerError("item #0 of the batch: commit failed", details={"item": 0}, retriable=False),
        SchemaError("item #0 of the batch: no column v", details={"item": 0}, retriable=True),
    ],
)
def test_an_item_named_by_its_source_position_keeps_the_nodes_retry_decision(
    exc: ServerError,
) -> None:
    # The node decided for this one error, against its class's default: the stream must not
    # resend a batch the node called final, nor give up on one it called worth another try.
    located, _ = locate(exc, ["a", "b"], [4, 5], partition=0, key_of=str)
    assert located.args[0].startswith("source item #4 (key 'a'): ")
    assert is_retriable(located) is exc.retriable
    assert is_retriable(located) is not type(exc).retriable
