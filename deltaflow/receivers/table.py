"""The built-in table receiver: upsert rows (and deletes) into a Delta table by key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import SchemaError
from .base import Receiver, ReceiverContext

__all__ = ["TableUpsert"]


class TableUpsert(Receiver):
    """Used when a client calls ``stream_data(rows, table=..., key=...)``.

    ``ctx.args`` is ``{"table": name, "key": [column, ...]}``. Rows are dicts; items marked
    :class:`deltaflow.Delete` delete their key. The table is created from the rows' schema on
    first write. Produces no per-item results.
    """

    # Its only effects are table writes, which are exactly-once: re-running is safe.
    idempotent = True

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> None:
        args = ctx.args
        if not isinstance(args, dict) or not isinstance(args.get("key"), list):
            raise SchemaError(
                "the table receiver needs receiver_args {'table': name, 'key': [columns]}",
                node=ctx.node_id,
            )
        # Unchecked here on purpose: ctx.table() rejects a missing or bad name with a SchemaError.
        table: Any = args.get("table")
        await ctx.table(table, key=args["key"]).upsert(items, deletes=ctx.deletes)
