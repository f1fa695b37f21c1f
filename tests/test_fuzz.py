"""A fuzzing net over the wire protocol (issue #36): hypothesis-made bytes, msgpack values and
frames of every type in the field table, against the decoder and against a real node's
WebSocket, with and without the token.

The decoder only ever raises ``ProtocolError`` (or its ``FrameTooLargeError``), never
allocates more than a fixed multiple of what it was given, and gives back every valid frame
and batch as it was sent. A node answers every hostile hello and frame with a documented error
code (or closes), never lets a hello without the token further than ``UNAUTHORIZED``, answers
every upgrade request with a documented status (never an upgrade for a wrong token), closes
every half-sent request within its header timeout, and keeps answering ``/healthz`` within a
second and streaming a real client's rows, example after example.

``make test`` runs the ``quick`` profile (well under a minute); ``make fuzz`` runs
``HYPOTHESIS_PROFILE=fuzz``, with many more examples (a few minutes).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import deltaflow
from deltaflow import protocol
from deltaflow.errors import ErrorCode, ProtocolError
from deltaflow.protocol import (
    MAX_HELLO_BYTES,
    WS_PATH,
    decode_frame,
    decode_frames,
    decode_hello,
    encode_frame,
    join_items,
    pack_items,
    unpack_items,
)
from deltaflow.server import Node

from .support import StartCluster, allocation_peak

settings.register_profile(
    "quick",
    max_examples=150,
    deadline=None,  # the suite shares 2 cores: time is asserted where it matters
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    settings.get_profile("quick"),
    max_examples=5000,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))
#: Examples per test against a live node: each opens a WebSocket and streams a row.
NODE_EXAMPLES = 100 if settings().max_examples <= 150 else 2000

TOKEN = "fuzz-token"
FRAME_LIMIT = 256 * 1024
#: The fuzzed node's: each half-sent request waits it out.
HEADER_TIMEOUT = 0.5
#: The decoder's worst case is about 75 bytes of objects per byte (a one-entry map).
BYTES_PER_WIRE_BYTE = 128
#: What a node may answer to a hello (docs/protocol.md, "Handshake").
HELLO_CODES = {
    ErrorCode.BAD_FRAME,
    ErrorCode.FRAME_TOO_LARGE,
    ErrorCode.UNAUTHORIZED,
    ErrorCode.UNSUPPORTED_VERSION,
    ErrorCode.OVERLOADED,
}
#: What a node may answer to a frame of an authenticated client that no receiver mishandles:
#: never INTERNAL, which would be a fault of the node's own.
FRAME_CODES = {
    ErrorCode.BAD_FRAME,
    ErrorCode.FRAME_TOO_LARGE,
    ErrorCode.UNKNOWN_RECEIVER,
    ErrorCode.UNKNOWN_STREAM,
    ErrorCode.NOT_OWNER,
    ErrorCode.OVERLOADED,
    ErrorCode.LANE_FAILED,
}

# Values as msgpack carries them, deltaflow's extension types included.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=24),
    st.binary(max_size=24),
    st.datetimes(timezones=st.just(dt.UTC)),
    st.datetimes(),
    st.dates(),
    st.decimals(
        allow_nan=False, allow_infinity=False, places=4, min_value=-(10**12), max_value=10**12
    ),
)
# Maps inside items and frame values may have any scalar msgpack can key a map with.
item_keys = st.one_of(
    st.text(max_size=8),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.binary(max_size=8),
)
item_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(item_keys, inner, max_size=6),
    max_leaves=24,
)
frame_values = item_values
# Hostile structures: anything msgpack can build, foreign extension types included.
ext_types = st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=24))
hostile_values = st.recursive(
    scalars | ext_types,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(
            item_keys | st.lists(st.integers(-5, 5), max_size=2).map(tuple), inner, max_size=6
        )
    ),
    max_leaves=24,
)

_BY_TYPE: dict[type, st.SearchStrategy[Any]] = {
    str: st.text(max_size=24),
    int: st.integers(-(2**63), 2**64 - 1),
    bytes: st.binary(max_size=48),
    list: st.lists(frame_values, max_size=5),
    dict: st.dictionaries(st.text(max_size=8), frame_values, max_size=5),
    bool: st.booleans(),
    type(None): st.none(),
    float: st.floats(allow_nan=False),
}
#: Field values that reach deeper into a node than random ones: open streams, the Echo
#: receiver, partitions and sequence numbers near their bounds, stream keys of any length.
ECHO = "deltaflow.testing.Echo"
_NEAR: dict[str, st.SearchStrategy[Any]] = {
    "sid": st.sampled_from(["fz-1", "fz-2"]),
    "receiver": st.sampled_from([ECHO, "deltaflow.testing.Nope"]),
    "p": st.integers(-1, 65),
    "seq": st.integers(-1, 70),
    "base": st.integers(-1, 70),
    "n": st.integers(-1, 5),
    "key": st.binary(min_size=14, max_size=66),
    "items": st.lists(item_values, max_size=4).map(lambda items: join_items(pack_items(items))),
}


def _accepts(types: tuple[type, ...], kind: type) -> bool:
    """Whether the field table's ``types`` take a value of ``kind`` (ints take no bools)."""
    if object in types:
        return True
    if kind is bool:
        return bool in types
    return any(issubclass(kind, t) for t in types)


