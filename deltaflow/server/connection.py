"""One client WebSocket on a node: handshake, then frames to the dispatcher.

A connection that breaks the protocol (malformed or oversize frame, bad handshake) gets an
``error`` frame saying what and is closed; other connections and their streams are untouched.
Before its hello passes, a connection costs the node little: the hello is read within
:data:`HELLO_TIMEOUT`, at most :data:`~deltaflow.protocol.MAX_HELLO_BYTES` of it are decoded,
its token is checked before anything else in it, and at most :data:`MAX_UNAUTHENTICATED` such
connections wait at once.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable
from typing import Any, Final, NoReturn, Protocol

import aiohttp
from aiohttp import web

from ..errors import (
    AuthenticationError,
    BadFrameError,
    FrameTooLargeError,
    FrameTooLargeServerError,
    OverloadedError,
    ProtocolError,
    ServerError,
    UnknownReceiverError,
    UnsupportedVersionError,
)
from ..logs import event
from ..outbox import Outbox
from ..partitioning import PartitionMap
from ..protocol import (
    CAPABILITIES,
    CLIENT_ID,
    MAX_CLIENT_ID,
    SUPPORTED_VERSIONS,
    Frame,
    decode_frames,
    decode_hello,
    encode_frame,
    truncated_repr,
)
from .dispatcher import Dispatcher
from .frames import error_frame

__all__ = [
    "HELLO_TIMEOUT",
    "MAX_UNAUTHENTICATED",
    "MAX_UNAUTHENTICATED_PER_ADDRESS",
    "ClientConnection",
    "NodeView",
    "unauthenticated",
]

log = logging.getLogger(__name__)

#: Seconds a node waits for the hello after the upgrade (a client sends it at once).
HELLO_TIMEOUT: Final = 5.0
#: Connections of a node that upgraded but whose hello has not passed yet: a new one beyond
#: these is refused at once (``OVERLOADED``). Each may hold one message of up to the frame
#: limit, which aiohttp reads whole before the node sees it, for at most HELLO_TIMEOUT.
MAX_UNAUTHENTICATED: Final = 16
#: Of those, most from one remote address: one stranger cannot fill the node's handshake slots
#: and lock every client out.
MAX_UNAUTHENTICATED_PER_ADDRESS: Final = 4


class NodeView(Protocol):
    """What a connection sees of its node (``Node`` is one)."""

    @property
    def node_id(self) -> str: ...

    @property
    def max_frame_bytes(self) -> int:
        """Largest frame (and, with ``multi``, message) the node takes or sends."""
        ...

    @property
    def partition_map(self) -> PartitionMap:
        """The node's current map, sent in the ``welcome`` frame."""
        ...

    @property
    def dispatcher(self) -> Dispatcher:
        """Where the connection hands ``open``, ``batch`` and ``close`` frames."""
        ...

    def check_token(self, given: str | None) -> bool:
        """Whether ``given`` (the hello's token, if any) is the cluster's."""
        ...


