"""One ``receive`` call on a batch, whatever shape its output takes, sent on as ``result``
frames while it is kept for a resend; and what the client is told when a batch fails."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast

from ..errors import DeltaflowError, ReceiverError, ServerError
from ..protocol import Frame
from ..receivers.base import Receiver, ReceiverContext
from .frames import result_frames
from .lanes import Peer

__all__ = ["call_receiver", "receiver_error", "unexpected_error"]

log = logging.getLogger(__name__)


async def call_receiver(
    receiver: Receiver,
    items: Sequence[Any],
    ctx: ReceiverContext,
    produced: list[Any],
    peer: Peer,
    frame: Frame,
) -> None:
    """Run ``receiver.receive(items, ctx)``: a plain function, a coroutine or an async
    generator. Each value it yields or returns is appended to ``produced`` and sent to ``peer``.

    Raises:
        Exception: whatever the receiver raised; TypeError if it returned neither None nor an
            iterable.
    """
    out = receiver.receive(items, ctx)
    if inspect.isasyncgen(out):
        async for value in out:
            produced.append(value)
            for result in result_frames(frame, [value]):
                await peer.send(result)
        return
    values = await out if inspect.isawaitable(out) else out
    if values is not None:
        # Async generators went the other way; anything else must be a plain iterable
        # (else list() raises TypeError: the batch fails as a ReceiverError).
        values = list(cast("Iterable[Any]", values))
        produced.extend(values)
        for result in result_frames(frame, values):
            await peer.send(result)


def receiver_error(
    exc: Exception, receiver: str, sid: str, p: int, seq: int, n: int, node: str
) -> ServerError:
    """What the client is told when a receiver raised ``exc`` on batch ``seq`` of stream
    ``sid``'s partition ``p``, of ``n`` items."""
    if isinstance(exc, DeltaflowError):  # keeps the error's own retry decision
        return ServerError(str(exc), node=node, retriable=exc.retriable)
    log.warning(
        "receiver %s failed on stream %s partition %d batch %d: %r", receiver, sid, p, seq, exc
    )
    return ReceiverError(
        f"receiver {receiver} raised {type(exc).__name__}: {exc} "
        f"(partition {p}, batch {seq}, {n} items)",
        node=node,
    )


def unexpected_error(exc: Exception, where: str, node: str) -> ServerError:
    """``exc`` as the answer to a batch: itself if a node error, else an internal error (a bug
    in the node, logged with its traceback) that the client may retry."""
    if isinstance(exc, ServerError):
        return exc
    log.error("node %s failed on %s", node, where, exc_info=exc)
    return ServerError(
        f"node {node} failed on {where} with {type(exc).__name__}: {exc} (a bug in the node, "
        "logged there with its traceback; the batch was not applied)",
        node=node,
    )
