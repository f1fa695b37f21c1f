"""Arrow pages are read within bounds (issue 36, findings 4 and 8): a page that would inflate,
that holds more rows than its frame says, or whose buffers are malformed is refused with
``BAD_FRAME`` before a receiver sees it, without the node allocating what the page claims, and
the node keeps serving meanwhile.

The node tests send raw frames over a WebSocket, as an attacker holding a client's credentials
would, to a ``deltaflow serve`` process of its own: its memory is measured from ``/proc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pyarrow as pa
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltaflow
from deltaflow import DELETE_COLUMN, StreamerOptions
from deltaflow.columnar import PAGE_LIMITS, decode_page
from deltaflow.errors import ProtocolError
from deltaflow.protocol import WS_PATH, decode_frame, encode_frame
from deltaflow.testing import NodeProcess

from .support import read_delta

TABLE_RECEIVER = "deltaflow.receivers.TableUpsert"
MiB = 1024 * 1024
#: What the inflating page expands to: enough that a node that inflates it cannot hide it.
INFLATED = 256 * MiB


# -- pages ---------------------------------------------------------------------------------


def ipc(*batches: pa.RecordBatch, **options: Any) -> bytes:
    """``batches`` as one Arrow IPC stream, written with ``IpcWriteOptions(**options)``."""
    sink = pa.BufferOutputStream()
    writer_options = pa.ipc.IpcWriteOptions(**options)
    with pa.ipc.new_stream(sink, batches[0].schema, options=writer_options) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return bytes(sink.getvalue().to_pybytes())


def messages(stream: bytes) -> list[Any]:
    return list(pa.ipc.MessageReader.open_stream(pa.py_buffer(stream)))


def spliced(*parts: Any) -> bytes:
    """IPC messages (``pyarrow.ipc.Message``) joined into one stream, with its end marker."""
    return b"".join(m.serialize().to_pybytes() for m in parts) + b"\xff\xff\xff\xff\0\0\0\0"


def rows(count: int, start: int = 0) -> pa.RecordBatch:
    """``count`` rows as the client pages them: key, a value, the delete column."""
    ids = pa.array(range(start, start + count), pa.int64())
    names = pa.array([f"name-{i}" for i in range(start, start + count)])
    flags = pa.array([False] * count)
    return pa.record_batch([ids, names, flags], names=["id", "name", DELETE_COLUMN])


def inflating(size: int, key: int = 1) -> pa.RecordBatch:
    """One row whose ``blob`` is ``size`` zero bytes. ``np.zeros`` maps pages it never writes,
    so building and compressing it costs this process no memory."""
    blob = pa.Array.from_buffers(
        pa.large_binary(),
        1,
        [None, pa.py_buffer(np.array([0, size], np.int64)), pa.py_buffer(np.zeros(size, np.uint8))],
    )
    return pa.record_batch(
        [pa.array([key], pa.int64()), blob, pa.array([False])], names=["id", "blob", DELETE_COLUMN]
    )


def garbled(count: int = 2) -> bytes:
    """``count`` rows whose string offsets point 1 MiB past a 5-byte buffer: pyarrow's reader
    takes it; only a full validation refuses it (a table engine writing it read out of
    bounds and killed the node)."""
    offsets = struct.pack(f"<{count + 1}i", 0, *[MiB] * (count - 1), 5)
    text = pa.Array.from_buffers(
        pa.string(), count, [None, pa.py_buffer(offsets), pa.py_buffer(b"hello")]
    )
    ids = pa.array(range(count), pa.int64())
    return ipc(
        pa.record_batch([ids, text, pa.array([False] * count)], ["id", "name", DELETE_COLUMN])
    )


@contextlib.contextmanager
def arrow_memory() -> Iterator[Callable[[], int]]:
    """The peak of what pyarrow allocates inside the block, in bytes (through a pool of its
    own, made the default for the block)."""
    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)
    pa.set_memory_pool(pool)
    try:
        yield pool.max_memory
    finally:
        pa.set_memory_pool(default)


# -- the page decoder ----------------------------------------------------------------------


def test_a_compressed_page_is_refused_before_pyarrow_inflates_it() -> None:
    page = ipc(inflating(64 * MiB), compression="zstd")
    assert len(page) < 10_000
    with arrow_memory() as peak, pytest.raises(ProtocolError) as caught:
        decode_page(page, 1)
    assert "record batch 0 is compressed: send pages uncompressed" in str(caught.value)
    assert peak() < MiB


def test_rows_past_n_are_refused_at_the_batch_that_passes_n() -> None:
    """The row cap runs as the batches come: a page of the frame's one row, then a compressed
    batch of another, is refused at the second, before its body is inflated."""
    plain = messages(ipc(inflating(16)))
    bomb = messages(ipc(inflating(64 * MiB), compression="zstd"))
    page = spliced(plain[0], plain[1], bomb[1])
    with arrow_memory() as peak, pytest.raises(ProtocolError) as caught:
        decode_page(page, 1)
    assert str(caught.value) == "'arrow' holds more than 1 rows (the frame's n)"
    assert peak() < MiB


def nested(depth: int) -> pa.DataType:
    kind: pa.DataType = pa.int8()
    for _ in range(depth):
        kind = pa.list_(kind)
    return kind


def with_delta() -> bytes:
    """A dictionary column whose second batch brings a dictionary delta."""
    first = pa.DictionaryArray.from_arrays(pa.array([0]), pa.array(["a"]))
    second = pa.DictionaryArray.from_arrays(pa.array([1]), pa.array(["a", "b"]))
    return ipc(
        pa.record_batch([first], ["d"]),
        pa.record_batch([second], ["d"]),
        emit_dictionary_deltas=True,
    )


def a_field_with(metadata: dict[str, str]) -> bytes:
    field = pa.field("x", pa.int8(), metadata=metadata)
    return ipc(pa.record_batch([pa.array([1], pa.int8())], schema=pa.schema([field])))


def patched(page: bytes, old: bytes, new: bytes) -> bytes:
    assert page.count(old) == 1, f"{old!r} is not in the page exactly once"
    return page.replace(old, new)


def excess_variadic_buffers() -> bytes:
    """A string-view column whose metadata says it has 2**26 data buffers (it has 3). pyarrow
    21 reserves 16 bytes for each before checking (apache/arrow#48900): here 1 GiB; 2**30 of
    them took a process to 16 GiB for 31 s, and 2**31 - 1 aborted it on std::bad_alloc."""
    views = pa.py_buffer(struct.pack("<i4s8x", 3, b"abc"))  # one inline string, "abc"
    data = [pa.py_buffer(b) for b in (b"x", b"y", b"z")]
    strings = pa.Array.from_buffers(pa.string_view(), 1, [None, views, *data])
    page = ipc(pa.record_batch([strings], ["s"]))
    # The flatbuffer vector of variadic buffer counts: its length (1), then the count (3).
    return patched(page, struct.pack("<Iq", 1, 3), struct.pack("<Iq", 1, 2**26))


MALFORMED: dict[str, tuple[Callable[[], bytes], int, str]] = {
    "offsets past the data": (garbled, 2, "record batch 0 is malformed: In column 1"),
    "invalid UTF-8": (
        lambda: ipc(
            pa.record_batch(
                [
                    pa.Array.from_buffers(
                        pa.string(),
                        1,
                        [None, pa.py_buffer(b"\0\0\0\0\2\0\0\0"), pa.py_buffer(b"\xff\xfe")],
                    )
                ],
                ["s"],
            )
        ),
        1,
        "record batch 0 is malformed",
    ),
    "dictionary index out of range": (
        lambda: ipc(
            pa.record_batch(
                [pa.DictionaryArray.from_arrays(pa.array([7]), pa.array(["a"]), safe=False)],
                ["d"],
            )
        ),
        1,
        "record batch 0 is malformed",
    ),
    "a repeated column name": (
        lambda: ipc(pa.record_batch([pa.array([1]), pa.array([2])], ["a", "a"])),
        1,
        "repeats column names: ['a']",
    ),
    "two delete columns": (
        lambda: ipc(pa.record_batch([pa.array([True]), pa.array([False])], [DELETE_COLUMN] * 2)),
        1,
        f"repeats column names: [{DELETE_COLUMN!r}]",
    ),
    "a registered extension type": (
        lambda: ipc(pa.record_batch([pa.array([b"0" * 16], pa.uuid())], ["u"])),
        1,
        "field 'u' has the extension type 'arrow.uuid'",
    ),
    "extension metadata": (
        lambda: a_field_with({"ARROW:extension:name": "app.pickled"}),
        1,
        "field 'x' has the extension type 'app.pickled'",
    ),
    "a dictionary delta": (with_delta, 2, "dictionary 1 is a dictionary delta"),
    "excess variadic buffers": (excess_variadic_buffers, 1, "variadic buffer counts [67108864]"),
    "a name that is not UTF-8": (
        lambda: patched(ipc(pa.record_batch([pa.array([1])], ["zzzz"])), b"zzzz", b"\xff\xfezz"),
        1,
        "schema is refused: 'utf-8' codec can't decode",
    ),
    "an unknown time zone": (
        lambda: ipc(pa.record_batch([pa.array([0], pa.timestamp("us", "Mars/Olympus"))], ["t"])),
        1,
        "field 't': unknown time zone",
    ),
    "a negative decimal scale": (
        lambda: ipc(pa.record_batch([pa.array([0], pa.decimal128(5, -2))], ["d"])),
        1,
        "field 'd': a decimal scale out of range",
    ),
    "too many batches": (
        lambda: ipc(*[rows(1, i) for i in range(PAGE_LIMITS.batches + 1)]),
        PAGE_LIMITS.batches + 1,
        f"more than {PAGE_LIMITS.batches} batches",
    ),
    "nulls beyond a bit per byte": (
        lambda: ipc(pa.record_batch([pa.nulls(10**6)], ["x"])),
        10**6,
        "record batch 0 declares an array of 1000000 values",
    ),
    "too deep": (
        lambda: ipc(pa.record_batch([pa.nulls(1, nested(PAGE_LIMITS.depth))], ["x"])),
        1,
        f"nests fields deeper than {PAGE_LIMITS.depth} levels",
    ),
    "too many fields": (
        lambda: ipc(
            pa.record_batch(
                [pa.nulls(1)] * (PAGE_LIMITS.fields + 1),
                [f"c{i}" for i in range(PAGE_LIMITS.fields + 1)],
            )
        ),
        1,
        f"declares more than {PAGE_LIMITS.fields} fields",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_page_is_a_protocol_error_naming_what_is_wrong(case: str) -> None:
    build, n, says = MALFORMED[case]
    with pytest.raises(ProtocolError) as caught:
        decode_page(build(), n)
    assert says in str(caught.value)
    assert len(str(caught.value)) < 400  # the page's content is not echoed back


VALID = ipc(
    pa.record_batch(
        [
            pa.array(range(20), pa.int64()),
            pa.array([f"é{i}" * (i % 4) for i in range(20)]),
            pa.array(["x", "y"] * 10).dictionary_encode(),
            pa.array([[i, None] for i in range(20)], pa.list_(pa.int32())),
            pa.array([{"a": i, "b": [str(i)]} for i in range(20)]),
            pa.array([f"a string view of {i}" for i in range(20)], pa.string_view()),
            pa.array(range(20), pa.timestamp("us", "Europe/Paris")),
            pa.array(range(20), pa.decimal128(10, 2)),
            pa.array([i % 3 == 0 for i in range(20)]),
        ],
        ["id", "name", "kind", "pair", "nested", "view", "at", "amount", DELETE_COLUMN],
    )
)


#: Corrupted pages per run: ``make fuzz`` (``HYPOTHESIS_PROFILE=fuzz``) tries many more.
CORRUPTIONS = 20_000 if os.environ.get("HYPOTHESIS_PROFILE") == "fuzz" else 400


@settings(
    max_examples=CORRUPTIONS,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=6
    ),
    cut=st.one_of(st.none(), st.integers(0, len(VALID))),
)
def test_a_corrupted_page_is_refused_or_read_whole_and_valid(
    edits: list[tuple[int, int]], cut: int | None
) -> None:
    """Whatever bytes of a page change (metadata or bodies), and wherever it is cut, the
    decoder refuses it with a ProtocolError or returns the rows the frame says, fully valid:
    nothing else escapes."""
    page = bytearray(VALID)
    for at, value in edits:
        page[at] = value
    try:
        got = decode_page(bytes(page[:cut]), 20)
    except ProtocolError:
        return
    assert len(got) == 20
    got.table.validate(full=True)


# -- a node under attack -------------------------------------------------------------------


def memory_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        line = next(x for x in status if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def reset_peak(pid: int) -> None:
    """Start the process's peak RSS (VmHWM) again from its current RSS."""
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as refs:
        refs.write("5")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[NodeProcess]:
    warehouse = tmp_path_factory.mktemp("arrow-bounds") / "warehouse"
    extra = ["--engine", "delta-rs", "--receiver", "deltaflow.testing.Discard"]
    started = await NodeProcess("bounds", warehouse, extra=extra).start()
    yield started
    await started.stop()


class Wire:
    """One raw client connection: frames written by hand, answers read one by one."""

    def __init__(self, session: aiohttp.ClientSession, ws: Any) -> None:
        self.session = session
        self.ws = ws

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, address: str) -> AsyncIterator[Wire]:
        async with aiohttp.ClientSession() as session:
            ws = await session.ws_connect(f"http://{address}{WS_PATH}", max_msg_size=1 << 24)
            wire = cls(session, ws)
            welcome = await wire.call({"t": "hello", "v": [1], "caps": [], "client": "raw"})
            assert welcome["t"] == "welcome", welcome
            yield wire
            await ws.close()

    async def call(self, frame: dict[str, Any]) -> dict[str, Any]:
        await self.ws.send_bytes(encode_frame(frame))
        msg = await self.ws.receive()
        assert msg.type == aiohttp.WSMsgType.BINARY, f"the node closed the connection: {msg!r}"
        return decode_frame(msg.data)

    async def open(self, receiver: str, args: Any) -> str:
        sid = "bounds-" + secrets.token_hex(6)
        frame = {"t": "open", "sid": sid, "receiver": receiver, "args": args}
        answer = await self.call({**frame, "key": secrets.token_bytes(32)})
        assert answer == {"t": "opened", "sid": sid}, answer
        return sid

    async def page(self, sid: str, seq: int, n: int, page: bytes) -> dict[str, Any]:
        """Send one Arrow page as batch ``seq`` of partition 0; the node's answer to it."""
        frame = {"t": "batch", "sid": sid, "p": 0, "seq": seq, "n": n, "arrow": page}
        return await self.call({**frame, "base": seq, "att": 1})