@st.composite
def table_frames(
    draw: st.DrawFn, ftypes: st.SearchStrategy[str] | None = None
) -> tuple[dict[str, Any], bool]:
    """A frame of a type in the field table (any, or one of ``ftypes``), valid, or with some
    fields of another type, missing, or not in the table; and whether it is valid."""
    ftype = draw(ftypes if ftypes is not None else st.sampled_from(sorted(protocol._FIELDS)))
    frame: dict[str, Any] = {"t": ftype}
    valid = True
    # Mostly whole frames, or one broken field, so that some reach past the decoder.
    hostility = draw(st.sampled_from([0, 1, 2]))
    broken = draw(st.sampled_from(sorted(protocol._FIELDS[ftype]))) if hostility == 1 else None
    for name, types in protocol._FIELDS[ftype].items():
        field, optional = name.rstrip("?"), name.endswith("?")
        choice = "good"
        if hostility == 2 or name == broken:
            choice = draw(st.sampled_from(["good", "bad", "missing"]))
        wrong = [kind for kind in _BY_TYPE if not _accepts(types, kind)]
        if choice == "missing":
            valid = valid and optional
        elif choice == "bad" and wrong:
            frame[field] = draw(st.one_of([_BY_TYPE[kind] for kind in wrong]))
            valid = False
        else:
            right = [_BY_TYPE[kind] for kind in _BY_TYPE if _accepts(types, kind)]
            near = [_NEAR[field]] if field in _NEAR else []
            frame[field] = draw(
                st.one_of(*near, *(right if object not in types else [frame_values]))
            )
    if hostility and draw(st.integers(0, 9)) == 0:
        known = {name.rstrip("?") for name in protocol._FIELDS[ftype]} | {"t"}
        frame[draw(st.text(max_size=6).filter(lambda name: name not in known))] = 1
        valid = False
    return frame, valid


def within_bound(peak: list[int], data: bytes) -> bool:
    return peak[0] <= BYTES_PER_WIRE_BYTE * len(data) + 256 * 1024


def decode_everywhere(data: bytes) -> None:
    """Run every decoder over ``data``: only ProtocolError may come out, within the bound."""
    for decode in (
        lambda: decode_frames(data, max_bytes=FRAME_LIMIT),
        lambda: decode_hello(data),
        lambda: unpack_items(data, 1, max_bytes=FRAME_LIMIT),
        lambda: unpack_items(data, 7, max_bytes=FRAME_LIMIT),
    ):
        with allocation_peak() as peak, contextlib.suppress(ProtocolError):
            decode()
        assert within_bound(peak, data), f"{peak[0]} bytes allocated for {len(data)} bytes"


@given(st.binary(max_size=4096))
def test_arbitrary_bytes_only_ever_raise_protocol_errors(data: bytes) -> None:
    decode_everywhere(data)


