"""The built-in dead-letter receiver: failed items, with their error, appended to a table."""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

from ..errors import ProtocolError, SchemaError
from ..protocol import unpack_items
from .base import Receiver, ReceiverContext

__all__ = ["DeadLetter", "payload_json"]


def payload_json(payload: bytes) -> str | None:
    """A dead-lettered item (msgpack) as JSON text; None if it is not msgpack. Decoded with
    the wire's limits: data only, nothing is imported or run."""
    try:
        [item] = unpack_items(payload, 1)
    except ProtocolError:
        return None
    try:
        return json.dumps(item, default=_plain, ensure_ascii=False)
    except (RecursionError, ValueError):  # nested past what JSON writing takes
        return None


def _plain(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    isoformat = getattr(value, "isoformat", None)
    return isoformat() if callable(isoformat) else str(value)


class DeadLetter(Receiver):
    """Used by clients streaming with ``on_failure="fallback"``.

    Each item describes one failed source item; it becomes a row of ``ctx.args["table"]``:
    ``stream_id``, ``position`` (index in the source), ``partition``, ``seq`` (the failed
    batch), ``error_code``, ``error``, ``node``, ``payload`` (the item, msgpack-encoded:
    ``msgpack.unpackb(payload, timestamp=3)`` gives it back exactly), ``payload_json`` (the
    item as JSON, for people and SQL: bytes as hex, times in ISO 8601; null if it cannot be
    read), ``deleted`` (it was a :class:`deltaflow.Delete`) and ``failed_at`` (a UTC
    timestamp).
    """

    # Its only effects are table writes, which are exactly-once: re-running is safe.
    idempotent = True

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> None:
        args = ctx.args if isinstance(ctx.args, dict) else {}
        if not isinstance(args.get("table"), str):
            raise SchemaError("the dead-letter receiver needs receiver_args {'table': name}")
        now = datetime.datetime.now(datetime.UTC)
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
                "payload_json": payload_json(bytes(item["payload"])),
                "deleted": bool(item.get("deleted")),
                "failed_at": now,
            }
            for item in items
        ]
        await ctx.table(args["table"]).append(rows)
