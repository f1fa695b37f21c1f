"""The client's CPU per row on an Arrow source, without nodes: routing by key column, pages
cut per partition and encoded as Arrow IPC (what a stream does before its frames are sent).

The ingest bench's rows (``bench/ingest.py``'s generator: id, key, ts, value, a 100-character
payload, ~1% deletes) in record batches of ``--batch`` rows are admitted into 64 partitions,
pages of 4,000 rows, ``--together`` batches at a time (what a source that outpaces the
client hands over at once). Prints CPU microseconds per row for each combination, the least
of three passes after one that warms the allocator, and the ratio to one 10,000-row batch at a time.

Usage: ``python bench/client_cpu.py [--rows N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from ingest import COLUMNS, arrow_of, generate

from deltaflow import DELETE_COLUMN
from deltaflow.client.accumulator import Accumulator, Batch, SizeBatchCreator
from deltaflow.client.admission import Admission
from deltaflow.client.ledger import Ledger
from deltaflow.columnar import encode_page

PARTITIONS = 64
PAGE_ROWS = 4000
MAX_BATCH_BYTES = 4 << 20


def batches_of(rows: int, batch: int) -> list[Any]:
    """The bench's rows as record batches of ``batch`` rows (made before timing)."""
    out, pending = [], []
    for chunk in generate(rows):
        pending.append(chunk)
        if sum(c.table.num_rows for c in pending) >= batch:
            out.append(arrow_of(pending).rename_columns([*COLUMNS, DELETE_COLUMN]))
            pending = []
    if pending:
        out.append(arrow_of(pending).rename_columns([*COLUMNS, DELETE_COLUMN]))
    return out


def admit_all(batches: list[Any], together: int) -> float:
    """CPU seconds to admit ``batches``, ``together`` at a time, and encode every page."""
    loop = asyncio.new_event_loop()

    def encode(batch: Batch) -> None:
        encode_page(batch.items)  # type: ignore[arg-type]

    accumulator = Accumulator(
        batch_creator=SizeBatchCreator(PAGE_ROWS, MAX_BATCH_BYTES),
        flush_interval=0,
        on_cut=encode,
        call_later=loop.call_later,
    )
    admission = Admission(
        key=lambda row: row["id"],
        key_columns=["id"],
        partitions=PARTITIONS,
        max_batch_bytes=MAX_BATCH_BYTES,
        accumulator=accumulator,
        ledger=Ledger(),
    )
    started = time.process_time()
    for i in range(0, len(batches), together):
        admission.admit(batches[i : i + together], None)
    for batch in accumulator.drain():
        encode(batch)
    seconds = time.process_time() - started
    loop.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per combination")
    args = parser.parse_args()
    print(f"client CPU per row, Arrow source, {args.rows:,} rows, {PARTITIONS} partitions")
    print(f"{'batch rows':>10} {'together':>8} {'µs/row':>7} {'ratio':>6}")
    base = None
    for batch, together in ((10_000, 1), (10_000, 2), (10_000, 4), (40_000, 1), (100_000, 1)):
        batches = batches_of(args.rows, batch)
        admit_all(batches, together)  # warms the allocator
        micros = min(admit_all(batches, together) for _ in range(3)) / args.rows * 1e6
        base = base or micros
        print(f"{batch:>10,} {together:>8} {micros:>7.2f} {micros / base:>6.2f}")


if __name__ == "__main__":
    main()