@given(hostile_values)
def test_arbitrary_msgpack_structures_only_ever_raise_protocol_errors(value: Any) -> None:
    decode_everywhere(msgpack.packb(value, datetime=True, default=protocol._pack_default))
    if isinstance(value, dict):  # a map is where a frame starts
        decode_everywhere(msgpack.packb({"t": "batch", **value}, default=protocol._pack_default))


@given(table_frames())
def test_frames_of_every_type_are_taken_exactly_when_the_table_allows_them(
    drawn: tuple[dict[str, Any], bool],
) -> None:
    frame, valid = drawn
    data = encode_frame(frame)
    if valid:
        assert decode_frame(data) == frame
        assert decode_frames(data + data) == [frame, frame]
    else:
        with pytest.raises(ProtocolError):
            decode_frame(data)


@given(st.lists(item_values, max_size=10), st.integers(-3, 3))
def test_valid_batches_round_trip_and_a_wrong_count_is_refused(items: list[Any], lie: int) -> None:
    blob = join_items(pack_items(items))
    assert unpack_items(blob, len(items)) == items
    if lie:
        with pytest.raises(ProtocolError):
            unpack_items(blob, len(items) + lie)


#: msgpack headers with a length of their own: array, map, str, bin, ext (16 and 32 bits).
_LENGTH_HEADERS = [
    (b"\xdc", 2), (b"\xdd", 4), (b"\xde", 2), (b"\xdf", 4), (b"\xda", 2), (b"\xdb", 4),
    (b"\xc5", 2), (b"\xc6", 4), (b"\xc8", 2), (b"\xc9", 4),
]  # fmt: skip


@given(
    st.sampled_from(_LENGTH_HEADERS),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=64),
    st.booleans(),
)
def test_extreme_declared_lengths_allocate_nothing_for_them(
    header: tuple[bytes, int], length: int, tail: bytes, in_a_frame: bool
) -> None:
    code, size = header
    raw = code + (length % (1 << (8 * size))).to_bytes(size, "big") + tail
    if in_a_frame:  # the same as the ``args`` of an open frame
        raw = (
            b"\x84"
            + b"".join(msgpack.packb(v) for v in ("t", "open", "sid", "s", "receiver", "r", "args"))
            + raw
        )
    decode_everywhere(raw)


# --- against a live node ---------------------------------------------------------------------


@dataclass
class Fuzzed:
    node: Node
    session: aiohttp.ClientSession
    client: deltaflow.Client

    @property
    def url(self) -> str:
        return f"http://{self.node.address}{WS_PATH}"

    async def still_serving(self) -> None:
        """``/healthz`` within a second, and a real client's row streamed through."""
        started = time.monotonic()
        async with self.session.get(f"http://{self.node.address}/healthz") as answer:
            assert answer.status == 200
        assert time.monotonic() - started < 1.0, "/healthz took over a second"
        summary = await self.client.stream_data(
            [{"i": 1}], key="i", receiver="deltaflow.testing.Echo"
        )
        assert summary.items_acked == 1


@pytest.fixture
async def fuzzed(warehouse: Path, start_cluster: StartCluster) -> AsyncIterator[Fuzzed]:
    (node,) = await start_cluster(
        warehouse,
        count=1,
        engine="delta-rs",
        token=TOKEN,
        max_frame_bytes=FRAME_LIMIT,
        header_timeout=HEADER_TIMEOUT,
    )
    async with (
        aiohttp.ClientSession() as session,
        deltaflow.connect([node.address], token=TOKEN) as client,
    ):
        yield Fuzzed(node, session, client)


_GOOD_HELLO = {"t": "hello", "v": [1], "caps": [], "client": "fuzzer", "token": TOKEN}


def mostly(good: Any, hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.just(good), st.just(good), st.just(good), hostile)


@st.composite
def echo_batches(draw: st.DrawFn) -> bytes:
    """A batch for the stream ``fz-1`` that the Echo receiver may take, or a count off."""
    items = draw(st.lists(item_values, max_size=4))
    frame = {
        "t": "batch",
        "sid": "fz-1",
        "p": draw(st.integers(0, 3)),
        "seq": draw(mostly(0, st.integers(1, 3))),
        "base": 0,
        "n": draw(mostly(len(items), st.integers(-1, 6))),
        "items": join_items(pack_items(items)),
    }
    return encode_frame(frame)