async def health_latencies(address: str, stop: asyncio.Event) -> list[float]:
    """Seconds each ``/healthz`` took, asked one after another until ``stop``."""
    took: list[float] = []
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            started = time.monotonic()
            async with session.get(f"http://{address}/healthz") as answer:
                assert answer.status == 200
            took.append(time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)  # a probe every 50 ms
    return took


async def arrow_stream(address: str, count: int) -> deltaflow.StreamSummary:
    async with deltaflow.connect([address]) as client:
        return await client.stream_data(
            [rows(100, start).drop_columns([DELETE_COLUMN]) for start in range(0, count, 100)],
            key="id",
            receiver="deltaflow.testing.Discard",
            options=StreamerOptions(page_size=50),
        )


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_an_inflating_page_is_refused_without_the_node_growing(node: NodeProcess) -> None:
    """A 256 MiB page in 10 KB, claiming one row (finding 4: 2 GB in 63 KB took the node from
    68 MB to 2.07 GB): refused at once, the node's memory flat, other clients served."""
    assert node.proc is not None
    pid = node.proc.pid
    page = ipc(inflating(INFLATED), compression="zstd")
    async with Wire.connect(node.address) as wire:
        sid = await wire.open(TABLE_RECEIVER, {"table": "inflated", "key": ["id"]})
        # A good page first: pyarrow is loaded and the table exists before measuring.
        assert (await wire.page(sid, 0, 1, ipc(inflating(16))))["t"] == "ack"
        stop = asyncio.Event()
        probes = asyncio.create_task(health_latencies(node.address, stop))
        good = asyncio.create_task(arrow_stream(node.address, 2000))
        reset_peak(pid)
        before = memory_mib(pid, "VmRSS")
        started = time.monotonic()
        answer = await asyncio.wait_for(wire.page(sid, 1, 1, page), 60)
        seconds = time.monotonic() - started
        summary = await asyncio.wait_for(good, 60)
        stop.set()
        latencies = await probes
        grown = memory_mib(pid, "VmHWM") - before
    assert len(page) < 20_000
    assert grown < 64, f"the node grew {grown:.0f} MiB on a page of {len(page)} bytes"
    assert seconds < 5, f"the node took {seconds:.1f} s to answer"
    assert answer["t"] == "error" and answer["code"] == "BAD_FRAME", answer
    assert "record batch 0 is compressed" in answer["msg"]
    assert summary.items_acked == 2000
    assert latencies and max(latencies) < 1.0, latencies


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_page_with_corrupt_offsets_is_refused_and_nothing_lands(
    node: NodeProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Finding 8: pyarrow's reader takes offsets pointing past the data; the table engine then
    read out of bounds and the node died. Validated, the page is refused and the lane goes on."""
    async with Wire.connect(node.address) as wire:
        sid = await wire.open(TABLE_RECEIVER, {"table": "garbled", "key": ["id"]})
        answer = await wire.page(sid, 0, 2, garbled())
        assert answer["t"] == "error" and answer["code"] == "BAD_FRAME", answer
        assert "Offset invariant failure" in answer["msg"]
        # The node lives, and another stream's page lands.
        other = await wire.open(TABLE_RECEIVER, {"table": "garbled", "key": ["id"]})
        assert (await wire.page(other, 0, 3, ipc(rows(3, 10))))["t"] == "ack"
    warehouse = Path(node.args[node.args.index("--warehouse") + 1])
    assert set(await asyncio.to_thread(read_delta, warehouse / "garbled")) == {10, 11, 12}
