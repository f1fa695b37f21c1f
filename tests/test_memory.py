"""Client memory is bounded by its options, not by the stream's length."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from deltaflow.testing import NodeProcess

CLIENT = """
import asyncio, sys
import deltaflow

def items(n):
    for i in range(n):
        yield {"i": i, "payload": "x" * 64}

async def main(address, n):
    async with deltaflow.connect([address]) as client:
        summary = await client.stream_data(
            items(n), key=lambda r: r["i"], receiver="deltaflow.testing.Discard"
        )
    assert summary.items_acked == n, summary
    # VmHWM: this program's peak RSS (ru_maxrss would include the forking parent's memory).
    with open("/proc/self/status") as status:
        hwm = next(line for line in status if line.startswith("VmHWM:"))
    print(int(hwm.split()[1]) // 1024)  # MiB

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

BOUND_MIB = 250  # default options: 128 batches of 1,000 items in flight, 64 partition buffers


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_five_million_items_stream_in_bounded_client_memory(warehouse: Path) -> None:
    node = await NodeProcess(
        "mem", warehouse, extra=["--engine", "delta-rs", "--receiver", "deltaflow.testing.Discard"]
    ).start()
    try:
        peaks = {}
        for n in (200_000, 5_000_000):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                CLIENT,
                node.address,
                str(n),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()[-2000:]
            peaks[n] = int(out.split()[-1])
    finally:
        await node.stop()
    print(f"\nclient peak RSS: {peaks} MiB")  # noqa: T201
    assert peaks[5_000_000] < BOUND_MIB
    # 25x the items, about the same memory: nothing grows with the stream.
    assert peaks[5_000_000] < peaks[200_000] * 1.3 + 10
