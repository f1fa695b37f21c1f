"""Worked receivers (see docs/receivers.md).

- ``EnrichOrders``: enrich each order with the VAT rate of its country, read from the
  ``VatRates`` side input, upsert it, and stream a per-item result back.
- ``SettlePayments``: write two tables in one batch (upsert ``payments``, append to
  ``account_ledger``), return computed results, and reject single bad items with ``ctx.fail``.

Register them on every node:
    VAT_RATES_FILE=/etc/myapp/vat.json PYTHONPATH=examples deltaflow serve --node-id n1 \\
        --warehouse /tmp/wh --side-input receivers.VatRates \\
        --receiver receivers.EnrichOrders --receiver receivers.SettlePayments
Stream through one:
    await client.stream_data(orders, key="id", receiver="receivers.EnrichOrders",
                             on_result=print)
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from deltaflow.receivers import Receiver, ReceiverContext, SideInput


class VatRates(SideInput):
    """Side input ``vat_rates``: a JSON object of VAT rates by country code, with a
    ``"default"``, read from the file named by ``$VAT_RATES_FILE`` every 30 seconds.

    Only the side input's leader node reads the file; every node gets each new version. An
    unchanged file makes no new version; a missing one is an error (the nodes keep the last
    value, and a node does not start until there is one).
    """

    name = "vat_rates"
    interval = 30.0

    def retrieve(self) -> bytes:
        data = Path(os.environ["VAT_RATES_FILE"]).read_bytes()
        rates = json.loads(data)  # refuse to broadcast a file that is not valid
        if not isinstance(rates, dict) or "default" not in rates:
            raise ValueError('VAT rates must be a JSON object with a "default" rate')
        return data


class EnrichOrders(Receiver):
    """Adds the gross amount at the VAT rate of each order's ``country`` (side input
    ``vat_rates``), upserts into ``orders``, and yields ``{"id", "gross", "rate"}`` per item."""

    idempotent = True  # table writes only, which are exactly-once

    async def receive(  # type: ignore[override]
        self, items: list[Any], ctx: ReceiverContext
    ) -> AsyncIterator[Any]:
        # Read once per batch: every item of the batch sees the same version. Parsed once per
        # version on the node, however many batches read it.
        rates = ctx.side_input("vat_rates", parse=json.loads)
        rows = []
        for i, item in enumerate(items):
            if ctx.is_delete(i):
                rows.append(item)
                continue
            rate = float(rates.get(item.get("country"), rates["default"]))
            rows.append({**item, "rate": rate, "gross": round(item["amount"] * (1 + rate), 2)})
        # Staged for the node's next group commit; the batch is acked once that commit lands.
        await ctx.table("orders", key="id").upsert(rows, deletes=ctx.deletes)
        for i, row in enumerate(rows):
            if not ctx.is_delete(i):
                yield {"id": row["id"], "gross": row["gross"], "rate": row["rate"]}


class SettlePayments(Receiver):
    """Settles payments: one row per payment in ``payments`` (upsert by ``id``), and a
    double-entry pair of rows per payment in ``account_ledger`` (append).

    Items are ``{"id": int, "payer": str, "payee": str, "amount": float}``; ``receiver_args``
    may hold ``{"fee_rate": float}``. Each settled payment yields ``{"id", "fee", "net"}``. A
    payment with a non-positive amount or the same payer and payee is rejected alone
    (``ctx.fail``): the rest of the batch is settled. Both tables' writes are exactly-once
    (lane marks), so a resent batch never posts a ledger entry twice.
    """

    # Its only effects are table writes, which deltaflow applies exactly once: safe to re-run.
    idempotent = True

    async def receive(self, items: list[Any], ctx: ReceiverContext) -> list[dict[str, Any]]:
        fee_rate = float((ctx.args or {}).get("fee_rate", 0.01))
        payments: list[dict[str, Any]] = []
        ledger: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for i, item in enumerate(items):
            amount = float(item["amount"])
            if amount <= 0 or item["payer"] == item["payee"]:
                ctx.fail(i, f"payment {item['id']}: amount must be positive between two accounts")
                continue
            fee = round(amount * fee_rate, 2)
            net = round(amount - fee, 2)
            payments.append({**item, "amount": amount, "fee": fee, "net": net})
            ledger.append({"payment": item["id"], "account": item["payer"], "delta": -amount})
            ledger.append({"payment": item["id"], "account": item["payee"], "delta": net})
            results.append({"id": item["id"], "fee": fee, "net": net})
        # Both writes join the node's next group commit of their table; the batch is acked
        # once both commits are durable.
        await ctx.table("payments", key="id").upsert(payments)
        await ctx.table("account_ledger").append(ledger)
        return results
