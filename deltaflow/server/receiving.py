"""One ``receive`` call on a batch, whatever shape its output takes, sent on as ``result``
frames while it is kept for a resend."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any, cast

from ..protocol import Frame
from ..receivers.base import Receiver, ReceiverContext
from .frames import result_frames
from .lanes import Peer

__all__ = ["call_receiver"]


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
