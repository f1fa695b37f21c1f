"""The deltaflow wire protocol, shared by client and server.

Every WebSocket message is one binary *frame*: a msgpack map whose ``"t"`` field names the
frame type. Items inside a batch are msgpack values packed one after another into a single
``bin`` field, so the client packs each item exactly once (which also gives its exact size for
byte-bounded batching) and the server unpacks them lazily.

Besides msgpack's own types, items may hold the value types of table columns a Python
application has: aware datetimes (msgpack's standard timestamp), and as deltaflow's extension
types ``decimal.Decimal``, ``datetime.date`` and naive ``datetime.datetime`` (:data:`EXT_TYPES`).

The decoder never imports or executes anything from the wire: it uses plain msgpack types,
decodes those extension types only into those plain values (from fixed-size integers or a
checked decimal literal) and rejects every other one, checks each frame against a fixed field
table, and refuses frames larger than the agreed limit. See ``docs/protocol.md``.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import decimal
import itertools
import re
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Final

import msgpack

from .errors import FrameTooLargeError, ProtocolError

__all__ = [
    "CALLER_STREAM_ID",
    "CAPABILITIES",
    "COALESCE_BYTES",
    "DEFAULT_MAX_FRAME_BYTES",
    "EXT_TYPES",
    "MAX_CALLER_STREAM_ID",
    "PROTOCOL_VERSION",
    "QUEUE_HIGH_WATER",
    "STREAM_ID",
    "SUPPORTED_VERSIONS",
    "WS_PATH",
    "Frame",
    "Outbox",
    "decode_frame",
    "decode_frames",
    "encode_frame",
    "join_items",
    "pack_item",
    "pack_items",
    "unpack_items",
]

PROTOCOL_VERSION: Final = 1
SUPPORTED_VERSIONS: Final = (1,)
#: Features a node may offer in ``welcome``; a client uses only those both sides list.
#: ``multi``: a WebSocket message may carry several frames back to back (see :class:`Outbox`).
#: ``arrow``: a batch may carry its rows as an Arrow IPC stream (``arrow``) instead of ``items``.
#: ``maps``: the node may push a ``map`` frame when its partitions move (it drains).
CAPABILITIES: Final = ("results", "deletes", "pipelining", "multi", "arrow", "maps")
DEFAULT_MAX_FRAME_BYTES: Final = 16 * 1024 * 1024
WS_PATH: Final = "/v1/stream"
#: Frames queued in one event-loop turn share a message up to this size; larger ones go alone.
#: Joining saves a system call and a wake-up per small frame; for large frames it saves next
#: to nothing, costs a copy, and the receiver cannot start on the first frame until the whole
#: message arrived.
COALESCE_BYTES: Final = 128 * 1024
#: An :class:`Outbox` makes its senders wait while more than this many bytes are queued.
QUEUE_HIGH_WATER: Final = 4 * 1024 * 1024

Frame = dict[str, Any]

#: The longest ``stream_id=`` a caller may choose.
MAX_CALLER_STREAM_ID: Final = 128
#: What a caller-chosen stream id may look like (it names lanes in Delta commit metadata).
CALLER_STREAM_ID: Final = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_CALLER_STREAM_ID}}}")
#: Stream ids a node accepts: the client's ids (random, or the caller's) plus the suffix of a
#: dead-letter stream (``-dl-`` and 12 hex digits). They end up in every Delta commit's lane
#: marks, so a node refuses anything else.
STREAM_ID: Final = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_CALLER_STREAM_ID + 32}}}")

# Field table: frame type -> {field: accepted python types}. Fields not listed are rejected,
# so a frame can never smuggle data a handler does not expect.
_OPTIONAL = "?"
_FIELDS: Final[dict[str, dict[str, tuple[type, ...]]]] = {
    "hello": {"v": (list,), "caps": (list,), "client": (str,), "token?": (str, type(None))},
    "welcome": {"v": (int,), "caps": (list,), "node": (str,), "map": (dict,), "max": (int,)},
    "open": {"sid": (str,), "receiver": (str,), "args?": (object,)},
    "opened": {"sid": (str,)},
    "close": {"sid": (str,)},
    "batch": {
        "sid": (str,),
        "p": (int,),
        "seq": (int,),
        "n": (int,),
        "items?": (bytes,),
        "arrow?": (bytes,),
        "del?": (list,),
        "base?": (int,),
        "att?": (int,),
    },
    "result": {"sid": (str,), "p": (int,), "seq": (int,), "values": (list,)},
    "map": {"map": (dict,)},
    "ack": {
        "sid": (str,),
        "p": (int,),
        "seq": (int,),
        "n": (int,),
        "dup?": (bool,),
        "failed?": (list,),
    },
    "error": {
        "code": (str,),
        "msg": (str,),
        "node?": (str, type(None)),
        "retriable": (bool,),
        "sid?": (str,),
        "p?": (int,),
        "seq?": (int,),
        "details?": (dict,),
    },
}


#: deltaflow's msgpack extension types: code -> the value type it carries. A decimal is its
#: literal (``str(value)``, ASCII); a date is its days since 1970-01-01 (4 bytes, signed, big
#: endian); a naive datetime its microseconds since 1970-01-01T00:00:00 (8 bytes, likewise).
EXT_TYPES: Final = {1: decimal.Decimal, 2: datetime.date, 3: datetime.datetime}
_EXT_DECIMAL, _EXT_DATE, _EXT_NAIVE = 1, 2, 3
_EPOCH: Final = datetime.datetime(1970, 1, 1)
_EPOCH_DAY: Final = _EPOCH.date().toordinal()
_MICROSECOND: Final = datetime.timedelta(microseconds=1)
#: A decimal literal as ``str(Decimal)`` writes finite values, with a bounded exponent.
_DECIMAL_LITERAL: Final = re.compile(r"-?(\d{1,76}(\.\d{0,76})?|\.\d{1,76})(E[+-]?\d{1,4})?")


def _pack_default(value: Any) -> Any:
    """msgpack's hook for the types it does not pack itself (see :data:`EXT_TYPES`)."""
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise TypeError(f"Decimal {value} cannot be sent: table decimals hold finite values")
        return msgpack.ExtType(_EXT_DECIMAL, str(value).encode("ascii"))
    if isinstance(value, datetime.datetime):
        if getattr(value, "nanosecond", 0):
            raise TypeError(f"{value!r} has nanoseconds; deltaflow carries microseconds")
        if value.tzinfo is not None and value.utcoffset() is not None:
            return msgpack.Timestamp.from_datetime(value)  # a subclass msgpack did not take
        micros = (value.replace(tzinfo=None) - _EPOCH) // _MICROSECOND
        return msgpack.ExtType(_EXT_NAIVE, micros.to_bytes(8, "big", signed=True))
    if isinstance(value, datetime.date):
        days = value.toordinal() - _EPOCH_DAY
        return msgpack.ExtType(_EXT_DATE, days.to_bytes(4, "big", signed=True))
    raise TypeError(f"can not serialize {type(value).__name__!r} object")


