"""A custom receiver: enrich each order, upsert it, and return a per-item result.

Register it on every node:
    PYTHONPATH=examples deltaflow serve --node-id n1 --warehouse /tmp/wh \\
        --receiver receivers.EnrichOrders
Stream through it:
    await client.stream_data(orders, key="id", receiver="receivers.EnrichOrders",
                             receiver_args={"vat": 0.2}, on_result=print)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from deltaflow.receivers import Receiver, ReceiverContext


class EnrichOrders(Receiver):
    """Adds the gross amount, upserts into ``orders``, yields ``{"id", "gross"}`` per item."""

    async def receive(  # type: ignore[override]
        self, items: list[Any], ctx: ReceiverContext
    ) -> AsyncIterator[Any]:
        vat = float((ctx.args or {}).get("vat", 0.0))
        rows = [
            item if ctx.is_delete(i) else {**item, "gross": round(item["amount"] * (1 + vat), 2)}
            for i, item in enumerate(items)
        ]
        # Staged for the node's next group commit; the batch is acked once that commit lands.
        await ctx.table("orders", key="id").upsert(rows, deletes=ctx.deletes)
        for i, row in enumerate(rows):
            if not ctx.is_delete(i):
                yield {"id": row["id"], "gross": row["gross"]}