hello_maps = st.fixed_dictionaries(
    {
        "t": mostly("hello", st.sampled_from(["open", "welcome"]) | st.text(max_size=8)),
        "v": mostly([1], st.lists(st.integers(-1, 3) | frame_values, max_size=4)),
        "caps": mostly(
            list(protocol.CAPABILITIES),
            st.lists(st.sampled_from(protocol.CAPABILITIES) | frame_values, max_size=4),
        ),
        "client": mostly(
            "fuzzer-1", st.sampled_from(["a\nb", "", "x" * 65]) | st.text(max_size=70)
        ),
        "token": st.sampled_from([TOKEN, TOKEN, "wrong", "", None]) | st.text(max_size=12),
    },
)
#: A first message: a hello-like map, any bytes, text, or a hello padded past the limits.
hello_messages = (hello_maps | table_frames(st.just("hello")).map(lambda drawn: drawn[0])).map(
    lambda hello: (hello, encode_frame(hello))
)
first_messages = st.one_of(
    hello_messages,
    hello_messages,
    hello_messages,
    st.binary(max_size=5000).map(lambda data: (None, data)),
    st.text(max_size=64).map(lambda text: (None, text)),
    st.integers(MAX_HELLO_BYTES - 80, FRAME_LIMIT + 1024).map(
        lambda n: ({"token": TOKEN}, encode_frame({**_GOOD_HELLO, "client": "x" * n}))
    ),
)


def heads_of_lanes(frames: list[bytes]) -> set[int]:
    """The partitions of the batches among ``frames`` that head a lane of ``fz-1`` (seq 0):
    the node answers each at once, with an ack or an error."""
    heads = set()
    for data in frames:
        with contextlib.suppress(Exception):
            frame = msgpack.unpackb(data, strict_map_key=False)
            if isinstance(frame, dict) and frame.get("t") == "batch":
                if (
                    frame.get("sid") == "fz-1"
                    and frame.get("seq") == 0
                    and frame.get("p") in range(4)
                ):
                    heads.add(frame["p"])
    return heads


async def answers(
    ws: aiohttp.ClientWebSocketResponse, heads: set[int]
) -> tuple[list[dict[str, Any]], int | None]:
    """The frames the node sends until it answered the sentinel and the batches heading
    ``heads``, or closed (then its close code)."""
    frames: list[dict[str, Any]] = []
    waiting = {("sentinel", None), *(("fz-1", p) for p in heads)}
    while waiting:
        msg = await ws.receive(timeout=10)
        if msg.type != aiohttp.WSMsgType.BINARY:
            return frames, ws.close_code
        for frame in decode_frames(msg.data):
            frames.append(frame)
            if frame["t"] in ("ack", "error"):
                waiting.discard((frame.get("sid"), frame.get("p")))
    return frames, None


@settings(max_examples=NODE_EXAMPLES)
@given(first=first_messages)
async def test_a_node_answers_hostile_hellos_with_a_documented_error(
    fuzzed: Fuzzed, first: tuple[dict[str, Any] | None, bytes | str]
) -> None:
    hello, data = first
    async with fuzzed.session.ws_connect(fuzzed.url, max_msg_size=1 << 20) as ws:
        await (ws.send_str(data) if isinstance(data, str) else ws.send_bytes(data))
        msg = await ws.receive(timeout=10)
        if msg.type == aiohttp.WSMsgType.BINARY:
            assert len(msg.data) < 1024, "the answer to a hello echoes what the hello carried"
            (answer,) = decode_frames(msg.data)
        else:  # aiohttp refuses a message over the frame limit before the node reads it
            assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG, msg
            answer = None
    with_token = hello is not None and hello.get("token") == TOKEN
    event(f"answer: {answer and answer.get('code', answer['t'])}")
    if answer is not None and answer["t"] == "welcome":
        assert with_token, f"a hello without the token was welcomed: {hello!r}"
    elif answer is not None:
        assert answer["t"] == "error" and answer["code"] in HELLO_CODES, answer
        if answer["code"] == ErrorCode.UNSUPPORTED_VERSION:
            assert with_token, "the version was looked at before the token"
    await fuzzed.still_serving()


