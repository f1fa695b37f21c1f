"""The node's stream table: the streams open on it, each known by its id and its owner.

Stream ids are public (they name lanes in every Delta commit's marks, and show in logs and
dead-letter rows), so an id alone is never a credential. A stream's *owner* is a hash of the
secret key its ``open`` frame carried (:func:`stream_owner`): the same id and key again, on
any connection, is the same stream; the same id under another key is another stream, with
lanes and lane marks of its own. A connection reaches only the streams it opened (see
``connection.py``). See ``docs/guarantees.md``, "Streams belong to whoever opened them".
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ..errors import BadFrameError, OverloadedError, ReceiverError
from ..protocol import STREAM_ID
from ..receivers.base import Receiver
from ..receivers.registry import ReceiverRegistry
from .lanes import Lane

__all__ = [
    "MAX_STREAMS",
    "MAX_STREAM_KEY",
    "MIN_STREAM_KEY",
    "Stream",
    "StreamTable",
    "stream_owner",
]

#: The bytes an ``open`` frame's ``key`` may have (the client sends 32 random or derived ones).
MIN_STREAM_KEY: Final = 16
MAX_STREAM_KEY: Final = 64
#: Most streams open on a node at once (each holds a receiver and its lanes). At the bound a
#: new ``open`` makes the node forget the oldest idle stream no connection holds (a client
#: that comes back to it later starts its lanes from its ``base``); with none, it is answered
#: ``OVERLOADED`` until others close.
MAX_STREAMS: Final = 10_000


def stream_owner(key: bytes) -> str:
    """Who owns a stream opened with ``key``: 32 hex digits of its SHA-256. Public (it names
    the stream's lanes in Delta commits); finding another key with the same owner takes about
    2**128 tries."""
    return hashlib.sha256(key).hexdigest()[:32]


@dataclass(slots=True)
class Stream:
    """One stream on the node: its public id ``sid``, its ``owner``, its receiver and lanes."""

    sid: str
    owner: str
    receiver_name: str
    receiver: Receiver
    args: Any
    limit: asyncio.Semaphore | contextlib.nullcontext[None]
    lanes: dict[int, Lane] = field(default_factory=dict)
    holders: int = 0  # connections that opened it and are still open
    #: Its id was made up by the client (no ``stream_id=``): no other client can resend its
    #: batches, so its lanes' marks are needed only while its own client may (``tables.marks``).
    random: bool = False
    #: The tables a random id's batches wrote: its marks are forgotten there at its close.
    tables: set[str] = field(default_factory=set)

    def idle(self) -> bool:
        """No connection holds it and none of its lanes has a batch running or waiting."""
        return self.holders == 0 and not any(
            lane.task is not None or lane.pending or lane.committing for lane in self.lanes.values()
        )


class StreamTable:
    """The streams open on a node, by ``(id, owner)``; everything here is synchronous.

    Args:
        node_id: this node's id (in every error it reports).
        registry: the receiver allow-list.
        concurrency: receiver name -> the most ``receive`` calls of it running at once,
            overriding the class's ``max_concurrency``.
    """

    def __init__(
        self, *, node_id: str, registry: ReceiverRegistry, concurrency: Mapping[str, int]
    ) -> None:
        self._node_id = node_id
        self.registry = registry
        self._concurrency = dict(concurrency)
        self._limits: dict[str, asyncio.Semaphore] = {}
        self._streams: dict[tuple[str, str], Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[Stream]:
        return iter(self._streams.values())

    def get(self, sid: str, owner: str | None) -> Stream | None:
        """Stream ``sid`` of ``owner`` (None: the asker opened no such stream)."""
        return self._streams.get((sid, owner)) if owner is not None else None

    def open(self, sid: str, receiver: str, args: Any, key: bytes, random: bool = False) -> Stream:
        """Stream ``sid`` opened with ``key``: the one already open (it keeps its lanes), or a
        new one (``random``: its id was made up by the client).

        Raises:
            BadFrameError: the id or the key is not allowed, or this stream is open with
                another receiver.
            UnknownReceiverError: ``receiver`` is not on the allow-list.
            ReceiverError: the receiver could not be created.
        """
        if not STREAM_ID.fullmatch(sid):
            raise BadFrameError(
                f"stream id {sid[:64]!r} is not allowed: use 1 to 160 characters of "
                "A-Z a-z 0-9 . _ : -",
                node=self._node_id,
            )
        if not MIN_STREAM_KEY <= len(key) <= MAX_STREAM_KEY:
            raise BadFrameError(
                f"stream {sid!r} was opened with a key of {len(key)} bytes; a stream key has "
                f"{MIN_STREAM_KEY} to {MAX_STREAM_KEY} bytes (the deltaflow client sends 32)",
                node=self._node_id,
            )
        owner = stream_owner(key)
        stream = self._streams.get((sid, owner))
        if stream is not None:
            if stream.receiver_name != receiver:
                raise BadFrameError(
                    f"stream {sid!r} was opened with receiver {stream.receiver_name!r}, not "
                    f"{receiver[:128]!r}",
                    node=self._node_id,
                )
            return stream
        if len(self._streams) >= MAX_STREAMS:
            oldest = next((s for s in self._streams.values() if s.idle()), None)
            if oldest is not None:
                self.forget(oldest)
        if len(self._streams) >= MAX_STREAMS:
            raise OverloadedError(
                f"this node has {len(self._streams)} streams open, its most; stream {sid!r} "
                "can open once others close (clients close each stream they finish)",
                node=self._node_id,
            )
        cls = self.registry.get(receiver, node=self._node_id)
        try:
            instance = cls()
        except Exception as exc:
            raise ReceiverError(
                f"receiver {receiver} could not be created: {type(exc).__name__}: {exc}",
                node=self._node_id,
            ) from exc
        stream = Stream(
            sid, owner, receiver, instance, args, self._limit(receiver, cls), random=random
        )
        self._streams[sid, owner] = stream
        return stream

    def hold(self, sid: str, owner: str) -> None:
        """A connection opened stream ``sid`` of ``owner``: it is not forgotten at the bound
        while that connection is open."""
        stream = self._streams.get((sid, owner))
        if stream is not None:
            stream.holders += 1

    def release(self, sid: str, owner: str) -> None:
        """A connection that held stream ``sid`` of ``owner`` is gone."""
        stream = self._streams.get((sid, owner))
        if stream is not None:
            stream.holders = max(stream.holders - 1, 0)

    def forget(self, stream: Stream) -> None:
        self._streams.pop((stream.sid, stream.owner), None)

    def _limit(
        self, name: str, cls: type[Receiver]
    ) -> asyncio.Semaphore | contextlib.nullcontext[None]:
        """The bound on concurrent ``receive`` calls of one receiver class on this node."""
        bound = self._concurrency.get(name, cls.max_concurrency)
        if bound is None:
            return contextlib.nullcontext()
        if name not in self._limits:
            self._limits[name] = asyncio.Semaphore(bound)
        return self._limits[name]
