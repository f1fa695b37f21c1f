"""Transport benchmark: deltaflow's items/s against the raw msgpack encode+decode rate.

One run measures, for every page size and ``max_in_flight`` of the grid, the items/s of one
client streaming into two nodes whose receiver does nothing (no table, no Delta), and beside it
the rate of the msgpack work client and node do per item without a network. Two layouts:
``process`` (each node a ``deltaflow serve`` process of its own, as deployed) and ``shared``
(client and both nodes in this process: one event loop, one core does everything)::

    .venv/bin/python bench/transport.py                        # the full grid, both layouts
    .venv/bin/python bench/transport.py --layout shared --items 50000
    .venv/bin/python bench/transport.py --pages 1000 --in-flight 16   # one configuration

Results go to ``bench/out/transport.json``; see ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final

DEFAULT_ITEMS: Final = 300_000
PAGE_SIZES: Final = (100, 1_000, 10_000)
IN_FLIGHT: Final = (1, 4, 16)
WARMUP_ITEMS: Final = 5_000
#: Rounds per configuration, each a raw measurement right before a deltaflow one: the machine
#: drifts (neighbours, frequency), so a ratio pairs figures taken side by side, and the
#: configuration reports its median round.
ROUNDS: Final = 3
GOAL: Final = 0.9  # deltaflow at >= 90% of the raw msgpack rate (50% until 2026-12)
SEED: Final = 20_240_601
NOOP_RECEIVER: Final = "deltaflow.testing.Discard"
LAYOUTS: Final = ("process", "shared")
OUT_DIR: Final = Path(__file__).resolve().parent / "out"
STAMP_LINE: Final = "-" * 100


# -- data ---------------------------------------------------------------------------------


def make_items(count: int) -> list[dict[str, Any]]:
    """``count`` deterministic items: ``id``, ``key``, ``ts``, ``value`` and a 100-char
    ``payload``. Generated once, before anything is timed, and shared by every measurement."""
    rng = random.Random(SEED)
    return [
        {
            "id": i,
            "key": f"k{i}",
            "ts": 1_700_000_000.0 + i / 1000,
            "value": rng.random() * 1000,
            "payload": f"{i:012d}{rng.randbytes(44).hex()}",
        }
        for i in range(count)
    ]


# -- measurement --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Raw:
    """The raw msgpack rate for one page size.

    Attributes:
        page_size: items per batch frame.
        items: items encoded and decoded.
        seconds: wall time of the whole loop.
        items_per_s: ``items / seconds``.
    """

    page_size: int
    items: int
    seconds: float
    items_per_s: float


@dataclass(frozen=True, slots=True)
class Result:
    """One configuration's row of the results table (also its JSON).

    Attributes:
        layout: ``process`` (nodes in processes of their own) or ``shared`` (in this one).
        page_size: ``StreamerOptions.page_size``.
        max_in_flight: ``StreamerOptions.max_in_flight``.
        items: items acknowledged.
        seconds: wall time of ``stream_data`` (first item pulled to last ack).
        items_per_s: deltaflow's rate.
        raw_items_per_s: the raw msgpack rate of the same page size, same run.
        ratio: ``items_per_s / raw_items_per_s``.
        batches: batches acknowledged (both nodes).
        mean_batch: ``items / batches``: below ``page_size`` when the partition buffers never
            fill and are cut by the flush timer or at the end of the stream.
        retried: batch resends (should be 0).
        ratios: every round's ratio; the row's figures are those of the median round.
    """

    layout: str
    page_size: int
    max_in_flight: int
    items: int
    seconds: float
    items_per_s: float
    raw_items_per_s: float
    ratio: float
    batches: int
    mean_batch: float
    retried: int
    ratios: tuple[float, ...] = ()


def measure_raw(items: list[dict[str, Any]], page_size: int) -> Raw:
    """What client and node do per item, without network or asyncio: pack each item, join a
    page of them into a batch blob, encode the batch frame, decode it, unpack the items."""
    from deltaflow.protocol import decode_frame, encode_frame, join_items, pack_item, unpack_items

    sid = "0" * 32
    unpacked = 0
    started = time.perf_counter()
    for seq, start in enumerate(range(0, len(items), page_size)):
        packed = [pack_item(item) for item in items[start : start + page_size]]
        frame = {
            "t": "batch",
            "sid": sid,
            "p": 0,
            "seq": seq,
            "n": len(packed),
            "items": join_items(packed),
        }
        decoded = decode_frame(encode_frame(frame))
        unpacked += len(unpack_items(decoded["items"], decoded["n"]))
    seconds = time.perf_counter() - started
    assert unpacked == len(items)
    return Raw(page_size, len(items), seconds, len(items) / seconds)


async def start_nodes(warehouse: Path, layout: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Two delta-rs nodes on 127.0.0.1 (no JVM) allowing ``NOOP_RECEIVER``: the first node's
    address, and how to stop them."""
    from deltaflow.server import NodeConfig, start_local_nodes
    from deltaflow.testing import NodeProcess, wait_for_members

    if layout == "process":
        extra = ["--engine", "delta-rs", "--receiver", NOOP_RECEIVER]
        p1 = await NodeProcess("node-1", warehouse, extra=extra).start()
        p2 = await NodeProcess("node-2", warehouse, peers=[p1.address], extra=extra).start()
        procs = [p1, p2]
    else:
        nodes = await start_local_nodes(
            2,
            NodeConfig(
                node_id="node-1",
                warehouse=warehouse,
                port=0,
                engine="delta-rs",
                receivers=[NOOP_RECEIVER],
            ),
        )

    async def stop() -> None:
        if layout == "process":
            for proc in reversed(procs):
                await proc.stop()
        else:
            for node in reversed(nodes):
                await node.stop()

    address = procs[0].address if layout == "process" else nodes[0].address
    if layout == "process":  # both members in each node's view before anything is timed
        await wait_for_members([proc.address for proc in procs])
    return address, stop