@settings(max_examples=NODE_EXAMPLES)
@given(
    frames=st.lists(
        st.one_of(
            echo_batches(),
            echo_batches(),
            table_frames(mostly("batch", st.sampled_from(["open", "close"]))).map(
                lambda drawn: encode_frame(drawn[0])
            ),
            table_frames().map(lambda drawn: encode_frame(drawn[0])),
            hostile_values.map(lambda v: msgpack.packb(v, default=protocol._pack_default)),
            st.binary(max_size=512),
        ),
        min_size=1,
        max_size=4,
    ),
    joined=st.booleans(),
    opens_first=st.booleans(),
)
async def test_a_node_answers_hostile_frames_of_a_client_with_a_documented_error(
    fuzzed: Fuzzed, frames: list[bytes], joined: bool, opens_first: bool
) -> None:
    key = {"key": b"k" * 32} if "key" in protocol._FIELDS["open"] else {}
    sentinel = {"t": "open", "sid": "sentinel", "receiver": "no.such.Receiver", **key}
    if opens_first:  # a stream the batches that follow may feed
        frames = [encode_frame({"t": "open", "sid": "fz-1", "receiver": ECHO, **key}), *frames]
    async with fuzzed.session.ws_connect(fuzzed.url, max_msg_size=1 << 24) as ws:
        await ws.send_bytes(encode_frame(_GOOD_HELLO))
        welcome = decode_frame((await ws.receive(timeout=10)).data)
        assert welcome["t"] == "welcome"
        # A frame that ends the connection may make the later sends fail: what counts is
        # what the node answered.
        with contextlib.suppress(ConnectionResetError):
            for data in [b"".join(frames)] if joined else frames:
                await ws.send_bytes(data)
            await ws.send_bytes(encode_frame(sentinel))  # answered once all before are read
        received, closed = await answers(ws, heads_of_lanes(frames))
    for frame in received:
        if frame.get("sid") != "sentinel":
            event(f"answer: {frame.get('code', frame['t'])}")
        assert frame["t"] in ("ack", "result", "opened", "error", "map"), frame
        if frame["t"] == "error" and frame.get("sid") != "sentinel":
            assert frame["code"] in FRAME_CODES, frame
    if closed is not None:  # a connection-level refusal: documented close codes only
        assert closed in (
            aiohttp.WSCloseCode.PROTOCOL_ERROR,
            aiohttp.WSCloseCode.MESSAGE_TOO_BIG,
        ), closed
    await fuzzed.still_serving()


# --- the upgrade request and half-sent requests (issue 47) -------------------------------

#: What a node may answer an upgrade request of any shape (docs/protocol.md, "Handshake"; 200:
#: another endpoint's, such as the status page at ``/``).
UPGRADE_STATUSES = {101, 200, 400, 401, 404, 405, 426, 431, 503}
#: Examples of half-sent requests: each waits out the header timeout.
HALF_SENT_EXAMPLES = 10 if settings().max_examples <= 150 else 200
_UPGRADE_HEADERS = (
    "authorization",
    "host",
    "upgrade",
    "connection",
    "sec-websocket-key",
    "sec-websocket-version",
    "content-length",
    "transfer-encoding",
)
_printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=64)
_header_lines = st.lists(
    st.tuples(
        st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,20}", fullmatch=True).filter(
            lambda name: name.lower() not in _UPGRADE_HEADERS
        ),
        _printable,
    ).map(lambda kv: f"{kv[0]}: {kv[1]}\r\n".encode())
    | st.binary(max_size=40).map(lambda raw: raw + b"\r\n"),  # any bytes, CR and LF too
    max_size=5,
)
_authorizations = st.one_of(
    st.none(),
    st.just(f"Bearer {TOKEN}"),
    st.sampled_from(
        ["Bearer wrong", "Bearer ", f"bearer {TOKEN}", f"Basic {TOKEN}", f" Bearer {TOKEN} "]
    ),
    _printable,
)