def _ext_hook(code: int, data: bytes) -> Any:
    """Decodes deltaflow's extension types into plain values; anything else would be an
    attempt to make us interpret opaque payloads. (msgpack decodes its own timestamp, -1.)"""
    if code not in EXT_TYPES:
        raise ProtocolError(f"msgpack extension type {code} is not allowed on the wire")
    try:
        if code == _EXT_DECIMAL:
            text = data.decode("ascii")
            if _DECIMAL_LITERAL.fullmatch(text):
                return decimal.Decimal(text)
        elif code == _EXT_DATE and len(data) == 4:
            return datetime.date.fromordinal(_EPOCH_DAY + int.from_bytes(data, "big", signed=True))
        elif code == _EXT_NAIVE and len(data) == 8:
            return _EPOCH + int.from_bytes(data, "big", signed=True) * _MICROSECOND
    except (ValueError, OverflowError, UnicodeDecodeError):
        pass
    raise ProtocolError(f"msgpack extension type {code} holds no valid {EXT_TYPES[code].__name__}")


def encode_frame(frame: Mapping[str, Any]) -> bytes:
    """Pack a frame; ``frame["t"]`` must be a known type."""
    return msgpack.packb(  # type: ignore[no-any-return]
        frame, use_bin_type=True, datetime=True, default=_pack_default
    )


