"""One client WebSocket on a node: handshake, then frames to the dispatcher.

A connection that breaks the protocol (malformed or oversize frame, bad handshake) gets an
``error`` frame saying what and is closed; other connections and their streams are untouched.

A client holding the token proves it in the upgrade request (``Authorization: Bearer``), and
its connection is read as any other from the start. A stranger's (no token in the upgrade)
costs the node little until its hello passes: beyond :data:`MAX_UNAUTHENTICATED` such
connections (:data:`MAX_UNAUTHENTICATED_PER_ADDRESS` from one address) it is refused before
the upgrade (HTTP 503), it may send at most :data:`FIRST_MESSAGE_BYTES` before its hello
passes, the hello is read within :data:`HELLO_TIMEOUT`, and its token is checked before
anything else in it. A wrong token in the upgrade request is refused before the upgrade (401).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Iterable, MutableSet
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
    MAX_HELLO_BYTES,
    SUPPORTED_VERSIONS,
    Frame,
    decode_frames,
    decode_hello,
    encode_frame,
    truncated_repr,
)
from .dispatcher import Dispatcher
from .frames import error_frame
from .listening import connection_guard
from .node_config import NodeConfig

__all__ = [
    "FIRST_MESSAGE_BYTES",
    "HELLO_TIMEOUT",
    "MAX_UNAUTHENTICATED",
    "MAX_UNAUTHENTICATED_PER_ADDRESS",
    "STRANGER_CLOSE_TIMEOUT",
    "ClientConnection",
    "NodeView",
    "ReadLimit",
    "handshake_refusal",
    "serve_websocket",
    "unauthenticated",
    "upgrade_proof",
]

log = logging.getLogger(__name__)

#: Seconds a node waits for the hello after the upgrade (a client sends it at once).
HELLO_TIMEOUT: Final = 5.0
#: Strangers' connections of a node (no token in the upgrade request) whose hello has not
#: passed yet: a new one beyond these is refused before its upgrade (HTTP 503, OVERLOADED).
MAX_UNAUTHENTICATED: Final = 16
#: Of those, most from one remote address: one stranger cannot take every handshake slot.
MAX_UNAUTHENTICATED_PER_ADDRESS: Final = 4
#: Bytes a stranger's connection may send after its upgrade until its hello passes: the
#: hello, its frame header and a control frame or two. Past them the node reads no more of
#: it and refuses it (FRAME_TOO_LARGE).
FIRST_MESSAGE_BYTES: Final = MAX_HELLO_BYTES + 1024
#: Seconds a refused stranger's connection is given to answer the node's close.
STRANGER_CLOSE_TIMEOUT: Final = 2.0


class NodeView(Protocol):
    """What a connection sees of its node (``Node`` is one)."""

    @property
    def node_id(self) -> str: ...

    @property
    def config(self) -> NodeConfig:
        """Its settings: the secrets an upgrade request may prove."""
        ...

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


class ReadLimit(Protocol):
    """A cap on what a connection may send (its listener's guard is one)."""

    def limit_reading(self, budget: int, on_exceeded: Callable[[], None]) -> None:
        """Take at most ``budget`` more bytes; past them drop the rest and call
        ``on_exceeded``."""
        ...

    def lift_reading_limit(self) -> None: ...


class ClientConnection:
    """Serves one WebSocket; ``send`` is what the dispatcher answers through.

    ``proven``: the upgrade request proved the token (or a client certificate did), so the
    connection is no stranger's. ``read_limit``: where a stranger's first message is capped
    (its connection's guard; None: uncapped).
    """

    def __init__(
        self,
        node: NodeView,
        ws: web.WebSocketResponse,
        remote: str,
        *,
        proven: bool = False,
        read_limit: ReadLimit | None = None,
    ) -> None:
        self._node = node
        self._ws = ws
        self._remote = remote
        self.proven = proven
        self._read_limit = None if proven else read_limit
        self._overrun = False  # it sent more than FIRST_MESSAGE_BYTES before its hello passed
        self._refusing = False  # refused: closing, still held to what it may send
        self._hello_deadline: asyncio.Timeout | None = None
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

    @property
    def stranger(self) -> bool:
        """Neither its upgrade nor its hello has proven anything yet, and it is not refused
        yet: what the handshake caps count (a refused one may send no more than its first
        message's limit, while the node waits for its close)."""
        return not (self.proven or self.authenticated or self._refusing)

    def refuse_upgrade(self, err: ServerError, status: int) -> web.Response:
        """The answer that refuses the upgrade (before anything of the connection is read):
        ``status`` with the error as JSON, and the connection closed after it."""
        err.node = err.node or self._node.node_id
        self._refused(err, closed=True)
        response = web.json_response(
            {"error": str(err), "code": err.code, "retriable": err.retriable},
            status=status,
            headers={"Retry-After": "1"} if err.retriable else None,
        )
        response.force_close()  # what follows a refused upgrade is no HTTP request
        return response

    def _first_message_overrun(self) -> None:
        self._overrun = True
        if self._hello_deadline is not None:
            self._hello_deadline.reschedule(-1.0)  # the wait for the hello ends now

    async def serve(self, request: web.Request) -> None:
        """Upgrade ``request`` and serve the connection until it closes."""
        node_id = self._node.node_id
        if self._read_limit is not None:  # before the upgrade: nothing of it is read yet
            self._read_limit.limit_reading(FIRST_MESSAGE_BYTES, self._first_message_overrun)
        try:
            await self._ws.prepare(request)
        except BaseException:  # no upgrade (a 400): the connection may carry other requests
            if self._read_limit is not None:
                self._read_limit.lift_reading_limit()
            raise
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
        self._refusing = True
        self._refused(err, closed=True)
        await self.send(error_frame(err))
        await self._outbox.drain()
        await self._ws.close(code=code, message=err.code.encode())

    async def _handshake(self) -> None:
        # Checked in order of cost to a stranger: size before decoding, the token before
        # anything else in the hello, and only then what the client says about itself.
        msg = None
        if not self._overrun:
            try:
                async with asyncio.timeout(HELLO_TIMEOUT) as self._hello_deadline:
                    msg = await self._ws.receive()
            except TimeoutError:
                if not self._overrun:
                    raise ProtocolError(f"no hello within {HELLO_TIMEOUT}s") from None
            finally:
                self._hello_deadline = None
        if self._overrun or msg is None:
            raise FrameTooLargeError(
                f"more than {FIRST_MESSAGE_BYTES} bytes before the hello passed: that exceeds "
                f"the limit of {MAX_HELLO_BYTES} bytes for a hello; send only the versions, "
                "capabilities, client id and token, and wait for welcome"
            )
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
        if self._read_limit is not None:
            self._read_limit.lift_reading_limit()
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
                owner = dispatcher.open(
                    sid, frame["receiver"], frame.get("args"), frame["key"],
                    frame.get("random", False),
                )  # fmt: skip
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
    """How many of ``connections`` are strangers' (see :attr:`ClientConnection.stranger`)."""
    return sum(conn.stranger for conn in connections)


def handshake_refusal(
    connections: Iterable[ClientConnection], remote: str, node: str
) -> OverloadedError | None:
    """Why a new stranger's connection from ``remote`` is refused before its upgrade (the
    node's ``connections`` hold the most strangers, or the most from ``remote``), or None."""
    strangers = [c for c in connections if c.stranger]
    waiting = len(strangers)
    from_remote = sum(c.remote == remote for c in strangers)
    if waiting >= MAX_UNAUTHENTICATED or from_remote >= MAX_UNAUTHENTICATED_PER_ADDRESS:
        return OverloadedError(
            f"{waiting} connections to this node ({from_remote} from this address) are "
            f"still in their handshake without a token in the upgrade request (at most "
            f"{MAX_UNAUTHENTICATED}, {MAX_UNAUTHENTICATED_PER_ADDRESS} from one address); "
            "connect again later, or send the token in the upgrade (deltaflow clients do)",
            node=node,
        )
    return None


def upgrade_proof(request: web.Request, config: NodeConfig) -> bool | None:
    """What a WebSocket upgrade request proves: True, the client token or the peer token
    (``Authorization: Bearer``), or a client certificate under mutual TLS where no client token
    is set; False, a wrong token where clients need one; None, nothing (a stranger's, read as
    one until its hello passes; a node without a client token ignores the header)."""
    header = request.headers.get("Authorization")
    if header is not None:
        given = header.removeprefix("Bearer ") if header.startswith("Bearer ") else None
        secrets = [s for s in (config.token, config.peer_token) if s is not None]
        if given is not None and any(token_matches(s, given) for s in secrets):
            return True
        if config.token is not None:
            return False
    if config.token is None and config.tls is not None and config.tls.client_auth:
        return True  # the TLS handshake checked its certificate
    return None


async def serve_websocket(
    node: NodeView,
    request: web.Request,
    connections: MutableSet[ClientConnection],
    websockets: MutableSet[web.WebSocketResponse],
) -> web.StreamResponse:
    """Serve ``GET /v1/stream``: refuse it before the upgrade (a wrong token: 401; a stranger
    past the handshake caps: 503), or upgrade it and serve the connection, held in
    ``connections`` and ``websockets`` (the node's) until it closes."""
    proof = upgrade_proof(request, node.config)
    # No permessage-deflate: msgpack frames compress little for the CPU it costs.
    ws = web.WebSocketResponse(
        max_msg_size=node.max_frame_bytes,
        heartbeat=30.0,
        compress=False,
        timeout=10.0 if proof else STRANGER_CLOSE_TIMEOUT,  # waiting for the client's close
    )
    conn = ClientConnection(
        node, ws, request.remote or "?", proven=proof is True,
        read_limit=connection_guard(request),
    )  # fmt: skip
    # Refused before the upgrade: nothing of the connection is read.
    if proof is False:
        return conn.refuse_upgrade(AuthenticationError(
            "wrong token in the upgrade request (Authorization: Bearer); pass the cluster "
            "token to deltaflow.connect(token=...)"), 401)  # fmt: skip
    refusal = conn.stranger and handshake_refusal(connections, conn.remote, node.node_id)
    if refusal:
        return conn.refuse_upgrade(refusal, 503)
    # Counted and joined in one loop turn.
    connections.add(conn)
    websockets.add(ws)
    try:
        await conn.serve(request)
    finally:
        conn.release_streams()
        connections.discard(conn)
        websockets.discard(ws)
        if ws.prepared and not ws.closed:
            await ws.close()
    return ws