@st.composite
def upgrade_requests(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """A WebSocket upgrade request of ``/v1/stream``, mostly well formed: its bytes and its
    ``Authorization`` value (None: none)."""
    method = draw(mostly("GET", st.sampled_from(["POST", "HEAD", "PUT", "G\x00T"])))
    path = draw(
        mostly(
            WS_PATH,
            st.sampled_from([f"{WS_PATH}/", f"{WS_PATH}?x=1", "/v1/Stream", "/", "*"])
            | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30),
        )
    )
    version = draw(mostly("HTTP/1.1", st.sampled_from(["HTTP/1.0", "HTTP/2", "HTTP/9.9"])))
    auth = draw(_authorizations)
    key = base64.b64encode(os.urandom(16)).decode()
    head = [f"{method} {path} {version}\r\n".encode(), b"Host: fuzz\r\n"]
    head += [
        draw(mostly(f"{name}: {value}\r\n".encode(), st.just(b"")))
        for name, value in (
            ("Upgrade", "websocket"),
            ("Connection", "Upgrade"),
            ("Sec-WebSocket-Version", "13"),
            ("Sec-WebSocket-Key", key),
        )
    ]
    if auth is not None:
        head.append(f"Authorization: {auth}\r\n".encode())
    lines = draw(_header_lines)
    head[2:2] = lines  # among the others
    return b"".join(head) + b"\r\n", auth


def ws_frame(data: bytes) -> bytes:
    """A masked (zero mask) binary WebSocket frame, as a client sends it."""
    return b"\x82\xff" + len(data).to_bytes(8, "big") + b"\0\0\0\0" + data


async def ws_message(reader: asyncio.StreamReader) -> bytes:
    """One unfragmented server frame's payload."""
    size = (await reader.readexactly(2))[1] & 0x7F
    if size >= 126:
        size = int.from_bytes(await reader.readexactly(2 if size == 126 else 8), "big")
    return bytes(await reader.readexactly(size))


@settings(max_examples=NODE_EXAMPLES)
@given(request=upgrade_requests())
async def test_a_node_answers_hostile_upgrade_requests_as_documented(
    fuzzed: Fuzzed, request: tuple[bytes, str | None]
) -> None:
    """Random methods, paths, headers and tokens on the WebSocket upgrade: a documented
    status, never an upgrade for a wrong token, and the hello still checked after one."""
    data, auth = request
    host, port = fuzzed.node.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        except asyncio.IncompleteReadError:  # closed unanswered: a request it could not parse
            status = None
        else:
            status = int(head.split(b" ", 2)[1])
        event(f"status {status}")
        assert status is None or status in UPGRADE_STATUSES, head
        proven = auth is not None and auth.strip(" \t") == f"Bearer {TOKEN}"
        if status == 101:
            assert auth is None or proven, f"upgraded with Authorization {auth!r}"
            writer.write(ws_frame(encode_frame(_GOOD_HELLO)))
            welcome = decode_frame(await asyncio.wait_for(ws_message(reader), 10))
            assert welcome["t"] == "welcome", welcome
        if status == 401:
            assert auth is not None and not proven, auth
    finally:
        writer.transport.abort()
    await fuzzed.still_serving()


@st.composite
def half_sent_requests(draw: st.DrawFn) -> bytes:
    """The start of a request whose headers never end: of ``/healthz``, a peer call or an
    upgrade, with headers of any shape, cut anywhere before its blank line."""
    target = draw(
        st.sampled_from(
            [
                b"GET /healthz HTTP/1.1\r\nHost: x\r\n",
                b"POST /v1/peer/poll HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n",
                f"GET {WS_PATH} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\n".encode(),
            ]
        )
    )
    lines = draw(
        st.lists(_printable.map(lambda value: f"X-Fuzz: {value}\r\n".encode()), max_size=4)
    )
    whole = target + b"".join(lines) + b"\r\n"
    return whole[: draw(st.integers(0, len(whole) - 1))]