class ClientConnection:
    """Serves one WebSocket; ``send`` is what the dispatcher answers through."""

    def __init__(self, node: NodeView, ws: web.WebSocketResponse, remote: str) -> None:
        self._node = node
        self._ws = ws
        self._remote = remote
        self.client_id = "?"  # the hello's, once it passed the check
        self.authenticated = False  # its hello passed: token, client id and version
        self._caps: list[str] = []  # the capabilities both sides listed, from the hello
        self._opened: dict[str, str] = {}  # stream id -> its owner, for streams opened here
        # Until the hello says otherwise, one frame per message.
        self._outbox = Outbox(self._write, multi=False, on_error=self._write_failed)

    async def send(self, frame: Frame) -> None:
        """Queue a frame; silently dropped when the connection is gone (the client resends)."""
        if self._ws.closed:
            return
        await self._outbox.send(encode_frame(frame))

    def send_nowait(self, frame: Frame) -> bool:
        """Queue a frame without waiting, unless the outbox is above its high-water mark (then
        False: use :meth:`send`). Frames queued in one loop turn go out as one message."""
        if self._ws.closed:
            return True  # dropped, as by send
        if not self._outbox.has_room:
            return False
        self._outbox.send_nowait(encode_frame(frame))
        return True

    def push_map(self, wire: dict[str, object]) -> None:
        """Tell the client the partition map changed (a ``map`` frame), if it takes them."""
        if "maps" in self._caps:
            self.send_nowait({"t": "map", "map": wire})

    async def flush(self) -> None:
        """Wait until every frame queued so far was written (or the connection failed)."""
        await self._outbox.drain()

    async def _write(self, data: bytes) -> None:
        if not self._ws.closed:
            await self._ws.send_bytes(data)

    def _write_failed(self, exc: BaseException) -> None:
        # The client sees the connection drop and resends what was not acknowledged.
        log.info("sending to %s (client %s) failed: %r", self._remote, self.client_id, exc)

    @property
    def remote(self) -> str:
        """The address the connection comes from."""
        return self._remote

    async def serve(self, *, unauthenticated: int = 0, from_remote: int = 0) -> None:
        """Serve the connection until it closes.

        Args:
            unauthenticated: how many other connections of the node have not passed their
                hello yet; at :data:`MAX_UNAUTHENTICATED` this one is refused at once.
            from_remote: how many of those come from this connection's address; at
                :data:`MAX_UNAUTHENTICATED_PER_ADDRESS` this one is refused at once.
        """
        node_id = self._node.node_id
        if unauthenticated >= MAX_UNAUTHENTICATED or from_remote >= MAX_UNAUTHENTICATED_PER_ADDRESS:
            await self._abort(
                OverloadedError(
                    f"{unauthenticated} connections to this node ({from_remote} from this "
                    f"address) are still in their handshake (at most {MAX_UNAUTHENTICATED}, "
                    f"{MAX_UNAUTHENTICATED_PER_ADDRESS} from one address); connect again later",
                    node=node_id,
                ),
                aiohttp.WSCloseCode.TRY_AGAIN_LATER,
            )
            return
        try:
            await self._handshake()
            while True:
                msg = await self._ws.receive()
                if msg.type == aiohttp.WSMsgType.BINARY:
                    for frame in decode_frames(msg.data, max_bytes=self._node.max_frame_bytes):
                        await self._handle(frame)
                elif msg.type in (
                    aiohttp.WSMsgType.CLOSE,
                    aiohttp.WSMsgType.CLOSING,
                    aiohttp.WSMsgType.CLOSED,
                ):
                    return
                else:
                    self._reject(msg)
        except FrameTooLargeError as exc:
            await self._abort(
                FrameTooLargeServerError(str(exc), node=node_id),
                aiohttp.WSCloseCode.MESSAGE_TOO_BIG,
            )
        except ProtocolError as exc:
            await self._abort(
                BadFrameError(f"{exc}; closing the connection", node=node_id),
                aiohttp.WSCloseCode.PROTOCOL_ERROR,
            )
        except ServerError as exc:  # handshake refusals
            exc.node = exc.node or node_id
            await self._abort(exc, aiohttp.WSCloseCode.POLICY_VIOLATION)

    def _reject(self, msg: aiohttp.WSMessage) -> NoReturn:
        """Raise what a message that is neither binary nor a close means."""
        if msg.type == aiohttp.WSMsgType.ERROR:
            exc = self._ws.exception()
            if isinstance(exc, aiohttp.WebSocketError) and (
                exc.code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
            ):
                raise FrameTooLargeError(
                    f"frame exceeds this node's limit of {self._node.max_frame_bytes} "
                    "bytes; lower StreamerOptions.max_batch_bytes"
                )
            raise ProtocolError(f"WebSocket error: {truncated_repr(str(exc))}")
        raise ProtocolError(f"{msg.type.name} messages are not allowed; send binary")

    def _refused(self, err: ServerError, **where: Any) -> None:
        self._node.dispatcher.stats.count_error(err.code, str(err))
        event(log, "refusal", f"refused client {self.client_id} at {self._remote}: {err}",
              level=logging.WARNING, code=err.code, reason=str(err)[:500],
              client=self.client_id, remote=self._remote, **where)  # fmt: skip

    async def _abort(self, err: ServerError, code: int) -> None:
        self._refused(err, closed=True)
        await self.send(error_frame(err))
        await self._outbox.drain()
        await self._ws.close(code=code, message=err.code.encode())

    async def _handshake(self) -> None:
        # Checked in order of cost to a stranger: size before decoding, the token before
        # anything else in the hello, and only then what the client says about itself.
        try:
            msg = await self._ws.receive(timeout=HELLO_TIMEOUT)
        except TimeoutError:
            raise ProtocolError(f"no hello within {HELLO_TIMEOUT}s") from None
        if msg.type != aiohttp.WSMsgType.BINARY:
            raise ProtocolError("expected a binary hello frame")
        hello = decode_hello(msg.data)
        if not self._node.check_token(hello.get("token")):
            raise AuthenticationError(
                "wrong or missing token; pass the cluster token to deltaflow.connect(token=...)"
            )
        if not CLIENT_ID.fullmatch(hello["client"]):
            raise ProtocolError(
                f"client id {truncated_repr(hello['client'])} is not allowed: 1 to "
                f"{MAX_CLIENT_ID} of A-Z a-z 0-9 . _ : @ / -"
            )
        self.client_id = hello["client"]
        # type(): True == 1, and a version is an int, not a bool
        versions = [v for v in hello["v"] if type(v) is int and v in SUPPORTED_VERSIONS]
        if not versions:
            raise UnsupportedVersionError(
                f"client speaks protocol versions {truncated_repr(hello['v'])}, "
                f"this node {list(SUPPORTED_VERSIONS)}; upgrade the older side"
            )
        caps = [c for c in hello["caps"] if c in CAPABILITIES]
        self._caps = caps
        if "multi" in caps:
            # The client checks each message against this node's limit (welcome's ``max``).
            self._outbox = Outbox(
                self._write,
                multi=True,
                on_error=self._write_failed,
                limit=self._node.max_frame_bytes,
            )
        self.authenticated = True
        await self.send(
            {
                "t": "welcome",
                "v": max(versions),
                "caps": caps,
                "node": self._node.node_id,
                "map": self._node.partition_map.to_wire(),
                "max": self._node.max_frame_bytes,
            }
        )

    async def _handle(self, frame: Frame) -> None:
        # A stream is fed and closed only through connections that opened it, as its owner
        # (the hash of the key they presented): its id alone, which is public, is not enough.
        dispatcher = self._node.dispatcher
        ftype = frame["t"]
        if ftype == "batch":
            dispatcher.submit(self, frame, self._opened.get(frame["sid"]))
        elif ftype == "open":
            sid = frame["sid"]
            try:
                owner = dispatcher.open(sid, frame["receiver"], frame.get("args"), frame["key"])
            except (UnknownReceiverError, ServerError) as err:
                self._refused(err, stream=sid[:160])
                await self.send(error_frame(err, sid=sid[:160]))  # a refused id may be long
            else:
                args = frame.get("args")
                table = args.get("table") if isinstance(args, dict) else None
                event(log, "stream.opened", f"stream {sid} opened by client {self.client_id}",
                      client=self.client_id, remote=self._remote, stream=sid,
                      receiver=str(frame["receiver"])[:200],
                      table=str(table)[:200] if table is not None else None)  # fmt: skip
                before = self._opened.get(sid)
                if before != owner:
                    if before is not None:
                        dispatcher.streams.release(sid, before)
                    dispatcher.streams.hold(sid, owner)
                self._opened[sid] = owner
                await self.send({"t": "opened", "sid": sid})
        elif ftype == "close":
            opener = self._opened.pop(frame["sid"], None)
            if opener is None:
                sid = frame["sid"][:160]  # echoed: no longer than a valid id
                await self.send(error_frame(dispatcher.not_open(sid), sid=sid))
            else:
                dispatcher.close(frame["sid"], opener)
                event(log, "stream.closed", f"stream {frame['sid']} closed by client "
                      f"{self.client_id}", client=self.client_id, remote=self._remote,
                      stream=frame["sid"])  # fmt: skip
        else:
            raise ProtocolError(f"a client may not send {ftype!r} frames")

    def release_streams(self) -> None:
        """The connection is gone: the streams it opened are no longer held by it."""
        streams = self._node.dispatcher.streams
        for sid, owner in self._opened.items():
            streams.release(sid, owner)
        self._opened.clear()


def token_matches(expected: str | None, given: str | None) -> bool:
    if expected is None:
        return True
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


def unauthenticated(connections: Iterable[ClientConnection]) -> int:
    """How many of ``connections`` have not passed their hello yet."""
    return sum(not conn.authenticated for conn in connections)