def decode_frame(data: bytes, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    """Decode and validate a message that must hold exactly one frame (the handshake).

    Raises:
        FrameTooLargeError: ``data`` is larger than ``max_bytes``.
        ProtocolError: not msgpack, not a map, unknown type, or fields of the wrong type.
    """
    frames = decode_frames(data, max_bytes=max_bytes)
    if len(frames) != 1:
        raise ProtocolError(f"expected one frame, got {len(frames)} in one message")
    return frames[0]


def decode_frames(data: bytes, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[Frame]:
    """Decode and validate the frames of one message: one, or several back to back.

    Raises:
        FrameTooLargeError: ``data`` is larger than ``max_bytes``.
        ProtocolError: not msgpack, not a map, unknown type, or fields of the wrong type.
    """
    if len(data) > max_bytes:
        raise FrameTooLargeError(
            f"frame of {len(data)} bytes exceeds the limit of {max_bytes} bytes"
        )
    options: dict[str, Any] = {
        "raw": False,
        "strict_map_key": True,
        "timestamp": 3,
        "ext_hook": _ext_hook,
    }
    values: list[Any]
    try:
        try:
            values = [msgpack.unpackb(data, **options)]
        except msgpack.ExtraData as more:  # several frames: the rest, one after another
            unpacker = msgpack.Unpacker(max_buffer_size=max(len(more.extra), 1), **options)
            unpacker.feed(more.extra)
            values, end = [more.unpacked], 0
            for value in unpacker:
                values.append(value)
                end = unpacker.tell()  # where the last whole frame ends
            if end != len(more.extra):
                raise ProtocolError("a message ends inside a frame") from None
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"frame is not valid msgpack: {exc}") from exc
    for frame in values:
        if not isinstance(frame, dict):
            raise ProtocolError(f"frame must be a msgpack map, got {type(frame).__name__}")
        ftype = frame.get("t")
        if not isinstance(ftype, str) or ftype not in _COMPILED:
            raise ProtocolError(f"unknown frame type {ftype!r}")
        _check_fields(ftype, frame)
    return values


class Outbox:
    """Frames waiting to go out on one WebSocket, written one message at a time, in order.

    The first frame of an event-loop turn given to :meth:`send` is written at once (no added
    latency for a lone frame). Frames sent while a write is running, later in the same turn, or
    with :meth:`send_nowait`, queue up and are written by the outbox's task: with ``multi``
    (both sides listed the capability) joined into messages of up to ``limit`` bytes, else one
    message each. Fewer messages mean fewer system calls and wake-ups per batch on both ends.

    :meth:`send` waits while more than :data:`QUEUE_HIGH_WATER` bytes are queued, so a peer
    that stops reading slows its senders down instead of growing memory. :meth:`send_nowait`
    queues without waiting, for callers that need no task of their own per frame (a batch sent
    from the code that cut it, an ack sent from the lane that applied it); they check
    :attr:`has_room` first and wait with :meth:`wait_for_room` when it is False.

    Args:
        write: sends one message.
        multi: several frames may share a message.
        on_error: called with what ``write`` raised. The frames still queued behind a failed
            write are dropped (the connection is gone; its owner fails whatever waited on them).
        limit: the largest message that joins frames: :data:`COALESCE_BYTES`, or the peer's
            frame limit if lower. A frame alone may be larger (its sender checks it).
    """

    def __init__(
        self,
        write: Callable[[bytes], Awaitable[None]],
        *,
        multi: bool,
        on_error: Callable[[BaseException], None],
        limit: int = COALESCE_BYTES,
    ) -> None:
        self._write = write
        self._multi = multi
        self._limit = min(limit, COALESCE_BYTES)
        self._on_error = on_error
        self._queue: collections.deque[bytes] = collections.deque()
        self._queued_bytes = 0
        self._task: asyncio.Task[None] | None = None
        self._hot = False  # a frame went out at once in this loop turn
        self._idle = asyncio.Event()  # no write is running
        self._idle.set()
        self._room = asyncio.Event()  # the queue is below its high-water mark
        self._room.set()

    async def send(self, data: bytes) -> None:
        """Send one encoded frame (see the class). Never raises a write's error: that goes to
        ``on_error``."""
        if self._task is None and not self._hot and self._idle.is_set():
            self._hot = True
            asyncio.get_running_loop().call_soon(self._cool)
            await self._write_one(data)
            return
        self.send_nowait(data)
        await self.wait_for_room()

    def send_nowait(self, data: bytes) -> None:
        """Queue one encoded frame for the outbox's task, which writes it (with the others of
        this turn) on the next loop turn. Never waits: the caller checks :attr:`has_room`."""
        self._queue.append(data)
        self._queued_bytes += len(data)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush())
        if self._queued_bytes > QUEUE_HIGH_WATER:
            self._room.clear()

    @property
    def has_room(self) -> bool:
        """At most :data:`QUEUE_HIGH_WATER` bytes are queued: a frame may be added now."""
        return self._room.is_set()

    async def wait_for_room(self) -> None:
        """Wait while more than :data:`QUEUE_HIGH_WATER` bytes are queued."""
        while not self._room.is_set():
            await self._room.wait()

    def _cool(self) -> None:
        self._hot = False

    async def drain(self) -> None:
        """Wait until every frame sent so far was written (or its write failed)."""
        while self._task is not None or not self._idle.is_set():
            if self._task is not None:
                await asyncio.shield(self._task)
            else:  # an immediate write waiting for the socket to drain
                await self._idle.wait()

    async def _write_one(self, data: bytes) -> bool:
        """Write one message after any write still running; False if it failed."""
        while not self._idle.is_set():
            await self._idle.wait()
        self._idle.clear()
        try:
            await self._write(data)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- reported to the owner, which fails the waiters
            self._on_error(exc)
            return False
        finally:
            self._idle.set()
        return True

    async def _flush(self) -> None:
        queue = self._queue
        try:
            while queue:
                data = queue.popleft()
                taken = len(data)
                if self._multi and queue and len(data) < self._limit:
                    parts = [data]
                    while queue and taken + len(queue[0]) <= self._limit:
                        taken += len(queue[0])
                        parts.append(queue.popleft())
                    data = b"".join(parts)
                self._queued_bytes -= taken
                if self._queued_bytes <= QUEUE_HIGH_WATER:
                    self._room.set()
                if not await self._write_one(data):
                    break
        finally:
            queue.clear()  # empty unless a write failed or the task was cancelled
            self._queued_bytes = 0
            self._room.set()
            self._task = None


