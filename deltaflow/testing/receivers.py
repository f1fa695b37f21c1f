"""Receivers to register on a node (``--receiver deltaflow.testing.Echo``) for smoke tests of a
deployment and for the product's own tests: echoes, injected failures, appends, order and
concurrency records."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ..errors import OverloadedError
from ..receivers.base import Receiver, ReceiverContext

__all__ = [
    "AppendRows",
    "Concurrency",
    "Discard",
    "Echo",
    "EchoStream",
    "FailOn",
    "Flaky",
    "Gated",
    "RecordOrder",
    "TwoTables",
    "Unconstructible",
    "Validate",
]


class Discard(Receiver):
    """Accepts every item and does nothing (a no-op receiver, for load tests)."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> None:
        return None


class Echo(Receiver):
    """Returns each item as its result."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        return list(items)


class EchoStream(Receiver):
    """Yields each item as its result as it goes (an async-generator receiver)."""

    async def receive(  # type: ignore[override]
        self, items: Sequence[Any], ctx: ReceiverContext
    ) -> AsyncIterator[Any]:
        for item in items:
            yield item


class FailOn(Receiver):
    """Returns items like :class:`Echo`, but raises on an item equal to ``args["fail_on"]``.

    ``args["retriable"]`` true raises a retriable error instead (the client resends), but only
    the first ``args.get("times", 1)`` times on this node.
    """

    raised = 0

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        args = ctx.args or {}
        if args.get("fail_on") in items:
            if args.get("retriable"):
                if FailOn.raised < args.get("times", 1):
                    FailOn.raised += 1
                    raise OverloadedError("injected retriable failure")
            else:
                raise ValueError(f"injected failure on item {args['fail_on']!r}")
        return list(items)


class AppendRows(Receiver):
    """Appends every item (a row) to the table ``args["table"]``: not idempotent by itself,
    so it shows that resent batches are not applied twice."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> None:
        await ctx.table(ctx.args["table"]).append(items)


class RecordOrder(Receiver):
    """Echoes items and records each item it applies in ``RecordOrder.applied``, in the order
    this process's nodes applied them: what per-key order is checked against."""

    applied: list[Any] = []  # noqa: RUF012 - one record per process, on purpose

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        RecordOrder.applied.extend(items)
        return list(items)


class TwoTables(Receiver):
    """Upserts every row (keyed by ``id``) into both tables named in ``args["tables"]``: one
    batch, two table commits, one ack."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> None:
        for table in ctx.args["tables"]:
            await ctx.table(table, key=["id"]).upsert(items)


class Unconstructible(Receiver):
    """A receiver whose constructor raises: a stream naming it fails to open with
    ``RECEIVER_FAILED``, and other streams go on (a deployment's broken receiver)."""

    def __init__(self) -> None:
        raise RuntimeError("this receiver cannot be constructed (deltaflow.testing)")

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> None:
        raise AssertionError("never constructed")


class Validate(Receiver):
    """Echoes dict items, but marks failed (``ctx.fail``) every item whose ``"ok"`` is false:
    the rest of the batch is applied."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        out = []
        for i, item in enumerate(items):
            if item.get("ok", True):
                out.append(item)
            else:
                ctx.fail(i, f"item {item.get('id')!r} is not ok")
        return out


class Flaky(Receiver):
    """An idempotent receiver that raises a retriable error on its first ``args["times"]`` calls
    (counted per node in ``Flaky.calls``), then returns ``{"item": x, "attempt": n}`` results."""

    idempotent = True
    calls = 0

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        Flaky.calls += 1
        if Flaky.calls <= (ctx.args or {}).get("times", 1):
            raise OverloadedError(f"injected retriable failure {Flaky.calls}")
        return [{"item": x, "attempt": ctx.attempt} for x in items]


class Concurrency(Receiver):
    """Echoes items after a short await, recording how many calls ran at once (``peak``); at
    most ``max_concurrency`` = 2 unless the node overrides it."""

    max_concurrency = 2
    running = 0
    peak = 0

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        Concurrency.running += 1
        Concurrency.peak = max(Concurrency.peak, Concurrency.running)
        try:
            await asyncio.sleep(0.01)  # stands for work; lets other lanes start meanwhile
        finally:
            Concurrency.running -= 1
        return list(items)


class Gated(Receiver):
    """Yields its first item's result, then waits for ``Gated.gate`` (an asyncio.Event the test
    sets) before yielding the rest: shows results stream back before the batch completes."""

    gate: asyncio.Event | None = None

    async def receive(  # type: ignore[override]
        self, items: Sequence[Any], ctx: ReceiverContext
    ) -> AsyncIterator[Any]:
        for i, item in enumerate(items):
            yield item
            if i == 0 and Gated.gate is not None:
                await Gated.gate.wait()


class Lookup(Receiver):
    """A receiver that reads a table: for each id, the ``name`` of the row with that id in
    table ``args["table"]`` (None if there is none), and the node's warehouse."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[Any]:
        ids = ", ".join(str(int(i)) for i in items)
        found = await ctx.read_table(
            ctx.args["table"], columns=["id", "name"], where=f"id IN ({ids})"
        )
        names = {row["id"]: row["name"] for row in found.to_pylist()}
        return [{"id": i, "name": names.get(i), "warehouse": ctx.warehouse} for i in items]
