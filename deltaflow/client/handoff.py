"""Ownership handoff: which node a partition's sends are under way to, so that the batches of
one partition are never out at two nodes at once.

A send *claims* its partition at a node before it goes out. Sends to the node that holds the
claim go at once; a send to another node waits until every send to the holder has ended, as
the new owner would otherwise wait for a batch the old one is still applying (see
``docs/cluster.md``, "NOT_OWNER redirects"). Everything here but :meth:`Handoff.changed` is
synchronous (atomic on the event loop).
"""

from __future__ import annotations

import asyncio

__all__ = ["Handoff"]


class Handoff:
    """The claims of one stream's partitions: per partition, the node its sends are under way
    to and the sequence numbers of those sends.

    A claim ends when its batch is settled (after the sender forgot it) or when its resend is
    decided, never as soon as the answer arrives: a send that waited for the claim computes its
    ``base`` after that, so a new owner is never told to wait for a batch the old one acked.
    """

    def __init__(self) -> None:
        self._out: dict[int, tuple[str, set[int]]] = {}
        self._changed: dict[int, asyncio.Event] = {}  # per partition, while sends wait on it

    def try_claim(self, partition: int, seq: int, node: str) -> bool:
        """Claim ``partition`` at ``node`` for the send of batch ``seq``, unless sends of the
        partition to another node are under way."""
        out = self._out.get(partition)
        if out is None or not out[1]:
            self._out[partition] = (node, {seq})
        elif out[0] == node:
            out[1].add(seq)
        else:
            return False
        self._wake(partition)  # a waiter may now go where this batch went (``waits_for``)
        return True

    def release(self, partition: int, seq: int) -> None:
        """End the claim of batch ``seq``'s send (a no-op if it holds none)."""
        out = self._out.get(partition)
        if out is not None and seq in out[1]:
            out[1].discard(seq)
            self._wake(partition)

    def waits_for(self, partition: int, seq: int) -> str | None:
        """The node where sends of batches after ``seq`` are under way, if any. That node may
        have taken them, and then it waits for ``seq``: ``seq`` goes there too, whatever the
        map says, or both wait for an ack timeout."""
        out = self._out.get(partition)
        if out is not None and any(later > seq for later in out[1]):
            return out[0]
        return None

    async def changed(self, partition: int) -> None:
        """Wait until a claim of ``partition`` was taken or ended."""
        event = self._changed.get(partition)
        if event is None:
            event = self._changed[partition] = asyncio.Event()
        await event.wait()

    def _wake(self, partition: int) -> None:
        event = self._changed.pop(partition, None)
        if event is not None:  # every send waiting on the partition checks it again
            event.set()
