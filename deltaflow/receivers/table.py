"""The built-in table receiver: upsert rows (and deletes) into a Delta table by key, or append
them to one without a key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import SchemaError
from .base import Receiver, ReceiverContext

__all__ = ["TableUpsert"]


class TableUpsert(Receiver):
    """Used when a client calls ``stream_data(rows, table=..., key=...)``.

    ``ctx.args`` is ``{"table": name, "key": [column, ...]}`` (an empty key appends the rows),
    ``"sequence_by": [column, ...]`` when the stream names one, and ``"on_bad_row":
    "quarantine"`` to fail the rows that do not fit alone (``ctx.fail``) and write the rest.
    Rows are dicts; items marked :class:`deltaflow.Delete` delete their key. The table is
    created from the rows' schema on first write. Produces no per-item results.
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
        sequence = args.get("sequence_by")
        if sequence is not None and not (
            isinstance(sequence, list) and sequence and all(isinstance(c, str) for c in sequence)
        ):
            raise SchemaError(
                "the table receiver's sequence_by is a list of column names", node=ctx.node_id
            )
        handle = ctx.table(table, key=args["key"], sequence_by=sequence)
        # Rows that do not fit go to the dead-letter table alone (the client's side of it).
        bad_rows = ctx.fail if args.get("on_bad_row") == "quarantine" else None
        if handle.key:
            await handle.upsert(items, deletes=ctx.deletes, bad_rows=bad_rows)
            return
        if ctx.deletes:
            raise SchemaError(
                f"table {handle.name!r} is appended to (the stream has no key=): item "
                f"#{min(ctx.deletes)} is a Delete, which needs a key",
                node=ctx.node_id,
                details={"item": min(ctx.deletes)},
            )
        await handle.append(items, bad_rows=bad_rows)
