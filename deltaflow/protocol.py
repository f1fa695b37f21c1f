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
table, refuses frames larger than the agreed limit, and bounds what one message may decode to
(string, array and map lengths, and how many maps, arrays and extension values it builds). See
``docs/protocol.md``.
"""

from __future__ import annotations

import datetime
import decimal
import itertools
import re
import reprlib
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final

import msgpack

from .errors import FrameTooLargeError, ProtocolError

__all__ = [
    "BYTES_PER_CONTAINER",
    "CALLER_STREAM_ID",
    "CAPABILITIES",
    "CLIENT_ID",
    "DEFAULT_MAX_FRAME_BYTES",
    "EXT_TYPES",
    "LANE_WINDOW",
    "MAX_CALLER_STREAM_ID",
    "MAX_CLIENT_ID",
    "MAX_DEPTH",
    "MAX_HELLO_BYTES",
    "MAX_ORDINAL",
    "MAX_SEQ",
    "PROTOCOL_VERSION",
    "RANDOM_LANE_PREFIX",
    "STREAM_ID",
    "SUPPORTED_VERSIONS",
    "WS_PATH",
    "Frame",
    "decode_frame",
    "decode_frames",
    "decode_hello",
    "encode_frame",
    "join_items",
    "pack_item",
    "pack_items",
    "truncated_repr",
    "unpack_items",
]

PROTOCOL_VERSION: Final = 1
SUPPORTED_VERSIONS: Final = (1,)
#: Features a node may offer in ``welcome``; a client uses only those both sides list.
#: ``multi``: a WebSocket message may carry several frames back to back (see ``outbox.py``).
#: ``arrow``: a batch may carry its rows as an Arrow IPC stream (``arrow``) instead of ``items``.
#: ``maps``: the node may push a ``map`` frame when its partitions move (it drains).
CAPABILITIES: Final = ("results", "deletes", "pipelining", "multi", "arrow", "maps")
DEFAULT_MAX_FRAME_BYTES: Final = 16 * 1024 * 1024
#: The largest ``hello`` a node reads, checked before it is decoded: a stranger's first message
#: costs the node no more than this (versions, capabilities, a client id and a token fit).
MAX_HELLO_BYTES: Final = 4096
#: One message may decode to at most one map, array or extension value per this many bytes of
#: the frame limit (1 Mi at 16 MiB), and no array or map longer than that: these cost up to 70
#: bytes of memory per byte on the wire, and msgpack's own limits bound each one, not how many.
BYTES_PER_CONTAINER: Final = 16
#: How deep maps and arrays may nest: msgpack-python's C decoder stops at its fixed stack.
MAX_DEPTH: Final = 1024
WS_PATH: Final = "/v1/stream"

Frame = dict[str, Any]

#: The longest ``stream_id=`` a caller may choose.
MAX_CALLER_STREAM_ID: Final = 128
#: What a caller-chosen stream id may look like (it names lanes in Delta commit metadata).
CALLER_STREAM_ID: Final = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_CALLER_STREAM_ID}}}")
#: Stream ids a node accepts: the client's ids (random, or the caller's) plus the suffix of a
#: dead-letter stream (``-dl-`` and 12 hex digits). They end up in every Delta commit's lane
#: marks, so a node refuses anything else.
STREAM_ID: Final = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_CALLER_STREAM_ID + 32}}}")
#: The longest client id a ``hello`` may carry.
MAX_CLIENT_ID: Final = 64
#: What a client id may look like: it goes into the node's log lines, so nothing that could
#: break or forge one (the client sends a random hex id).
CLIENT_ID: Final = re.compile(rf"[A-Za-z0-9._:@/-]{{1,{MAX_CLIENT_ID}}}")
#: The most characters of a value from the wire that an error message or a log line shows.
_SHOWN_CHARS: Final = 64
#: A lane's window: a node takes batch ``seq`` of a (stream, partition) only when ``0 <= base
#: <= seq < base + LANE_WINDOW``, and a client sends none outside it: a lane never has more
#: than this many batches in flight or waiting for their turn.
LANE_WINDOW: Final = 64
#: A batch's sequence number is below this: a table keeps a lane's mark as a Delta ``txn``
#: version, the sequence number above 20 bits of the write's ordinal in a signed 64-bit long.
MAX_SEQ: Final = 1 << 43
#: The most writes one batch may make to one table (the ordinal in its lane marks).
MAX_ORDINAL: Final = 1 << 20
#: A lane of a stream whose id the client made up starts with this (``open``'s ``random``).
RANDOM_LANE_PREFIX: Final = "~"

# Field table: frame type -> {field: accepted python types}. Fields not listed are rejected,
# so a frame can never smuggle data a handler does not expect.
_OPTIONAL = "?"
_FIELDS: Final[dict[str, dict[str, tuple[type, ...]]]] = {
    "hello": {"v": (list,), "caps": (list,), "client": (str,), "token?": (str, type(None))},
    "welcome": {"v": (int,), "caps": (list,), "node": (str,), "map": (dict,), "max": (int,)},
    "open": {
        "sid": (str,),
        "receiver": (str,),
        "key": (bytes,),
        "args?": (object,),
        "random?": (bool,),
    },
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


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded ``repr``, also for bytes, with a string's start (not its start and
    end) and a map's first keys in wire order (reprlib sorts them all): it costs no more for a
    huge value than for a small one."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxother = _SHOWN_CHARS

    def repr_str(self, x: str, level: int) -> str:
        return repr(x[: self.maxstring]) + (self.fillvalue if len(x) > self.maxstring else "")

    repr_bytes = repr_str

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{" + self.fillvalue + "}"
        pieces = [
            f"{self.repr1(key, level - 1)}: {self.repr1(value, level - 1)}"
            for key, value in itertools.islice(x.items(), self.maxdict)
        ]
        if len(x) > self.maxdict:
            pieces.append(self.fillvalue)
        return "{" + ", ".join(pieces) + "}"


_short_repr: Final = _ShortRepr()


def truncated_repr(value: object) -> str:
    """``%r`` of a value from the wire, for an error message or a log line: at most 64
    characters of it, then ``...``, however large or deep the value (a peer must not write
    megabytes into a log, nor break a log line)."""
    text = _short_repr.repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _max_containers(max_bytes: int) -> int:
    """How many maps, arrays and extension values one message under ``max_bytes`` may hold."""
    return max(max_bytes // BYTES_PER_CONTAINER, 64)


class _Budget:
    """Counts the maps, arrays and extension values one decoding builds and stops it past the
    limit, before they fill memory (msgpack calls these hooks as it builds each one)."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int, *, spare: int = 0) -> None:
        self.limit = limit
        self.left = limit + spare  # ``spare``: the decoder's own, not the message's

    def count(self, value: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError(
                f"message holds more than {self.limit} maps, arrays and extension values (one "
                f"per {BYTES_PER_CONTAINER} bytes of the frame limit); send fewer items per batch"
            )
        return value

    def ext(self, code: int, data: bytes) -> Any:
        self.count(None)
        return _ext_hook(code, data)


def _unpack_options(max_bytes: int, size: int, *, wrapped: bool = False) -> dict[str, Any]:
    """msgpack's options for decoding ``size`` bytes of a message under ``max_bytes``
    (``wrapped``: behind one more array header, which the limit does not count)."""
    limit = _max_containers(max_bytes)
    options: dict[str, Any] = {
        "raw": False,
        # Maps inside items and frame values may have int, float or bytes keys, as the
        # application's do: in 64 bits they cannot make Python's dict hashes collide at length.
        # A frame's own fields are strings (the field table has no other names).
        "strict_map_key": False,
        "timestamp": 3,
        "ext_hook": _ext_hook,
        "max_str_len": max_bytes,
        "max_bin_len": max_bytes,
        "max_ext_len": max_bytes,
        "max_array_len": limit,
        "max_map_len": limit,
    }
    if size > limit:  # fewer bytes cannot hold more than the limit: no hook calls to pay
        budget = _Budget(limit, spare=int(wrapped))
        options.update(object_hook=budget.count, list_hook=budget.count, ext_hook=budget.ext)
    return options


def _not_msgpack(subject: str, exc: Exception) -> ProtocolError:
    """What msgpack's ``exc`` means, of ``subject`` ("frame is", "batch items are")."""
    if isinstance(exc, msgpack.StackError):  # its message is empty
        return ProtocolError(f"{subject} nested deeper than {MAX_DEPTH} levels")
    return ProtocolError(f"{subject} not valid msgpack: {exc}")


def decode_frame(data: bytes, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    """Decode and validate a message that must hold exactly one frame.

    Raises:
        FrameTooLargeError: ``data`` is larger than ``max_bytes``.
        ProtocolError: not msgpack, not a map, unknown type, or fields of the wrong type.
    """
    frames = decode_frames(data, max_bytes=max_bytes)
    if len(frames) != 1:
        raise ProtocolError(f"expected one frame, got {len(frames)} in one message")
    return frames[0]


def decode_hello(data: bytes) -> Frame:
    """Decode a connection's first message, which must be one ``hello`` of at most
    :data:`MAX_HELLO_BYTES` (checked before anything is decoded).

    Raises:
        FrameTooLargeError: ``data`` is larger than :data:`MAX_HELLO_BYTES`.
        ProtocolError: not one valid ``hello`` frame.
    """
    if len(data) > MAX_HELLO_BYTES:
        raise FrameTooLargeError(
            f"hello of {len(data)} bytes exceeds the limit of {MAX_HELLO_BYTES} bytes for a "
            "hello; send only the versions, capabilities, client id and token"
        )
    hello = decode_frame(data, max_bytes=MAX_HELLO_BYTES)
    if hello["t"] != "hello":
        raise ProtocolError(f"expected hello, got {hello['t']!r}")
    return hello


def decode_frames(data: bytes, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[Frame]:
    """Decode and validate the frames of one message: one, or several back to back.

    Raises:
        FrameTooLargeError: ``data`` is larger than ``max_bytes``.
        ProtocolError: not msgpack, not a map, unknown type, fields of the wrong type, or more
            than the limits allow (see :data:`BYTES_PER_CONTAINER`, :data:`MAX_DEPTH`).
    """
    if len(data) > max_bytes:
        raise FrameTooLargeError(
            f"frame of {len(data)} bytes exceeds the limit of {max_bytes} bytes"
        )
    options = _unpack_options(max_bytes, len(data))
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
        raise _not_msgpack("frame is", exc) from exc
    for frame in values:
        if not isinstance(frame, dict):
            raise ProtocolError(f"frame must be a msgpack map, got {type(frame).__name__}")
        ftype = frame.get("t")
        if not isinstance(ftype, str) or ftype not in _COMPILED:
            raise ProtocolError(f"unknown frame type {truncated_repr(ftype)}")
        _check_fields(ftype, frame)
    return values


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
        extra = [name for name in frame if name not in allowed]  # in wire order: no sort
        raise ProtocolError(f"{ftype!r} frame has unexpected fields {truncated_repr(extra)}")


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
    """Unpack a batch's ``items`` field, checking it holds exactly ``count`` items and keeps
    to the limits of a message under ``max_bytes`` (see :data:`BYTES_PER_CONTAINER`).

    Raises:
        ProtocolError: not ``count`` valid msgpack values, or more than the limits allow.
    """
    limit = _max_containers(max_bytes)
    if count > limit:
        raise ProtocolError(
            f"batch declares {count} items; a batch holds at most {limit} (one per "
            f"{BYTES_PER_CONTAINER} bytes of the frame limit): send fewer items per batch"
        )
    if count >= 0:
        # One C call: the items read as the array they are, behind an array header.
        try:
            return msgpack.unpackb(  # type: ignore[no-any-return]
                _array_header(count) + blob, **_unpack_options(max_bytes, len(blob), wrapped=True)
            )
        except ProtocolError:
            raise
        except Exception:  # noqa: BLE001 - the item by item pass below says what is wrong
            pass
    # Its buffer holds the blob, no more: msgpack allocates a share of it up front.
    options = _unpack_options(max_bytes, len(blob))
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(blob), 1), **options)
    unpacker.feed(blob)
    items: list[Any] = []
    try:
        items.extend(itertools.islice(unpacker, max(count, 0) + 1))
    except ProtocolError:
        raise
    except Exception as exc:
        raise _not_msgpack("batch items are", exc) from exc
    if len(items) != count:
        more = "more" if len(items) > count else str(len(items))  # read no further
        raise ProtocolError(f"batch declares {count} items but carries {more}")
    return items