async def stream(
    address: str, items: list[dict[str, Any]], page_size: int, max_in_flight: int
) -> tuple[Any, float]:
    """Stream ``items`` through a fresh client into the NoOp receiver; summary and seconds."""
    import deltaflow

    options = deltaflow.StreamerOptions(page_size=page_size, max_in_flight=max_in_flight)
    async with deltaflow.connect([address]) as client:
        started = time.perf_counter()
        summary = await client.stream_data(items, receiver=NOOP_RECEIVER, key="id", options=options)
        seconds = time.perf_counter() - started
    return summary, seconds


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# -- report -------------------------------------------------------------------------------


def print_table(results: list[Result]) -> None:
    """Print the results table."""
    print(STAMP_LINE)
    print(
        f"{'layout':>8}{'page':>7}{'in-flight':>10}{'items':>10}{'time':>8}{'deltaflow/s':>13}"
        f"{'raw/s':>12}{'ratio':>8}{'batches':>9}{'mean batch':>12}  goal"
    )
    print(STAMP_LINE)
    for r in results:
        goal = "ok" if r.ratio >= GOAL else "below"
        print(
            f"{r.layout:>8}{r.page_size:>7,}{r.max_in_flight:>10}{r.items:>10,}{r.seconds:>7.2f}s"
            f"{r.items_per_s:>13,.0f}{r.raw_items_per_s:>12,.0f}{r.ratio:>7.1%}"
            f"{r.batches:>9,}{r.mean_batch:>12,.0f}  {goal}"
        )
    print(STAMP_LINE)
    print(
        "deltaflow/s: items acked per second of stream_data, one client -> two nodes (Discard "
        "receiver);\nlayout: process = each node a `deltaflow serve` process, shared = client and "
        "nodes in one process (one core);\nraw/s: pack_item + join_items + encode_frame + "
        "decode_frame + unpack_items of the same items, page-sized frames, no network;\n"
        f"goal: ratio >= {GOAL:.0%}. mean batch < page: buffers cut by the flush timer or at the "
        "end of stream."
    )


