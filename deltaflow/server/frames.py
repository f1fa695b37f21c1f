"""Frames on a node: a ``batch`` frame's items in, and the answers out: ``error``, ``ack``
and ``result`` frames (see docs/protocol.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

from ..columnar import decode_page
from ..errors import ProtocolError, ServerError
from ..protocol import Frame, unpack_items

__all__ = [
    "RECEIVED_AT",
    "ack_frame",
    "batch_items",
    "error_frame",
    "result_frames",
    "stamp_received",
]

#: Most values in one ``result`` frame.
_RESULT_CHUNK: Final = 1000


#: An ``items`` field larger than this is unpacked in a worker thread. A thread hop costs
#: about 0.1 ms: a fifth of unpacking a 1,000-item batch, under 1% of unpacking 1 MiB. (The
#: loop gains only while the unpacker lets go of the GIL: one ``msgpack.unpackb`` call holds it.)
_ITEMS_IN_THREAD_BYTES: Final = 1024 * 1024


async def batch_items(frame: Frame) -> tuple[Sequence[Any], frozenset[int]]:
    """The items of a ``batch`` frame, and the indexes of those that are deletes. An Arrow
    page (read and validated in full), and a large ``items`` field, are decoded in a worker
    thread, off the event loop; the caller's lane waits for it, so its order holds.

    Cancelling it leaves the worker to finish on its own; its result is dropped.

    Raises:
        ProtocolError: the frame's payload is malformed.
    """
    if "arrow" in frame or len(frame.get("items", b"")) > _ITEMS_IN_THREAD_BYTES:
        return await asyncio.to_thread(_decode_batch, frame)
    return _decode_batch(frame)


def _decode_batch(frame: Frame) -> tuple[Sequence[Any], frozenset[int]]:
    if ("items" in frame) == ("arrow" in frame):
        raise ProtocolError("a batch carries exactly one of 'items' and 'arrow'")
    if "arrow" in frame:
        if "del" in frame:
            raise ProtocolError("an Arrow page carries its deletes as a column")
        page = decode_page(frame["arrow"], frame["n"])
        items: Sequence[Any] = page
        deletes: Iterable[Any] = page.deletes
    else:
        items = unpack_items(frame["items"], frame["n"])
        deletes = frame.get("del") or ()
    # Checked before the set is made: a list or a map in 'del' is not hashable.
    if any(not isinstance(i, int) or not 0 <= i < len(items) for i in deletes):
        raise ProtocolError("'del' holds indexes outside the batch")
    return items, frozenset(deletes)


#: The key a node adds to a batch frame it took: when it read it (``time.monotonic()``). Set
#: over whatever a peer sent under it; no frame sent out carries it.
RECEIVED_AT: Final = "_received_at"


def stamp_received(frame: Frame) -> None:
    """Note in ``frame`` when the node read it (:data:`RECEIVED_AT`)."""
    frame[RECEIVED_AT] = time.monotonic()


def error_frame(err: ServerError, **where: Any) -> Frame:
    """``err`` as an ``error`` frame, with ``where`` (``sid``, ``p``, ``seq``) when not None.
    Its ``retriable`` is the error's own, which the client obeys."""
    frame: Frame = {
        "t": "error",
        "code": err.code,
        "msg": str(err.args[0]) if err.args else err.code,
        "node": err.node,
        "retriable": err.retriable,
    }
    if err.details:
        frame["details"] = dict(err.details)
    frame.update({k: v for k, v in where.items() if v is not None})
    return frame


def ack_frame(frame: Frame, *, dup: bool = False, failed: dict[int, str] | None = None) -> Frame:
    """The ack of batch ``frame``: applied and durable (``dup``: answered from an earlier run),
    with the items its receiver marked failed."""
    ack: Frame = {
        "t": "ack",
        "sid": frame["sid"],
        "p": frame["p"],
        "seq": frame["seq"],
        "n": frame["n"],
    }
    if dup:
        ack["dup"] = True
    if failed:
        ack["failed"] = [[i, failed[i]] for i in sorted(failed)]
    return ack


def result_frames(frame: Frame, values: list[Any]) -> Iterator[Frame]:
    """``values`` produced by batch ``frame``, in ``result`` frames of bounded size."""
    for i in range(0, len(values), _RESULT_CHUNK):
        yield {
            "t": "result",
            "sid": frame["sid"],
            "p": frame["p"],
            "seq": frame["seq"],
            "values": values[i : i + _RESULT_CHUNK],
        }