def _compile(
    spec: dict[str, tuple[type, ...]],
) -> tuple[tuple[tuple[str, tuple[type, ...], bool, bool], ...], frozenset[str]]:
    """A field table entry as (field, types, optional, accepts bool) rows and the allowed names."""
    rows = tuple(
        (
            name.rstrip(_OPTIONAL),
            types,
            name.endswith(_OPTIONAL),
            bool in types or object in types,
        )
        for name, types in spec.items()
    )
    return rows, frozenset(["t", *(row[0] for row in rows)])


_COMPILED: Final = {ftype: _compile(spec) for ftype, spec in _FIELDS.items()}


def _check_fields(ftype: str, frame: Frame) -> None:
    rows, allowed = _COMPILED[ftype]
    for field, types, optional, accepts_bool in rows:
        if field not in frame:
            if optional:
                continue
            raise ProtocolError(f"{ftype!r} frame lacks field {field!r}")
        value = frame[field]
        # bool is an int subclass; an int field must not accept True/False.
        if not isinstance(value, types) or (isinstance(value, bool) and not accepts_bool):
            raise ProtocolError(f"{ftype!r} frame field {field!r} has type {type(value).__name__}")
    if not allowed.issuperset(frame):
        extra = set(frame) - allowed
        raise ProtocolError(f"{ftype!r} frame has unexpected fields {sorted(extra)}")


class _Packer(threading.local):
    """One ``Packer`` per thread (a packer is not thread-safe; blocking clients may stream
    from several threads of one process)."""

    def __init__(self) -> None:
        self.pack = msgpack.Packer(
            use_bin_type=True, datetime=True, autoreset=True, default=_pack_default
        ).pack


_packer = _Packer()


def pack_item(item: Any) -> bytes:
    """Pack one item for a batch frame (its length is the item's wire size).

    Raises:
        TypeError: the item holds a value msgpack cannot carry (e.g. an arbitrary object).
    """
    return _packer.pack(item)  # type: ignore[no-any-return]


def pack_items(items: Iterable[Any]) -> list[bytes]:
    """:func:`pack_item` of every item, in one pass."""
    return list(map(_packer.pack, items))


def join_items(packed: Iterable[bytes]) -> bytes:
    """Concatenate packed items into a batch frame's ``items`` field."""
    return b"".join(packed)


def _array_header(count: int) -> bytes:
    """The msgpack header of an array of ``count`` values."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def unpack_items(blob: bytes, count: int, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[Any]:
    """Unpack a batch's ``items`` field, checking it holds exactly ``count`` items."""
    if 0 <= count < 1 << 32:
        # One C call: the items read as the array they are, behind an array header.
        try:
            return msgpack.unpackb(  # type: ignore[no-any-return]
                _array_header(count) + blob,
                raw=False,
                strict_map_key=False,
                timestamp=3,
                ext_hook=_ext_hook,
            )
        except ProtocolError:
            raise
        except Exception:  # noqa: BLE001 - the item by item pass below says what is wrong
            pass
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=False,
        timestamp=3,
        ext_hook=_ext_hook,
        max_buffer_size=max(max_bytes, len(blob)),
    )
    unpacker.feed(blob)
    items: list[Any] = []
    try:
        items.extend(itertools.islice(unpacker, max(count, 0) + 1))
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"batch items are not valid msgpack: {exc}") from exc
    if len(items) != count:
        more = "more" if len(items) > count else str(len(items))  # read no further
        raise ProtocolError(f"batch declares {count} items but carries {more}")
    return items
