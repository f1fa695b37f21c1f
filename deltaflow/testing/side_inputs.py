"""Side inputs for tests (``--side-input deltaflow.testing.FileSideInput``), a receiver that
returns what a side input held for each item, and values whose tearing would show."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..receivers.base import Receiver, ReceiverContext
from ..receivers.side_input import SideInput

__all__ = [
    "SIDE_INPUT_FILE_ENV",
    "FailingSideInput",
    "FileSideInput",
    "SideInputEcho",
    "check_stamped",
    "stamped_value",
]


#: The environment variable :class:`FileSideInput` reads its file's path from.
SIDE_INPUT_FILE_ENV = "DELTAFLOW_SIDE_INPUT_FILE"


class FileSideInput(SideInput):
    """Side input ``"file"``: the bytes of the file named by ``$DELTAFLOW_SIDE_INPUT_FILE``,
    read every 0.1 s; it declines (returns None, no new version) while the file is missing.

    Replace the file atomically (write a temporary file, then ``os.replace``) so it is never
    read half-written.
    """

    name = "file"
    interval = 0.1

    def retrieve(self) -> bytes | None:
        path = os.environ.get(SIDE_INPUT_FILE_ENV)
        if not path:
            raise RuntimeError(f"set ${SIDE_INPUT_FILE_ENV} to the file holding side input 'file'")
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None


class FailingSideInput(SideInput):
    """Side input ``"failing"``: every retrieval raises, like a source that is down."""

    name = "failing"
    interval = 0.2

    def retrieve(self) -> bytes | None:
        raise ConnectionError("injected: the side input's source is down")


def _stamp_blob(stamp: int, size: int) -> str:
    unit = f"{stamp}-"
    return (unit * (size // len(unit) + 1))[:size]


def stamped_value(stamp: int, size: int = 100_000) -> bytes:
    """A JSON side-input value of about ``size`` bytes, every part of which depends on
    ``stamp``, with its own checksum: :func:`check_stamped` tells whether it is whole."""
    blob = _stamp_blob(stamp, size)
    digest = hashlib.sha256(blob.encode()).hexdigest()
    return json.dumps({"stamp": stamp, "blob": blob, "sha256": digest}).encode()


def check_stamped(raw: bytes) -> dict[str, Any]:
    """``{"stamp": int | None, "ok": bool}``: whether ``raw`` is one whole
    :func:`stamped_value` (a parse function for ``ctx.side_input``)."""
    try:
        value = json.loads(raw)
        stamp, blob = value["stamp"], value["blob"]
        whole = hashlib.sha256(blob.encode()).hexdigest() == value["sha256"]
        ok = whole and blob == _stamp_blob(stamp, len(blob))
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"stamp": None, "ok": False}
    return {"stamp": stamp, "ok": ok}


class SideInputEcho(Receiver):
    """For every item, what side input ``args["name"]`` (default ``"file"``) held when the
    item was processed: ``{"item", "stamp", "ok", "node"}``, read per item from a worker
    thread through ``ctx.side_input(name, parse=check_stamped)``."""

    async def receive(self, items: Sequence[Any], ctx: ReceiverContext) -> list[dict[str, Any]]:
        name = (ctx.args or {}).get("name", "file")

        def read() -> list[dict[str, Any]]:
            out = []
            for item in items:
                seen = ctx.side_input(name, parse=check_stamped)
                out.append(
                    {"item": item, "stamp": seen["stamp"], "ok": seen["ok"], "node": ctx.node_id}
                )
            return out

        return await asyncio.to_thread(read)