async def measure(
    layout: str,
    address: str,
    items: list[dict[str, Any]],
    page: int,
    window: int,
    rounds: int,
    raws: dict[int, list[Raw]],
) -> Result:
    """``rounds`` paired rounds (raw, then deltaflow) of one configuration; the median one."""
    measured: list[Result] = []
    for _ in range(rounds):
        raw = measure_raw(items, page)
        raws.setdefault(page, []).append(raw)
        summary, seconds = await stream(address, items, page, window)
        batches = sum(s.batches_acked for s in summary.per_node.values())
        rate = summary.items_acked / seconds
        measured.append(
            Result(
                layout=layout,
                page_size=page,
                max_in_flight=window,
                items=summary.items_acked,
                seconds=seconds,
                items_per_s=rate,
                raw_items_per_s=raw.items_per_s,
                ratio=rate / raw.items_per_s,
                batches=batches,
                mean_batch=summary.items_acked / batches if batches else 0.0,
                retried=summary.batches_retried,
            )
        )
    ratios = tuple(r.ratio for r in measured)
    median = sorted(measured, key=lambda r: r.ratio)[len(measured) // 2]
    return replace(
        median,
        ratios=ratios,
        items=min(r.items for r in measured),
        retried=sum(r.retried for r in measured),
    )


def run(
    total: int,
    pages: list[int],
    in_flight: list[int],
    out_dir: Path,
    rounds: int = ROUNDS,
    layouts: Sequence[str] = LAYOUTS,
) -> int:
    """Measure every configuration of every layout, print the tables and write the JSON."""
    out_dir.mkdir(parents=True, exist_ok=True)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"deltaflow transport benchmark: {total:,} items per round, {rounds} rounds per "
        f"configuration, pages {pages}, max_in_flight {in_flight}, layouts {list(layouts)}, "
        f"{os.cpu_count()} cores, load {load}",
        flush=True,
    )
    began = time.monotonic()
    items = make_items(total)
    warehouse = Path(tempfile.mkdtemp(prefix="deltaflow-bench-transport-"))
    raws: dict[int, list[Raw]] = {}
    results: list[Result] = []

    async def main() -> None:
        for layout in layouts:
            address, stop = await start_nodes(warehouse / layout, layout)
            try:
                # Untimed: first connections, imports and first-use costs.
                await stream(address, items[:WARMUP_ITEMS], 1_000, 16)
                for page in pages:
                    for window in in_flight:
                        result = await measure(layout, address, items, page, window, rounds, raws)
                        results.append(result)
                        print(
                            f"{layout:>7} page {page:>6,}, max_in_flight {window:>2}: "
                            f"{result.items_per_s:>10,.0f} items/s, raw "
                            f"{result.raw_items_per_s:>10,.0f}: {result.ratio:.1%} "
                            f"(rounds {', '.join(f'{r:.1%}' for r in result.ratios)})",
                            flush=True,
                        )
            finally:
                await stop()

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(warehouse, ignore_errors=True)
    rss = _peak_rss_mib()
    elapsed = time.monotonic() - began
    print(f"\ntotal benchmark time {elapsed:.0f}s\n")
    print_table(results)
    print(
        f"peak RSS {rss:.0f} MiB (ru_maxrss of this process: the client, the nodes of the "
        f"shared layout, and the {total:,} pre-generated items)"
    )
    out = out_dir / "transport.json"
    out.write_text(
        json.dumps(
            {
                "items": total,
                "cores": os.cpu_count(),
                "seconds": elapsed,
                "peak_rss_mib": rss,
                "goal_ratio": GOAL,
                "rounds": rounds,
                "raw": [asdict(r) for page_raws in raws.values() for r in page_raws],
                "results": [asdict(r) for r in results],
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    good = all(r.items == total and r.retried == 0 for r in results)
    return 0 if good else 1


def _int_list(text: str) -> list[int]:
    values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=DEFAULT_ITEMS, help="items per configuration")
    parser.add_argument(
        "--pages",
        type=_int_list,
        default=list(PAGE_SIZES),
        help="comma-separated page sizes (default: %(default)s)",
    )
    parser.add_argument(
        "--in-flight",
        type=_int_list,
        default=list(IN_FLIGHT),
        help="comma-separated max_in_flight values (default: %(default)s)",
    )
    parser.add_argument(
        "--layout",
        choices=[*LAYOUTS, "both"],
        default="both",
        help="nodes in processes of their own, in this process, or both (default)",
    )
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help="paired rounds per configuration (median)"
    )
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="where results go")
    args = parser.parse_args(argv)
    if args.items < 1 or args.rounds < 1:
        parser.error("--items and --rounds must be at least 1")
    layouts = LAYOUTS if args.layout == "both" else (args.layout,)
    return run(args.items, args.pages, args.in_flight, args.out_dir, args.rounds, layouts)


if __name__ == "__main__":
    sys.exit(main())