@settings(max_examples=HALF_SENT_EXAMPLES)
@given(requests=st.lists(half_sent_requests(), min_size=1, max_size=8))
async def test_a_node_closes_half_sent_requests_within_the_header_timeout(
    fuzzed: Fuzzed, requests: list[bytes]
) -> None:
    host, port = fuzzed.node.address.rsplit(":", 1)
    opened = [await asyncio.open_connection(host, int(port)) for _ in requests]
    started = time.monotonic()
    try:
        for (_, writer), data in zip(opened, requests, strict=True):
            writer.write(data)

        async def answer(reader: asyncio.StreamReader) -> bytes:
            with contextlib.suppress(ConnectionResetError):
                return await reader.read()  # until the node closes it
            return b""

        answers = await asyncio.wait_for(
            asyncio.gather(*(answer(reader) for reader, _ in opened)), HEADER_TIMEOUT + 5
        )
    finally:
        for _, writer in opened:
            writer.transport.abort()
    took = time.monotonic() - started
    assert took < HEADER_TIMEOUT + 1.0, f"closed after {took:.1f} s"
    for data in answers:
        event(f"answer {data[:12]!r}")
        assert data == b"" or data.startswith((b"HTTP/1.1 408 ", b"HTTP/1.1 400 ")), data
    await fuzzed.still_serving()


# --- the commit endpoint (issue 47) --------------------------------------------------------

PEER_TOKEN = "fuzz-peer-token"
#: What ``POST /v1/peer/commit`` may answer a caller without the peer token or a node's key.
COMMIT_STATUSES = {400, 401, 403, 404, 411, 413}
_COMMIT_HEADERS = (
    "X-Deltaflow-Node",
    "X-Deltaflow-Address",
    "X-Deltaflow-Nonce",
    "X-Deltaflow-Challenge",
    "X-Deltaflow-Call-Proof",
    "X-Deltaflow-Digest",
    "X-Deltaflow-Signature",
)
_header_values = st.one_of(
    st.sampled_from(["node-1", "node-2", "127.0.0.1:1", "0" * 32, "0" * 64, "f" * 128, ""]),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=200),
)


class Bomb(int):
    """A body of ``[{},{},...]``, built in the test (hypothesis would print it whole)."""

    def __bytes__(self) -> bytes:
        return b"[" + b"{}," * int(self) + b"{}]"


_commit_bodies = st.one_of(
    st.binary(max_size=2048),
    hostile_values.map(lambda v: repr(v).encode()),
    st.integers(1, 300_000).map(lambda n: Bomb(n)),  # [{},{},...]: n empty objects
    st.just(b'{"table": "t", "writer": "node-1", "read_version": 0, "actions": []}'),
)


@pytest.fixture
async def peer_node(warehouse: Path, start_cluster: StartCluster) -> AsyncIterator[Fuzzed]:
    (node,) = await start_cluster(
        warehouse, count=1, engine="delta-rs", token=TOKEN, peer_token=PEER_TOKEN
    )
    async with (
        aiohttp.ClientSession() as session,
        deltaflow.connect([node.address], token=TOKEN) as client,
    ):
        yield Fuzzed(node, session, client)


@settings(max_examples=NODE_EXAMPLES)
@given(
    headers=st.dictionaries(st.sampled_from(_COMMIT_HEADERS), _header_values, max_size=7),
    body=_commit_bodies,
    challenged=st.booleans(),
    length=st.sampled_from([None, "0", "9000000"]),
)
async def test_a_node_answers_hostile_commit_calls_with_a_refusal(
    peer_node: Fuzzed,
    headers: dict[str, str],
    body: bytes | Bomb,
    challenged: bool,
    length: str | None,
) -> None:
    """Random headers and bodies at ``POST /v1/peer/commit``, with or without a fresh
    challenge: never a 500, never a crash, the node's memory bounded and still serving."""
    url = f"http://{peer_node.node.address}/v1/peer/commit"
    data = bytes(body)
    if challenged:  # a real challenge, so the checks past it are reached too
        async with peer_node.session.post(url, data=b"") as resp:
            headers["X-Deltaflow-Challenge"] = (await resp.json())["challenge"]
    if length is not None:
        headers["Content-Length"] = length
    with contextlib.suppress(aiohttp.ClientError):  # a length that lies may cut the call
        async with peer_node.session.post(url, data=data, headers=headers) as resp:
            event(f"status {resp.status}")
            assert resp.status in COMMIT_STATUSES, (resp.status, await resp.text())
            assert len(await resp.read()) < 1024
    await peer_node.still_serving()
