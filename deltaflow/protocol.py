"""The deltaflow wire protocol, shared by client and server.

Every WebSocket message is one binary *frame*: a msgpack map whose ``"t"`` field names the
frame type. Items inside a batch are msgpack values packed one after another into a single
``bin`` field, so the client packs each item exactly once (which also gives its exact size for
byte-bounded batching) and the server unpacks them lazily.

The decoder never imports or executes anything from the wire: it uses plain msgpack types,
rejects every extension type except msgpack's standard timestamp, checks each frame against a
fixed field table, and refuses frames larger than the agreed limit. See ``docs/protocol.md``.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final

import msgpack

from .errors import FrameTooLargeError, ProtocolError

__all__ = [
    "CAPABILITIES",
    "DEFAULT_MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "WS_PATH",
    "Frame",
    "decode_frame",
    "encode_frame",
    "join_items",
    "pack_item",
    "pack_items",
    "unpack_items",
]

PROTOCOL_VERSION: Final = 1
SUPPORTED_VERSIONS: Final = (1,)
#: Features a node may offer in ``welcome``; a client uses only those both sides list.
CAPABILITIES: Final = ("results", "deletes", "pipelining")
DEFAULT_MAX_FRAME_BYTES: Final = 16 * 1024 * 1024
WS_PATH: Final = "/v1/stream"

Frame = dict[str, Any]

#: Stream ids a node accepts: the client's ids (random, or the caller's ``stream_id=`` of at most
#: 128 characters) plus the suffix of a dead-letter stream. They end up in every Delta commit's
#: lane marks, so a node refuses anything else.
STREAM_ID: Final = re.compile(r"[A-Za-z0-9._:-]{1,160}")

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
        "items": (bytes,),
        "del?": (list,),
        "base?": (int,),
        "att?": (int,),
    },
    "result": {"sid": (str,), "p": (int,), "seq": (int,), "values": (list,)},
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


def _ext_hook(code: int, data: bytes) -> Any:
    # Only msgpack's own timestamp (-1) is decoded, by msgpack itself before this hook runs;
    # anything else would be an attempt to make us interpret opaque payloads.
    raise ProtocolError(f"msgpack extension type {code} is not allowed on the wire")


def encode_frame(frame: Mapping[str, Any]) -> bytes:
    """Pack a frame; ``frame["t"]`` must be a known type."""
    return msgpack.packb(frame, use_bin_type=True, datetime=True)  # type: ignore[no-any-return]


def decode_frame(data: bytes, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    """Decode and validate one frame.

    Raises:
        FrameTooLargeError: ``data`` is larger than ``max_bytes``.
        ProtocolError: not msgpack, not a map, unknown type, or fields of the wrong type.
    """
    if len(data) > max_bytes:
        raise FrameTooLargeError(
            f"frame of {len(data)} bytes exceeds the limit of {max_bytes} bytes"
        )
    try:
        frame = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            timestamp=3,
            ext_hook=_ext_hook,
        )
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"frame is not valid msgpack: {exc}") from exc
    if not isinstance(frame, dict):
        raise ProtocolError(f"frame must be a msgpack map, got {type(frame).__name__}")
    ftype = frame.get("t")
    if not isinstance(ftype, str) or (spec := _FIELDS.get(ftype)) is None:
        raise ProtocolError(f"unknown frame type {ftype!r}")
    _check_fields(ftype, frame, spec)
    return frame


def _check_fields(ftype: str, frame: Frame, spec: dict[str, tuple[type, ...]]) -> None:
    allowed = {"t"}
    for name, types in spec.items():
        optional = name.endswith(_OPTIONAL)
        field = name.rstrip(_OPTIONAL)
        allowed.add(field)
        if field not in frame:
            if optional:
                continue
            raise ProtocolError(f"{ftype!r} frame lacks field {field!r}")
        value = frame[field]
        # bool is an int subclass; an int field must not accept True/False.
        if not isinstance(value, types) or (
            isinstance(value, bool) and bool not in types and object not in types
        ):
            raise ProtocolError(f"{ftype!r} frame field {field!r} has type {type(value).__name__}")
    extra = set(frame) - allowed
    if extra:
        raise ProtocolError(f"{ftype!r} frame has unexpected fields {sorted(extra)}")


class _Packer(threading.local):
    """One ``Packer`` per thread (a packer is not thread-safe; blocking clients may stream
    from several threads of one process)."""

    def __init__(self) -> None:
        self.pack = msgpack.Packer(use_bin_type=True, datetime=True, autoreset=True).pack


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


def unpack_items(blob: bytes, count: int, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[Any]:
    """Unpack a batch's ``items`` field, checking it holds exactly ``count`` items."""
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
        items.extend(itertools.islice(unpacker, count + 1))
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"batch items are not valid msgpack: {exc}") from exc
    if len(items) != count:
        raise ProtocolError(f"batch declares {count} items but carries {len(items)}")
    return items
