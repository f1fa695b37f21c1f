"""One WebSocket connection from a client to a node, multiplexing many streams.

The connection owns a reader task that routes each incoming frame: acks and errors resolve the
future of the batch they name, results go to the stream's result sink, and a connection-level
error or a drop fails every pending future (nothing waits forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp

from ..errors import (
    AuthenticationError,
    ConnectionLostError,
    DeltaflowError,
    FrameTooLargeError,
    NodeUnavailableError,
    OverloadedError,
    ProtocolError,
    ServerError,
    TransportError,
    UnknownStreamError,
    server_error,
)
from ..outbox import Outbox
from ..protocol import (
    CAPABILITIES,
    DEFAULT_MAX_FRAME_BYTES,
    SUPPORTED_VERSIONS,
    WS_PATH,
    Frame,
    decode_frames,
    encode_frame,
)
from ..security import connect_failure, diagnose, tls_failure, url

__all__ = ["Connection", "ResultSink", "explain_dropped", "map_transport_errors"]

log = logging.getLogger(__name__)

ResultSink = Callable[[list[Any]], Awaitable[None]]
BatchKey = tuple[str, int, int]
#: A batch waiting for its answer: the future the answer resolves, and its ack deadline.
_Waiter = tuple["asyncio.Future[Frame]", asyncio.TimerHandle]
#: How long ``Connection.close`` lets queued frames go out before it closes anyway.
_CLOSE_DRAIN_SECONDS = 5.0


@contextlib.contextmanager
def map_transport_errors(address: str, tls: ssl.SSLContext | None = None) -> Iterator[None]:
    """Translate aiohttp/OS errors at the transport boundary into deltaflow errors (a TLS
    problem into a :class:`TlsError` that says what to change)."""
    try:
        yield
    except DeltaflowError:
        raise
    except (aiohttp.ClientError, OSError) as exc:
        raise _transport_error(address, exc, tls) from exc


def _transport_error(
    address: str, exc: BaseException, tls: ssl.SSLContext | None
) -> DeltaflowError:
    failure = tls_failure(address, exc, tls)
    if failure is not None:
        return failure
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return NodeUnavailableError(f"cannot connect to node at {address}: {connect_failure(exc)}")
    if isinstance(exc, aiohttp.WSServerHandshakeError) and exc.status == 401:
        return AuthenticationError(
            f"node at {address} rejected the token in the WebSocket upgrade; pass the token "
            "from the node's --token-file to deltaflow.connect(token=...)"
        )
    if isinstance(exc, aiohttp.WSServerHandshakeError) and exc.status == 503:
        return OverloadedError(
            f"node at {address} refused the WebSocket upgrade for now (HTTP 503: at its "
            "connection or handshake cap); retried"
        )
    if isinstance(exc, aiohttp.WSServerHandshakeError):
        return NodeUnavailableError(
            f"node at {address} refused the WebSocket upgrade ({exc.status}); is it a deltaflow "
            "node?"
        )
    return ConnectionLostError(f"connection to node at {address} failed: {exc}")


async def explain_dropped(address: str, error: TransportError, tls: ssl.SSLContext | None) -> None:
    """After a request to ``address`` dropped (``error``): raise :class:`TlsError` if TLS is
    why (see :func:`deltaflow.security.diagnose`). Only a connection the node closed or reset
    is looked into: a timeout (a slow or stopped node) is not a TLS mismatch, and probing it
    would only add to the wait."""
    if isinstance(error, ConnectionLostError) and not isinstance(error.__cause__, TimeoutError):
        failure = await diagnose(address, tls)
        if failure is not None:
            raise failure from error


class Connection:
    """A handshaken WebSocket to one node.

    Use :meth:`open` to create one. ``node_id``, ``partition_map`` (wire form) and
    ``max_frame_bytes`` come from the node's ``welcome``.
    """

    def __init__(
        self,
        address: str,
        session: aiohttp.ClientSession,
        ws: aiohttp.ClientWebSocketResponse,
        welcome: Frame,
    ) -> None:
        self.address = address
        self.node_id: str = welcome["node"]
        self.partition_map: dict[str, Any] = welcome["map"]
        self.max_frame_bytes: int = welcome["max"]
        self._session = session
        self._ws = ws
        self._pending: dict[BatchKey, _Waiter] = {}
        self._opening: dict[str, asyncio.Future[None]] = {}
        self._result_sinks: dict[str, ResultSink] = {}
        #: Called with the map of a ``map`` frame (set by whoever routes with this connection).
        self.on_map: Callable[[Any], None] | None = None
        self._error: DeltaflowError | None = None
        self._outbox = Outbox(
            self._write,
            multi="multi" in welcome["caps"],
            on_error=self._write_failed,
            limit=self.max_frame_bytes,  # a joined message is one the node must accept
        )
        self._reader = asyncio.create_task(self._read_loop(), name=f"deltaflow-reader-{address}")

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"<Connection {state} node={self.node_id} address={self.address} "
            f"pending={len(self._pending)}>"
        )

    @classmethod
    async def open(
        cls,
        address: str,
        *,
        token: str | None,
        client_id: str,
        timeout: float = 10.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        tls: ssl.SSLContext | None = None,
    ) -> Connection:
        """Connect and handshake (over TLS when ``tls`` is given). The token travels in the
        upgrade request (``Authorization: Bearer``: the node checks it before it reads
        anything of the connection) and again in the hello.

        Raises:
            NodeUnavailableError: the node cannot be reached.
            AuthenticationError: the node rejected ``token``.
            TlsError: TLS failed (an untrusted certificate, a missing client certificate, or
                TLS on one side only).
            ServerError: the node refused the handshake (e.g. unsupported version).
        """
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=timeout))
        # A proven upgrade is no stranger's: never held to the node's handshake caps.
        headers = {"Authorization": f"Bearer {token}"} if token is not None else None
        try:
            with map_transport_errors(address, tls):
                ws = await session.ws_connect(
                    url(address, WS_PATH, tls),
                    headers=headers,
                    ssl=tls if tls is not None else True,
                    max_msg_size=max_frame_bytes,
                    heartbeat=30.0,
                    timeout=aiohttp.ClientWSTimeout(ws_close=5.0),
                )
                hello = {
                    "t": "hello",
                    "v": list(SUPPORTED_VERSIONS),
                    "caps": list(CAPABILITIES),
                    "client": client_id,
                    "token": token,
                }
                await ws.send_bytes(encode_frame(hello))
                msg = await asyncio.wait_for(ws.receive(), timeout)
            frame = _welcome_of(msg, address, max_frame_bytes)
        except TransportError as exc:
            await session.close()
            await explain_dropped(address, exc, tls)
            raise
        except BaseException:
            await session.close()
            raise
        return cls(address, session, ws, frame)

    @property
    def closed(self) -> bool:
        return self._error is not None or self._ws.closed

    async def close(self) -> None:
        if self._error is None:
            self._error = ConnectionLostError(f"connection to {self.address} was closed")
        # Frames queued before the close (stream closes) go out, unless the node stopped reading.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CLOSE_DRAIN_SECONDS):
                await self._outbox.drain()
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._session.close()
        self._fail_all(self._error)

    def _abort_transport(self) -> None:
        """Cut the socket without a close handshake (what a network failure looks like)."""
        transport = getattr(self._ws._writer, "transport", None)
        if transport is not None:
            transport.abort()

    async def open_stream(
        self,
        sid: str,
        receiver: str,
        args: Any,
        results: ResultSink | None,
        *,
        key: bytes,
        random: bool = False,
    ) -> None:
        """Declare a stream on this connection (once), under its secret ``key``: the node lets
        only connections that opened it with that key feed or close it (``random``: the id was
        made up here, so no other client can resend its batches). Raises what the node
        reports."""
        if results is not None:
            self._result_sinks[sid] = results
        fut = self._opening.get(sid)
        if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
            return  # open already (the common case: every batch after the first)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._opening[sid] = fut
            try:
                frame = {"t": "open", "sid": sid, "receiver": receiver, "args": args, "key": key}
                if random:
                    frame["random"] = True
                await self._send(frame)
            except BaseException as exc:
                if self._opening.get(sid) is fut:
                    del self._opening[sid]
                if not fut.done():
                    fut.set_exception(exc)
                fut.exception()  # mark retrieved
                raise
        await asyncio.shield(fut)

    async def close_stream(self, sid: str, *, keep_results: bool = False) -> None:
        """Tell the node the stream ends. ``keep_results``: a stopping stream still takes the
        results of batches the node goes on to finish (they are applied: their results count)."""
        if not keep_results:
            self._result_sinks.pop(sid, None)
        opening = self._opening.pop(sid, None)
        if opening is not None and not opening.done():  # a send still waiting for 'opened'
            opening.set_exception(ConnectionLostError(f"stream {sid} was closed while opening"))
            opening.exception()  # retrieved: its waiter may be gone
        if opening is not None and not self.closed:
            with contextlib.suppress(DeltaflowError):
                await self._send({"t": "close", "sid": sid})

    def stream_open(self, sid: str) -> bool:
        """Whether the node confirmed ``sid`` on this connection (batches may go without
        :meth:`open_stream`)."""
        fut = self._opening.get(sid)
        return fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None

    @property
    def has_room(self) -> bool:
        """:meth:`start_batch` may queue a frame now: the outbox is below its high-water mark
        (else :meth:`send_batch` waits for it)."""
        return self._outbox.has_room

    def start_batch(self, frame: Frame, *, timeout: float) -> asyncio.Future[Frame]:
        """Queue a batch frame and return the future of its answer, without waiting (the
        sender needs no task per batch). The future gets the ack, or the error the node sent,
        or :class:`ConnectionLostError` if the connection fails or no answer comes within
        ``timeout`` seconds. Cancelling it abandons the wait; the node may still apply the batch.

        The outbox's high-water mark is not checked: see :attr:`has_room`.

        Raises:
            ConnectionLostError: the connection failed already.
            FrameTooLargeError: the frame exceeds the node's limit.
        """
        data = self._encode(frame)
        key: BatchKey = (frame["sid"], frame["p"], frame["seq"])
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Frame] = loop.create_future()
        # A timer per batch rather than a timeout scope: nothing awaits on the sender's side.
        # Its attempt and base are read now: the sender reuses the frame for its resend.
        sent = (frame.get("att", 1), frame.get("base", 0), loop.time())
        deadline = loop.call_later(timeout, self._ack_overdue, key, fut, sent)
        self._pending[key] = (fut, deadline)
        self._outbox.send_nowait(data)
        return fut

    async def send_batch(self, frame: Frame, *, timeout: float) -> Frame:
        """Send a batch frame and wait for its ack (returned) or error (raised): see
        :meth:`start_batch`. Waits first while the outbox is above its high-water mark.

        Cancellation abandons the wait; the node may still apply the batch.
        """
        await self._outbox.wait_for_room()
        fut = self.start_batch(frame, timeout=timeout)
        try:
            return await fut
        finally:
            if not fut.done() or fut.cancelled():
                self.abandon_batch(frame, fut)

    def abandon_batch(self, frame: Frame, fut: asyncio.Future[Frame]) -> None:
        """Stop waiting for the answer to a batch started with :meth:`start_batch`."""
        key: BatchKey = (frame["sid"], frame["p"], frame["seq"])
        waiter = self._pending.get(key)
        if waiter is not None and waiter[0] is fut:
            del self._pending[key]
            waiter[1].cancel()
        fut.cancel()

    def _ack_overdue(
        self, key: BatchKey, fut: asyncio.Future[Frame], sent: tuple[int, int, float]
    ) -> None:
        waiter = self._pending.get(key)
        if waiter is not None and waiter[0] is fut:
            del self._pending[key]
        if fut.done():
            return
        waited = asyncio.get_running_loop().time() - sent[2]
        # An open connection that lost an answer: the node, or the client's routing, has a bug
        # or a stall worth an operator's look (a resend follows, so nothing is lost).
        log.warning(
            "no answer from node %s at %s to stream %s partition %d batch %d (attempt %d, "
            "base %d) in %.1fs; resending it",
            self.node_id,
            self.address,
            key[0],
            key[1],
            key[2],
            sent[0],
            sent[1],
            waited,
        )
        fut.set_exception(
            ConnectionLostError(
                f"no ack from node {self.node_id} at {self.address} for partition "
                f"{key[1]} batch {key[2]} within {waited:.1f}s"
            )
        )

    async def _send(self, frame: Frame) -> None:
        """Queue ``frame`` for the outbox. A write that fails later fails every waiter of the
        connection (batches wait for their ack, so none is lost unnoticed)."""
        await self._outbox.send(self._encode(frame))

    def _encode(self, frame: Frame) -> bytes:
        if self._error is not None:
            raise self._error
        data = encode_frame(frame)
        if len(data) > self.max_frame_bytes:
            raise FrameTooLargeError(
                f"frame of {len(data)} bytes exceeds node {self.node_id}'s limit of "
                f"{self.max_frame_bytes} bytes; lower StreamerOptions.max_batch_bytes"
            )
        return data

    async def _write(self, data: bytes) -> None:
        with map_transport_errors(self.address):
            await self._ws.send_bytes(data)

    def _write_failed(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = (
                exc
                if isinstance(exc, DeltaflowError)
                else ConnectionLostError(f"sending to node at {self.address} failed: {exc!r}")
            )
        self._fail_all(self._error)
        self._abort_transport()  # the reader then ends, and with it the session

    async def _read_loop(self) -> None:
        error: DeltaflowError
        try:
            while True:
                msg = await self._ws.receive()
                for frame in _frames_of(msg, self.address, self.max_frame_bytes):
                    if frame["t"] == "ack":  # most frames: resolved without a coroutine each
                        self._resolve((frame["sid"], frame["p"], frame["seq"]), frame)
                    else:
                        await self._route(frame)
        except asyncio.CancelledError:
            raise
        except DeltaflowError as exc:
            error = exc
        except Exception as exc:  # a bug in routing must still fail the waiters
            log.exception("reader for %s crashed", self.address)
            error = ConnectionLostError(f"reader for {self.address} crashed: {exc!r}")
        self._error = error
        self._fail_all(error)
        await self._ws.close()
        await self._session.close()

    async def _route(self, frame: Frame) -> None:
        """Route a frame other than an ack (the read loop resolves those itself)."""
        ftype = frame["t"]
        if ftype == "result":
            sink = self._result_sinks.get(frame["sid"])
            if sink is not None:
                await sink(frame["values"])
        elif ftype == "opened":
            fut = self._opening.get(frame["sid"])
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif ftype == "error":
            self._route_error(frame)
        elif ftype == "map":  # the node's partitions moved (it drains)
            if self.on_map is not None:
                self.on_map(frame["map"])
        else:
            raise ProtocolError(f"node {self.node_id} sent an unexpected {ftype!r} frame")

    def _route_error(self, frame: Frame) -> None:
        err = _error_of(frame)
        sid, p, seq = frame.get("sid"), frame.get("p"), frame.get("seq")
        if sid is not None and p is not None and seq is not None:
            if isinstance(err, UnknownStreamError):
                self._opening.pop(sid, None)  # the resend re-opens the stream first
            self._resolve((sid, p, seq), err)
        elif sid is not None:
            fut = self._opening.pop(sid, None)
            if fut is not None and not fut.done():
                fut.set_exception(err)
            for key in [key for key in self._pending if key[0] == sid]:
                self._resolve(key, err)
        else:  # a connection-level error: the node is about to close the socket
            raise err

    def _resolve(self, key: BatchKey, outcome: Frame | BaseException) -> None:
        waiter = self._pending.pop(key, None)
        if waiter is None:
            return  # a late answer for a batch we stopped waiting for
        fut, deadline = waiter
        deadline.cancel()
        if fut.done():
            return
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    def _fail_all(self, error: DeltaflowError) -> None:
        futs: list[asyncio.Future[Any]] = [*self._opening.values()]
        for fut, deadline in self._pending.values():
            deadline.cancel()
            futs.append(fut)
        for fut in futs:
            if not fut.done():
                fut.set_exception(error)
                fut.exception()  # waiters may be gone; avoid "never retrieved" noise
        self._pending.clear()
        self._opening.clear()


def _error_of(frame: Frame) -> ServerError:
    details = dict(frame.get("details") or {})
    return server_error(
        frame["code"],
        frame["msg"],
        node=frame.get("node"),
        details=details,
        retriable=frame["retriable"],
    )


def _welcome_of(msg: aiohttp.WSMessage, address: str, max_bytes: int) -> Frame:
    """The node's answer to ``hello``: its ``welcome`` frame, or the error it sent raised."""
    frames = _frames_of(msg, address, max_bytes)
    if len(frames) != 1:
        raise ProtocolError(f"node at {address} answered hello with {len(frames)} frames")
    frame = frames[0]
    if frame["t"] == "error":
        raise _error_of(frame)
    if frame["t"] != "welcome":
        raise ProtocolError(f"node at {address} answered hello with {frame['t']!r}")
    return frame


def _frames_of(msg: aiohttp.WSMessage, address: str, max_bytes: int) -> list[Frame]:
    if msg.type == aiohttp.WSMsgType.BINARY:
        return decode_frames(msg.data, max_bytes=max_bytes)
    if msg.type == aiohttp.WSMsgType.CLOSE and msg.data == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
        raise FrameTooLargeError(
            f"node at {address} closed the connection because a frame exceeded its limit of "
            f"{max_bytes} bytes; lower StreamerOptions.max_batch_bytes"
        )
    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
        reason = f" ({msg.extra})" if msg.extra else ""
        raise ConnectionLostError(f"node at {address} closed the connection{reason}")
    if msg.type == aiohttp.WSMsgType.ERROR:
        raise ConnectionLostError(f"connection to node at {address} failed: {msg.data!r}")
    raise ProtocolError(f"node at {address} sent a {msg.type.name} message; expected binary")
