"""The built-in dead-letter receiver: failed items, with their error, appended to a table."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import SchemaError
from .base import Receiver, ReceiverContext

__all__ = ["DeadLetter"]


class DeadLetter(Receiver):
    """Used by clients streaming with ``on_failure="fallback"``.

    Each item describes one failed source item; it becomes a row of ``ctx.args["table"]``:
    ``stream_id``, ``position`` (index in the source), ``partition``, ``seq`` (the failed
    batch), ``error_code``, ``error``, ``node``, ``payload`` (the item, msgpack-encoded),
    ``deleted`` (it was a :class:`deltaflow.Delete`) and ``failed_at`` (epoch seconds). Read
    ``payload`` back with ``msgpack.unpackb(payload, timestamp=3)``.
    """

    # Its only effects are table writes, which are exactly-once: re-running is safe.
    idempotent = True

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> None:
        args = ctx.args if isinstance(ctx.args, dict) else {}
        if not isinstance(args.get("table"), str):
            raise SchemaError("the dead-letter receiver needs receiver_args {'table': name}")
        now = time.time()
        rows = [
            {
                "stream_id": str(args.get("stream", ctx.stream_id)),
                "position": int(item["position"]),
                "partition": int(item["partition"]),
                "seq": int(item["seq"]),
                "error_code": str(item["error_code"]),
                "error": str(item["error"]),
                "node": str(item.get("node") or ""),
                "payload": bytes(item["payload"]),
                "deleted": bool(item.get("deleted")),
                "failed_at": now,
            }
            for item in items
        ]
        await ctx.table(args["table"]).append(rows)
