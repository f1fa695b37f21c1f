"""The built-in dead-letter receiver: failed items, with their error, appended to a table."""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Sequence
from typing import Any, Final

from ..errors import ProtocolError, SchemaError
from ..protocol import unpack_items
from .base import Receiver, ReceiverContext

__all__ = ["DeadLetter", "payload_json"]


def payload_json(payload: bytes) -> str | None:
    """A dead-lettered item (msgpack) as strict JSON text (RFC 8259: no ``NaN``); None if it
    is not msgpack. Decoded with the wire's limits: data only, nothing is imported or run.

    Every wire value has a JSON form (``docs/receivers.md``): bytes as hex; ``NaN``,
    ``Infinity`` and ``-Infinity`` as those strings; decimals as their digits (a string);
    dates and times in ISO 8601; a map's keys as strings (bytes keys as hex, numbers as their
    digits, ``true``/``false``/``null``; of two keys that become the same string, the later
    stays). ``payload`` keeps the item exactly.
    """
    try:
        [item] = unpack_items(payload, 1)
    except ProtocolError:
        return None
    try:
        return json.dumps(_jsonable(item), ensure_ascii=False, allow_nan=False)
    except RecursionError:  # nested past what JSON writing takes
        return None


def _jsonable(value: Any) -> Any:
    """``value`` (as the wire decodes it) as the values JSON has."""
    if isinstance(value, dict):
        return {_key(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return _NOT_FINITE[str(value)]
    if value is None or isinstance(value, str | int | float):
        return value
    return _text(value)


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, bool) or key is None:
        return json.dumps(key)
    if isinstance(key, float):
        return _NOT_FINITE.get(str(key)) or repr(key)
    return str(key) if isinstance(key, int) else _text(key)


def _text(value: Any) -> str:
    """A value JSON has no type for: bytes as hex, times in ISO 8601, decimals as digits."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    isoformat = getattr(value, "isoformat", None)
    return str(isoformat()) if callable(isoformat) else str(value)


_NOT_FINITE: Final = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


class DeadLetter(Receiver):
    """Used by clients streaming with ``on_failure="fallback"``.

    Each item describes one failed source item; it becomes a row of ``ctx.args["table"]``:
    ``stream_id``, ``position`` (index in the source), ``partition``, ``seq`` (the failed
    batch; both -1 for a row the client could not route), ``error_code``, ``error``,
    ``node``, ``payload`` (the item, msgpack-encoded: ``msgpack.unpackb(payload,
    timestamp=3)`` gives it back exactly), ``payload_json`` (the
    item as strict JSON, for people and SQL: see :func:`payload_json`; null if it cannot be
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
